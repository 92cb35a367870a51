"""What every family's public ops share: validation and dispatch (``_op``), beta's range."""

from __future__ import annotations

import torch

from fastweight import checks
from fastweight.dispatch import call

_NEG_EIGVAL_HINT = " (pass allow_neg_eigval=True for beta in [0, 2])"


def _op(op, mode, backend, tensors, *, scale, initial_state, output_final_state, cu_seqlens,
        names=("q", "k", "v"), key=(), head=(), head_k=(), params=None, optional=(), log=(),
        beta_max=None, use_qk_l2norm=False, l2norm_tensors=("q", "k"), same_heads=False, substeps=1,
        substep_args=(), options=None):
    """Validate ``tensors`` (the op's tensor arguments by name) and dispatch.

    names: the (query, key, value) arguments; key: more [B, T, H, K] tensors (expanded to HV
    heads with q/k); head: [B, T, HV]; head_k: [B, T, HV, K]; params: name -> shape in
    symbols ("H", "HV", "K"); optional: may be None; log: log-space gates (<= 0); beta_max:
    the upper bound of ``beta`` (lower bound 0); same_heads: grouped value heads unsupported;
    substep_args: tensors with ``substeps`` rows per token along T (their length checked by the
    caller), shape-checked at one row per token; options: passed on to the implementation.
    """
    qn, kn, vn = names
    shaped = {**tensors, **{x: tensors[x][:, ::substeps] for x in substep_args}}
    B, T, H, K, HV, V = checks.check_qkv(shaped[qn], shaped[kn], shaped[vn], names=names)
    if same_heads and HV != H:
        raise ValueError(f"`{vn}` must have the {H} heads of `{qn}` for this op, got {HV}")
    n = checks.check_cu_seqlens(cu_seqlens, B, T) or B
    checks.check_initial_state(initial_state, n, HV, K, V)
    dims = dict(H=H, HV=HV, K=K)
    shapes = {**{x: ((B, T, H, K), "[B, T, H, K] like `k`") for x in key},
              **{x: ((B, T, HV), "[B, T, HV]: one per value head") for x in head},
              **{x: ((B, T, HV, K), "[B, T, HV, K]") for x in head_k},
              **{x: (tuple(dims[d] for d in s), f"[{', '.join(s)}]") for x, s in (params or {}).items()}}
    for name, (shape, layout) in shapes.items():
        checks.check_tensor(name, shaped[name], ndim=len(shape), shape=shape, allow_none=name in optional,
                            hint=f" (expected {layout})")
    checks.check_same_device(**tensors, initial_state=initial_state, cu_seqlens=cu_seqlens)
    vectors = [x for x in (qn, kn, vn, *key) if x not in log]
    checks.check_same_dtype(**{x: tensors[x] for x in vectors})
    checks.check_float64_only_with_float64(tensors[qn].dtype, **tensors, initial_state=initial_state)
    checks.check_finite(**{x: t for x, t in tensors.items() if x not in log}, initial_state=initial_state)
    for name in log:
        checks.check_log_gate(name, tensors[name])
    if beta_max is not None:
        checks.check_range("beta", tensors["beta"], 0.0, beta_max, "" if beta_max != 1 else _NEG_EIGVAL_HINT)
    scale = checks.check_scale(scale, K)
    return call(op, mode, backend, tensors, key_tensors=(qn, kn, *key), use_qk_l2norm=use_qk_l2norm,
                l2norm_tensors=l2norm_tensors, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, **(options or {}))


def _beta_max(allow_neg_eigval):
    return 2.0 if allow_neg_eigval else 1.0


def _default_beta(beta, v):
    """beta None means 1 (fla's default where beta is optional)."""
    return v.new_ones(v.shape[:3]) if beta is None and isinstance(v, torch.Tensor) else beta
