"""How a layer calls its recurrence: ``fastweight.ops.<mode>_<op>`` (fla's names), or, where
that op does not exist (yet), the same recurrence written as the generic DPLR op

    S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)

(fla's argument meaning: ``a`` is read against the state, ``b`` is the write direction).
Under ``torch.compile`` the call is opaque (a graph break): the ops validate their inputs and
pick kernels in Python, and compiling the rest of the model around them is what pays.
:func:`force_generic` routes every call through the DPLR op: the tests use it to check
that each specialised op and its DPLR form agree inside a layer.

Tensors are passed with fla's names: q (or r), k, v [B, T, H, K/V]; scalar gates g and
beta [B, T, H]; per-channel gates g / w [B, T, H, K]. All log decays are <= 0. The op runs
outside autocast, with every tensor but the log decays in v's dtype.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from fastweight import ops

MODES = ("chunk", "fused_recurrent")
# cast to v's dtype before the op; the log decays (g, w, gk) keep theirs (fp32 from the layers)
SAME_DTYPE_AS_V = ("q", "r", "k", "a", "b", "p", "u", "beta")
_FORCE_GENERIC = False
_BACKEND = None


@contextmanager
def use_backend(backend: str | None):
    """Within the block, every op runs on ``backend`` ("triton", "torch", "reference"; None = best)."""
    global _BACKEND
    old, _BACKEND = _BACKEND, backend
    try:
        yield
    finally:
        _BACKEND = old


def generic_forced() -> bool:
    """Whether :func:`force_generic` is on."""
    return _FORCE_GENERIC


def current_backend() -> str | None:
    """The backend set by :func:`use_backend` (None: the best for the device)."""
    return _BACKEND


@contextmanager
def force_generic(enabled: bool = True):
    """Within the block, every layer uses the generic DPLR op instead of its specialised one."""
    global _FORCE_GENERIC
    old, _FORCE_GENERIC = _FORCE_GENERIC, enabled
    try:
        yield
    finally:
        _FORCE_GENERIC = old


def _dplr(mode, q, k, v, a, b, gk, **kw):
    return getattr(ops, f"{mode}_dplr_delta_rule")(q, k, v, a, b, gk, **kw)


def _zeros(q):
    return torch.zeros_like(q)


def _linear_attn(mode, q, k, v, normalize=False, **kw):
    if normalize:
        raise NotImplementedError("the generic DPLR form of linear attention has no normaliser")
    return _dplr(mode, q, k, v, _zeros(q), _zeros(q), _zeros(q), **kw)


def _simple_gla(mode, q, k, v, g, **kw):
    return _dplr(mode, q, k, v, _zeros(q), _zeros(q), g[..., None].expand_as(q).contiguous(), **kw)


def _retention(mode, q, k, v, **kw):
    H = q.shape[2]
    log_gamma = torch.log1p(-torch.exp2(-5.0 - torch.arange(H, dtype=torch.float32, device=q.device)))
    return _simple_gla(mode, q, k, v, log_gamma.expand(*q.shape[:2], H), **kw)


def _gla(mode, q, k, v, g, **kw):
    return _dplr(mode, q, k, v, _zeros(q), _zeros(q), g, **kw)


def _delta_rule(mode, q, k, v, beta, **kw):
    b = beta[..., None] * k
    return _dplr(mode, q, b, v, k, -b, _zeros(q), **kw)


def _gated_delta_rule(mode, q, k, v, g, beta, **kw):
    b = beta[..., None] * k
    return _dplr(mode, q, b, v, g.exp()[..., None] * k, -b, g[..., None].expand_as(q).contiguous(), **kw)


def _longhorn(mode, q, k, v, beta, **kw):
    eps = beta / (1 + beta * (k.float() * k.float()).sum(-1)).to(beta.dtype)
    return _delta_rule(mode, q, k, v, eps, **kw)


def _comba(mode, q, k, v, p, g, beta, **kw):
    b = beta[..., None] * k
    return _dplr(mode, q, b, v, p, -b, g[..., None].expand_as(q).contiguous(), **kw)


def _hgrn2(mode, q, v, g, **kw):
    return _gla(mode, q, (1 - g.exp()).to(q.dtype), v, g, **kw)


def _kda(mode, q, k, v, g, beta, **kw):
    b = beta[..., None] * k
    return _dplr(mode, q, b, v, g.exp() * k, -b, g, **kw)


def _rwkv7(mode, r, w, k, v, a, b, **kw):
    return _dplr(mode, r, k, v, a, b, w, **kw)


def _rwkv6(mode, r, k, v, w, u, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    # the DPLR op has no bonus readout: RWKV-6's DPLR form is the definition with ``u``
    from fastweight.reference import dplr_recurrent
    return dplr_recurrent(r, k, v, gk=w, u=u, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)


GENERIC = {
    "linear_attn": _linear_attn,
    "retention": _retention,
    "simple_gla": _simple_gla,
    "gla": _gla,
    "rwkv6": _rwkv6,
    "delta_rule": _delta_rule,
    "gated_delta_rule": _gated_delta_rule,
    "kda": _kda,
    "longhorn": _longhorn,
    "comba": _comba,
    "hgrn2": _hgrn2,
    "rwkv7": _rwkv7,
}


def specialised(op: str, mode: str):
    """``fastweight.ops.<mode>_<op>`` if it exists, else None."""
    return getattr(ops, f"{mode}_{op}", None)


@torch.compiler.disable
def linear_op(op: str, mode: str, *, scale: float, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None, **tensors):
    """Run ``op`` (fla's name, e.g. "gated_delta_rule") in ``mode``; returns (o, final state or None)."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
    fn = None if _FORCE_GENERIC else specialised(op, mode)
    device = next(t.device for t in tensors.values() if isinstance(t, torch.Tensor))
    # the recurrence picks its own precision (fp32 states and gates): autocast stays outside
    with torch.autocast(device.type, enabled=False):
        return _linear_op(op, mode, fn, scale, initial_state, output_final_state, cu_seqlens, tensors)


def _linear_op(op, mode, fn, scale, initial_state, output_final_state, cu_seqlens, tensors):
    dtype = tensors["v"].dtype
    tensors = {n: t.to(dtype) if n in SAME_DTYPE_AS_V and isinstance(t, torch.Tensor) else t
               for n, t in tensors.items()}
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens)
    if _BACKEND is not None:
        kw["backend"] = _BACKEND
    if fn is not None:
        return fn(**tensors, **kw)
    if op not in GENERIC:
        raise NotImplementedError(f"no implementation of {mode}_{op}")
    tensors.pop("allow_neg_eigval", None)
    if tensors.pop("use_gate_in_kernel", False):  # Mamba-2's gate from its pre-activation g
        from fastweight.dispatch import mamba_gate
        tensors["g"] = mamba_gate(tensors["g"].float(), tensors.pop("A_log"), tensors.pop("dt_bias"))
    if tensors.pop("use_qk_l2norm_in_kernel", False):
        from fastweight.dispatch import l2norm
        tensors["q"], tensors["k"] = l2norm(tensors["q"]), l2norm(tensors["k"])
    tensors = {n: (t.contiguous() if isinstance(t, torch.Tensor) else t) for n, t in tensors.items()}
    return GENERIC[op](mode, **tensors, **kw)
