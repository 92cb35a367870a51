"""The generic DPLR and RWKV-7 public ops (fla's names and meaning of a, b)."""

from __future__ import annotations

import torch

from fastweight import fla_compat
from fastweight.ops.common import _op

__all__ = [  # the public functions, re-exported by fastweight.ops
    "chunk_dplr_delta_rule", "fused_recurrent_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_rwkv7",
    "chunk_iplr_delta_rule", "fused_recurrent_iplr_delta_rule"]


def _dplr(mode, q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, backend):
    return _op("dplr_delta_rule", mode, backend, dict(q=q, k=k, v=v, a=a, b=b, gk=gk), scale=scale,
               key=("a", "b", "gk"), log=("gk",), initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                          disable_recompute=False, cp_context=None, lower_bound=None, *, backend=None, **kwargs):
    """Generic DPLR, fla's argument meaning: S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,
    o_t = S_t^T (scale q_t). Note fla's ``a`` is read against the state (``a^T S``) and ``b`` is
    the write direction: the core's (a, b) are fla's (b, a).

    q, k, a, b, gk (log decay, <= 0): [B, T, H, K]; v: [B, T, HV, V]. Returns (o, final state or None).
    ``safe_gate`` and ``lower_bound`` (the caller's promise ``lower_bound <= gk < 0``) are accepted
    and change nothing: in fla they only license its tensor-core factorisation of a chunk's decays;
    ours decide that per chunk from the gates themselves (``fastweight.kernels.dplr``), so the result
    is the same with or without them (``fla_compat.gate_bound``).
    """
    fla_compat.extra_kwargs("chunk_dplr_delta_rule", dict(kwargs, chunk_size=chunk_size))
    fla_compat.refuse("chunk_dplr_delta_rule", cp_context=(cp_context, None))
    fla_compat.gate_bound("chunk_dplr_delta_rule", safe_gate, lower_bound)
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return _dplr("chunk", q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                    output_final_state=False, reverse=False, cu_seqlens=None, *, backend=None):
    """Generic DPLR one token at a time; as ``chunk_dplr_delta_rule``."""
    x, back = fla_compat.time_reversed(reverse, cu_seqlens, dict(q=q, k=k, v=v, a=a, b=b, gk=gk))
    o, S = _dplr("fused_recurrent", x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], scale, initial_state,
                 output_final_state, cu_seqlens, backend)
    return back(o), S


def _rwkv7(mode, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, backend):
    return _op("rwkv7", mode, backend, dict(r=r, w=w, k=k, v=v, a=a, b=b), scale=scale, names=("r", "k", "v"),
               key=("w", "a", "b"), log=("w",), initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                cu_seqlens_cpu=None, safe_gate=False, chunk_size=None, disable_recompute=False, cp_context=None,
                lower_bound=None, *, backend=None):
    """RWKV-7 in fla's DPLR meaning: S_t = (Diag(exp w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale r_t).

    The layer passes a = -kappa^ (normalised removal key), b = kappa^ * iclr, k = the replacement
    key k~ (``fastweight.mechanisms.rwkv7.to_op`` does this preparation). r, w (log decay, <= 0),
    k, a, b: [B, T, H, K]; v: [B, T, HV, V]. scale defaults to 1.0 here, as fla's chunk_rwkv7.
    Returns (o [B, T, HV, V], final state [N, HV, K, V] or None). fla's own RWKV7Attention passes
    ``safe_gate=True, lower_bound=-exp(-1/2), chunk_size=64``: accepted, and the result is the op's
    without them (they select fla's kernel numerics only; ``chunk_dplr_delta_rule``).
    """
    fla_compat.extra_kwargs("chunk_rwkv7", dict(chunk_size=chunk_size))
    fla_compat.refuse("chunk_rwkv7", cp_context=(cp_context, None))
    fla_compat.gate_bound("chunk_rwkv7", safe_gate, lower_bound)
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return _rwkv7("chunk", r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None, output_final_state=True,
                          cu_seqlens=None, *, backend=None):
    """RWKV-7 one token at a time; as ``chunk_rwkv7``, but with fla's fused_recurrent_rwkv7 defaults:
    scale K^-0.5 and the final state returned."""
    return _rwkv7("fused_recurrent", r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                  backend)


def _no_decay(a):
    """gk = 0 (log of 1) in a's shape for the identity-plus-low-rank rule; a stays for the op's checks to name."""
    return torch.zeros_like(a, dtype=torch.float32) if isinstance(a, torch.Tensor) else None


def chunk_iplr_delta_rule(q, k, v, a, b, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                          cu_seqlens_cpu=None, *, backend=None, **kwargs):
    """fla's identity-plus-low-rank rule: S_t = (I + b_t a_t^T) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t),
    the DPLR rule without decay (``chunk_dplr_delta_rule`` with gk = 0; fla's meaning of a and b).

    q, k, a, b: [B, T, H, K]; v: [B, T, HV, V]. Returns (o, final state [N, HV, K, V] or None).
    """
    fla_compat.extra_kwargs("chunk_iplr_delta_rule", kwargs)
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return _dplr("chunk", q, k, v, a, b, _no_decay(a), scale, initial_state, output_final_state, cu_seqlens,
                 backend)


def fused_recurrent_iplr_delta_rule(q, k, v, a, b, scale=None, initial_state=None, output_final_state=False,
                                    cu_seqlens=None, *, backend=None):
    """The identity-plus-low-rank rule one token at a time; as ``chunk_iplr_delta_rule``."""
    return _dplr("fused_recurrent", q, k, v, a, b, _no_decay(a), scale, initial_state, output_final_state,
                 cu_seqlens, backend)
