"""Linear attention (Katharopoulos et al. 2020, arXiv:2006.16236).

    S_t = S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t)

Online learning: one unit gradient step on the Hebbian loss ``-<S^T k_t, v_t>`` (pure
accumulation, no error correction). DPLR: w = 1, a = b = 0, write (k, v).
"""

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, hebbian, outer, randn, reference_op,
                                        register, register_mixer, register_op)


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw))


def step(S, x):
    return S + outer(x["k"], x["v"])


def to_dplr(inputs):
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], a=None, b=None, gk=None)


def objective(S, x):
    return S, [(None, hebbian(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="linear_attention",
    title="Linear attention",
    paper="arXiv:2006.16236",
    kernel_path="scalar_decay",
    dplr_in_words="w=1, a=0, b=0, write (k, v)",
    input_names=("q", "k", "v"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="linear_attn",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], normalize=False),
))


def _dplr(q, k, v, normalize=False, **_):
    if normalize:
        raise NotImplementedError("the generic DPLR form of linear attention has no normaliser")
    return dict(q=q, k=k, v=v, a=None, b=None, gk=None)


def _torch(q, k, v, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64, **_):
    from fastweight.chunk.decay import decay_chunk
    return decay_chunk(q, k, v, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(q, k, v, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, launch=None,
                  **_):
    from fastweight.kernels.decay import DecayLaunch, chunk_decay
    return chunk_decay(q, k, v, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, launch=launch or DecayLaunch())


def _triton_fused_recurrent(q, k, v, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    return fused_recurrent(q, k, v, spec=Spec(), **kw)


OP = register_op(Op(name="linear_attn", mechanism="linear_attention", args=("q", "k", "v"), family="decay",
                    reference=reference_op(MECHANISM), dplr=_dplr, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk), triton_fused_recurrent=Impl(_triton_fused_recurrent)))
register_mixer(Mixer(name="la", op="linear_attn", layer="decay"))
