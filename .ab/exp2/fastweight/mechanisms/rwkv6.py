"""RWKV-6 "Finch" (Peng et al. 2024, arXiv:2404.05892): GLA plus a current-token bonus.

    S_t = Diag(exp w_t) S_{t-1} + k_t v_t^T
    o_t = S_{t-1}^T (scale r_t) + (scale r_t . (u * k_t)) v_t

``q`` is RWKV's receptance r; ``w`` [B, T, H, K] the log decay; ``_u`` [H, K] the bonus.
The state update is GLA's (same objective: Hebbian plus row-wise weight decay); the bonus
only changes the readout. DPLR: w = exp(w_t) (vector), a = b = 0, write (k, v), readout with u.
"""

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, hebbian, outer, randn, reference_op,
                                        register, register_mixer, register_op, sample_log_decay, weight_decay)
from fastweight.reference.recurrence import bonus_readout


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw), w=sample_log_decay((B, T, H, K), **kw),
                _u=randn((H, K), **kw) * 0.5)


def step(S, x):
    return x["w"].exp()[..., None] * S + outer(x["k"], x["v"])


def to_dplr(inputs):
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], a=None, b=None, gk=inputs["w"], u=inputs["_u"])


def objective(S, x):
    return S, [(None, weight_decay(x["w"].exp())), (None, hebbian(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="rwkv6",
    title="RWKV-6",
    paper="arXiv:2404.05892",
    kernel_path="vector_decay",
    dplr_in_words="w=exp(w_t) (vector), a=0, b=0, write (k, v); readout S_{t-1} + bonus u",
    input_names=("q", "k", "v", "w", "_u"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    readout=bonus_readout,
    op="rwkv6",
    to_op=lambda x: dict(r=x["q"], k=x["k"], v=x["v"], w=x["w"], u=x["_u"]),
))


def _torch(r, k, v, w, u, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64,
           **_):
    from fastweight.chunk.decay import decay_chunk
    return decay_chunk(r, k, v, w, u, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(r, k, v, w, u, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                  launch=None, **_):
    from fastweight.kernels.decay import DecayLaunch, chunk_decay
    return chunk_decay(r, k, v, w, u=u, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, exclusive=True,
                       launch=launch or DecayLaunch())


def _triton_fused_recurrent(r, k, v, w, u, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    return fused_recurrent(r, k, v, spec=Spec(bonus=True), gk=w, u=u, **kw)


def _dplr(r, k, v, w, u, **_):
    return dict(q=r, k=k, v=v, a=None, b=None, gk=w, u=u)


OP = register_op(Op(name="rwkv6", mechanism="rwkv6", args=("r", "k", "v", "w", "u"), family="decay",
                    gates={"w": "channel"},
                    reference=reference_op(MECHANISM, lambda r, k, v, w, u, **_: dict(q=r, k=k, v=v, w=w, _u=u)),
                    dplr=_dplr, torch=Impl(_torch), triton_chunk=Impl(_triton_chunk),
                    triton_fused_recurrent=Impl(_triton_fused_recurrent)))
register_mixer(Mixer(name="rwkv6", op="rwkv6", layer="rwkv6"))
