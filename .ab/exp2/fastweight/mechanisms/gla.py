"""Gated linear attention (Yang et al. 2023, arXiv:2312.06635).

    S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t),    alpha_t = exp(g_t)

``g`` [B, T, H, K]: a log decay per key channel. Online learning: the Hebbian loss plus the
row-wise weight decay ``1/2 ||sqrt(Diag(1 - alpha_t)) S||_F^2``. DPLR: w = alpha_t (vector),
a = b = 0, write (k, v).
"""

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, hebbian, outer, randn, reference_op,
                                        register, register_mixer, register_op, sample_log_decay, weight_decay)


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw), g=sample_log_decay((B, T, H, K), **kw))


def step(S, x):
    return x["g"].exp()[..., None] * S + outer(x["k"], x["v"])


def to_dplr(inputs):
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], a=None, b=None, gk=inputs["g"])


def objective(S, x):
    return S, [(None, weight_decay(x["g"].exp())), (None, hebbian(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="gla",
    title="GLA",
    paper="arXiv:2312.06635",
    kernel_path="vector_decay",
    dplr_in_words="w=alpha_t (vector), a=0, b=0, write (k, v)",
    input_names=("q", "k", "v", "g"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="gla",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"]),
))


def _torch(q, k, v, g, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64, **_):
    from fastweight.chunk.decay import decay_chunk
    return decay_chunk(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(q, k, v, g, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                  launch=None, **_):
    from fastweight.kernels.decay import DecayLaunch, chunk_decay
    return chunk_decay(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, launch=launch or DecayLaunch())


def _triton_fused_recurrent(q, k, v, g, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    return fused_recurrent(q, k, v, spec=Spec(), gk=g, **kw)


def _dplr(q, k, v, g, **_):
    return dict(q=q, k=k, v=v, a=None, b=None, gk=g)


OP = register_op(Op(name="gla", mechanism="gla", args=("q", "k", "v", "g"), family="decay", gates={"g": "channel"},
                    reference=reference_op(MECHANISM), dplr=_dplr, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk), triton_fused_recurrent=Impl(_triton_fused_recurrent)))
register_mixer(Mixer(name="gla", op="gla", layer="decay"))
