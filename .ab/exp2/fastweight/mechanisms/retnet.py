"""RetNet's retention (Sun et al. 2023, arXiv:2307.08621).

    S_t = gamma S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t),    gamma fixed per head

``_log_gamma`` [H] holds log gamma; RetNet's own choice is gamma_h = 1 - 2^(-5-h)
(:func:`retnet_log_gamma`, what ``chunk_retention`` uses). Online learning: a unit step on
the Hebbian loss plus the weight decay ``1/2 (1 - gamma) ||S||_F^2``.
DPLR: w = gamma, a = b = 0, write (k, v).
"""

import math

import torch

from fastweight.mechanisms.base import (Impl, Mechanism, Mixer, Op, get_op, hebbian, outer, randn,
                                        reference_op, register, register_mixer, register_op, weight_decay)


def retnet_log_gamma(H: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """log(1 - 2^(-5-h)) for h = 0..H-1: RetNet's per-head decays, in log space. [H]"""
    return torch.tensor([math.log1p(-2.0 ** (-5 - h)) for h in range(H)], dtype=dtype, device=device)


def sample(B, T, H, K, V, *, dtype, device, generator):
    kw = dict(dtype=dtype, device=device, generator=generator)
    return dict(q=randn((B, T, H, K), **kw), k=randn((B, T, H, K), **kw) * K ** -0.5,
                v=randn((B, T, H, V), **kw), _log_gamma=retnet_log_gamma(H, dtype, device))


def step(S, x):
    return x["_log_gamma"].exp()[:, None, None] * S + outer(x["k"], x["v"])


def to_dplr(inputs):
    B, T, H = inputs["k"].shape[:3]
    return dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], a=None, b=None,
                gk=inputs["_log_gamma"].expand(B, T, H))


def objective(S, x):
    gamma = x["_log_gamma"].exp().expand(S.shape[:2])
    return S, [(None, weight_decay(gamma)), (None, hebbian(x["k"], x["v"]))], False


MECHANISM = register(Mechanism(
    name="retnet",
    title="RetNet",
    paper="arXiv:2307.08621",
    kernel_path="scalar_decay",
    dplr_in_words="w=gamma (fixed per head), a=0, b=0, write (k, v)",
    input_names=("q", "k", "v", "_log_gamma"),
    sample=sample,
    step=step,
    to_dplr=to_dplr,
    objective=objective,
    op="simple_gla",
    to_op=lambda x: dict(q=x["q"], k=x["k"], v=x["v"], g_gamma=x["_log_gamma"]),
))


def _reference_inputs(q, k, v, **_):
    return dict(q=q, k=k, v=v, _log_gamma=retnet_log_gamma(v.shape[2], dtype=torch.float64, device=v.device))


def _dplr(q, k, v, **_):
    B, T, H = q.shape[:3]
    return dict(q=q, k=k, v=v, a=None, b=None, gk=retnet_log_gamma(H, device=q.device).expand(B, T, H))


def _torch(q, k, v, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64, **_):
    from fastweight.chunk.common import compute_dtype
    g_gamma = retnet_log_gamma(q.shape[2], dtype=compute_dtype(q, k, v), device=q.device)
    return get_op("simple_gla").torch.fn(q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                         chunk_size=chunk_size)


def _triton_chunk(q, k, v, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, launch=None,
                  **_):
    from fastweight.kernels.decay import DecayLaunch, chunk_decay
    return chunk_decay(q, k, v, g_gamma=retnet_log_gamma(q.shape[2], device=q.device), scale=scale,
                       initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                       launch=launch or DecayLaunch())


def _triton_fused_recurrent(q, k, v, **kw):
    from fastweight.kernels.fused_recurrent import Spec, fused_recurrent
    return fused_recurrent(q, k, v, spec=Spec(), g_gamma=retnet_log_gamma(v.shape[2], device=v.device), **kw)


OP = register_op(Op(name="retention", mechanism="retnet", args=("q", "k", "v"), family="decay",
                    reference=reference_op(MECHANISM, _reference_inputs), dplr=_dplr, torch=Impl(_torch),
                    triton_chunk=Impl(_triton_chunk), triton_fused_recurrent=Impl(_triton_fused_recurrent)))
register_mixer(Mixer(name="retnet", op="retention", layer="decay"))
