"""Mamba-2's SSD (Dao, Gu 2024, arXiv:2405.21060), one head's state as a fast weight.

    S_t = exp(dt_t A) S_{t-1} + dt_t k_t v_t^T,    o_t = S_t^T (scale q_t)

In Mamba's names q = C, k = B, v = x, ``dt`` [B, T, H] > 0 and ``_A`` [H] < 0; the skip
``D x`` lives in the layer. Online learning: weight decay ``1/2 (1 - alpha_t) ||S||_F^2``
plus the Hebbian loss with learning rate dt_t. DPLR: w = alpha_t = exp(dt A) (scalar),
a = b = 0, write (dt k, v).
"""

import torch

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, get, hebbian, outer, rand, randn,
                                        register, register_mixer, register_op, weight_decay)


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw),
                dt=torch.nn.functional.softplus(randn((B, T, H), **kw) - 1),
                _A=-(0.1 + rand((H,), **kw)))


def step(S, x):
    dt = x["dt"]
    alpha = (dt * x["_A"]).exp()
    return alpha[..., None, None] * S + outer(dt[..., None] * x["k"], x["v"])


def to_dplr(inputs):
    dt = inputs["dt"]
    return dict(q=inputs["q"], k=dt[..., None] * inputs["k"], v=inputs["v"], a=None, b=None,
                gk=dt * inputs["_A"])


def objective(S, x):
    alpha = (x["dt"] * x["_A"]).exp()
    return S, [(None, weight_decay(alpha)), (x["dt"][..., None, None], hebbian(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="mamba2",
    title="Mamba-2",
    paper="arXiv:2405.21060",
    kernel_path="scalar_decay",
    dplr_in_words="w=exp(dt A) (scalar), a=0, b=0, write (dt k, v)",
    input_names=("q", "k", "v", "dt", "_A"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="simple_gla",
    to_op=lambda x: dict(q=x["q"], k=x["dt"][..., None] * x["k"], v=x["v"], g=x["dt"] * x["_A"]),
))


def _gk(q, v, g, g_gamma):
    """g + g_gamma as one log decay per head [B, T, H] (fp32; float64 for float64 inputs)."""
    B, T, H = q.shape[:3]
    gk = torch.zeros(B, T, H, dtype=torch.float64 if v.dtype == torch.float64 else torch.float32, device=v.device)
    if g is not None:
        gk = gk + g
    if g_gamma is not None:
        gk = gk + g_gamma
    return gk


def _reference(q, k, v, g=None, g_gamma=None, *, scale, initial_state=None, output_final_state=False,
               cu_seqlens=None, **_):
    """A scalar gate per head is GLA's vector gate, constant across the key channels."""
    gk = _gk(q, v, g, g_gamma)
    return get("gla").recurrent(dict(q=q, k=k, v=v, g=gk[..., None].expand(*gk.shape, q.shape[-1])), scale=scale,
                                initial_state=initial_state, output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens)


def _dplr(q, k, v, g=None, g_gamma=None, **_):
    gk = g if g_gamma is None else _gk(q, v, g, g_gamma)
    return dict(q=q, k=k, v=v, a=None, b=None, gk=gk)


def _torch(q, k, v, g=None, g_gamma=None, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
           chunk_size=64, **_):
    from fastweight.chunk.common import compute_dtype
    from fastweight.chunk.decay import decay_chunk
    if g_gamma is not None:
        # the sum in the compute dtype: in a 16-bit gate's dtype it would round the decay
        dt = compute_dtype(q, k, v, g, g_gamma)
        g_gamma = g_gamma.to(dt).expand(*q.shape[:2], q.shape[2])
        g = g_gamma if g is None else g.to(dt) + g_gamma
    return decay_chunk(q, k, v, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def _triton_chunk(q, k, v, g=None, g_gamma=None, *, scale, initial_state=None, output_final_state=False,
                  cu_seqlens=None, launch=None, **_):
    from fastweight.kernels.decay import DecayLaunch, chunk_decay
    return chunk_decay(q, k, v, g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, launch=launch or DecayLaunch())


def _triton_fused_recurrent(q, k, v, g=None, g_gamma=None, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    return fused_recurrent(q, k, v, spec=Spec(), g=g, g_gamma=g_gamma, **kw)


OP = register_op(Op(name="simple_gla", mechanism="mamba2", args=("q", "k", "v", "g", "g_gamma"), family="decay",
                    gates={"g": "head"}, reference=_reference, dplr=_dplr, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk), triton_fused_recurrent=Impl(_triton_fused_recurrent)))
register_mixer(Mixer(name="mamba2", op="simple_gla", layer="mamba2"))
