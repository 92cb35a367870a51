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
from fastweight.mechanisms import OPS, get_op

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


def generic_factors(op: str, tensors: dict) -> dict:
    """``op``'s arguments (fla's names, as a layer passes them) as the generic DPLR op's:
    ``dict(q, k, v, a, b, gk, u)``, fla's meaning (``a`` read against the state, ``b`` the rank-one
    direction), each of a, b, gk [B, T, H, K] (zeros where the op has none); ``u`` is RWKV-6's
    bonus (the DPLR op has none: that form runs the definition), else None. The form is the op's
    own (``Op.dplr`` in its mechanism file); the layer-level options (Mamba-2's in-kernel gate,
    the q/k L2 norm) are applied first."""
    spec = get_op(op)
    if spec.dplr is None:
        raise NotImplementedError(f"{op} has no generic DPLR form")
    tensors = dict(tensors)
    tensors.pop("allow_neg_eigval", None)
    if tensors.pop("use_gate_in_kernel", False):  # Mamba-2's gate from its pre-activation g
        from fastweight.dispatch import mamba_gate
        tensors["g"] = mamba_gate(tensors["g"].float(), tensors.pop("A_log"), tensors.pop("dt_bias"))
    if tensors.pop("use_qk_l2norm_in_kernel", False):
        from fastweight.dispatch import l2norm
        tensors["q"], tensors["k"] = l2norm(tensors["q"]), l2norm(tensors["k"])
    tensors = {n: (t.contiguous() if isinstance(t, torch.Tensor) else t) for n, t in tensors.items()}
    f = spec.dplr(**tensors)
    q = f["q"]
    gk = f.get("gk")
    if gk is None:
        gk = torch.zeros_like(q)
    elif gk.dim() == q.dim() - 1:   # one decay per head, the same on every key channel
        gk = gk[..., None].expand_as(q).contiguous()
    return dict(q=q, k=f["k"], v=f["v"], gk=gk, u=f.get("u"),
                **{n: torch.zeros_like(q) if f.get(n) is None else f[n] for n in ("a", "b")})


def _generic(op, mode, tensors, scale, initial_state, output_final_state, cu_seqlens, **kw):
    f = generic_factors(op, tensors)
    steps = get_op(op).dplr_steps
    n = tensors[steps] if steps else 1
    if n > 1:
        # a token of n DPLR steps (Gated DeltaProduct): the expanded sequence, each token's output at its last
        o, S = _generic_steps(mode, f, scale, initial_state, output_final_state,
                              None if cu_seqlens is None else cu_seqlens * n, **kw)
        return o.unflatten(1, (-1, n))[:, :, -1], S
    return _generic_steps(mode, f, scale, initial_state, output_final_state, cu_seqlens, **kw)


def _generic_steps(mode, f, scale, initial_state, output_final_state, cu_seqlens, **kw):
    if f["u"] is not None:
        # the DPLR op has no bonus readout: RWKV-6's DPLR form is the definition with ``u``
        from fastweight.reference import dplr_recurrent
        return dplr_recurrent(f["q"], f["k"], f["v"], gk=f["gk"], u=f["u"], scale=scale,
                              initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens)
    return getattr(ops, f"{mode}_dplr_delta_rule")(f["q"], f["k"], f["v"], f["a"], f["b"], f["gk"], scale=scale,
                                                   initial_state=initial_state,
                                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kw)


# the ops a layer can also run as the generic DPLR op (every op but that op itself)
GENERIC = tuple(n for n, spec in OPS.items() if spec.dplr is not None)


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
    return _generic(op, mode, tensors, **kw)
