"""HGRN2 (Qin et al. 2024, arXiv:2404.07904): the forget gate's complement is the key.

    S_t = Diag(alpha_t) S_{t-1} + (1 - alpha_t) v_t^T,    o_t = S_t^T (scale q_t),    alpha_t = exp(g_t)

``g`` [B, T, H, K] log forget gate; there is no separate key. Online learning: the Hebbian
loss ``-<S^T (1 - alpha_t), v_t>`` plus the row-wise weight decay. DPLR: w = alpha_t (vector),
a = b = 0, write (1 - alpha_t, v).
"""

import torch

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, hebbian, outer, randn, reference_op,
                                        register, register_mixer, register_op, sample_log_decay, weight_decay)


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), v=randn((B, T, H, V), **kw),
                g=sample_log_decay((B, T, H, K), **kw))


def step(S, x):
    return x["g"].exp()[..., None] * S + outer(-torch.expm1(x["g"]), x["v"])


def to_dplr(inputs):
    g = inputs["g"]
    return dict(q=inputs["q"], k=-torch.expm1(g), v=inputs["v"], a=None, b=None, gk=g)


def objective(S, x):
    g = x["g"]
    return S, [(None, weight_decay(g.exp())), (None, hebbian(-torch.expm1(g), x["v"]))], False


MECHANISM = register(Mechanism(
    name="hgrn2",
    title="HGRN2",
    paper="arXiv:2404.07904",
    kernel_path="vector_decay",
    dplr_in_words="w=alpha_t (vector), a=0, b=0, write (1 - alpha_t, v)",
    input_names=("q", "v", "g"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="hgrn2",
    to_op=lambda x: dict(q=x["q"], v=x["v"], g=x["g"]),
))


def _torch(q, v, g, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64, **_):
    """The key 1 - alpha_t is formed in the compute dtype (fp32, fp64 for fp64), not the gate's."""
    from fastweight.chunk.common import compute_dtype
    from fastweight.chunk.decay import decay_chunk
    k = -torch.expm1(g.to(compute_dtype(q, v, g)))
    return decay_chunk(q, k, v, g, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(q, v, g, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, launch=None,
                  **_):
    from fastweight.kernels.decay import DecayLaunch, chunk_decay
    k = (-torch.expm1(g.float())).to(q.dtype)
    return chunk_decay(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, launch=launch or DecayLaunch())


def _triton_fused_recurrent(q, v, g, **kw):
    """The key and the gate from one fp32 copy of g: the two gradients (which cancel in part) add in
    fp32 before the one cast to g's dtype. The key's value from expm1, its gradient -exp(g) from
    exp: expm1's backward uses 1 + expm1(g), which is 0 in fp32 for g below about -17."""
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    g32 = g.float()
    decay = g32.exp()
    key = -torch.expm1(g32).detach() + (decay.detach() - decay)
    return fused_recurrent(q, key, v, spec=Spec(), gk=g32, **kw)


def _dplr(q, v, g, **_):
    return dict(q=q, k=(1 - g.exp()).to(q.dtype), v=v, a=None, b=None, gk=g)


OP = register_op(Op(name="hgrn2", mechanism="hgrn2", args=("q", "v", "g"), family="decay", gates={"g": "channel"},
                    reference=reference_op(MECHANISM), dplr=_dplr, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk), triton_fused_recurrent=Impl(_triton_fused_recurrent)))
register_mixer(Mixer(name="hgrn2", op="hgrn2", layer="decay"))
