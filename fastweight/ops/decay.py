"""The decay family's public ops (fla's names): S_t = Diag(w_t) S_{t-1} + k_t v_t^T."""

from __future__ import annotations

import torch

from fastweight import checks, fla_compat
from fastweight.ops.common import _op

__all__ = [  # the public functions, re-exported by fastweight.ops
    "chunk_linear_attn", "fused_recurrent_linear_attn", "chunk_retention", "fused_recurrent_retention",
    "chunk_simple_gla", "fused_recurrent_simple_gla", "chunk_gla", "fused_recurrent_gla", "chunk_rwkv6",
    "fused_recurrent_rwkv6", "chunk_hgrn2", "fused_recurrent_hgrn2"]


def _normalize_output(q, k, o, scale, cu_seqlens):
    """o_t / (scale q_t . sum_{s <= t} k_s): the running key-sum normaliser (initial state not counted)."""
    dt = torch.float64 if o.dtype == torch.float64 else torch.float32
    k = k.to(dt)
    if cu_seqlens is None:
        k_sum = k.cumsum(1)
    else:
        bounds = checks.host_bounds(cu_seqlens)
        k_sum = torch.cat([k[:, b:e].cumsum(1) for b, e in zip(bounds[:-1], bounds[1:])], dim=1)
    z = (scale * q.to(dt) * k_sum).sum(-1, keepdim=True)
    z = z.repeat_interleave(o.shape[2] // q.shape[2], dim=2)
    return (o.to(dt) / (z + 1e-10)).to(o.dtype)


def _linear_attn(mode, q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens, backend):
    o, final_state = _op("linear_attn", mode, backend, dict(q=q, k=k, v=v), scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if normalize:
        o = _normalize_output(q, k, o, checks.check_scale(scale, q.shape[-1]), cu_seqlens)
    return o, final_state


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                      cu_seqlens=None, *, backend=None):
    """Linear attention: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k: [B, T, H, K]; v: [B, T, HV, V]. Returns (o [B, T, HV, V], final state [N, HV, K, V] or None).
    ``normalize=True`` (fla's default here) divides o_t by ``scale q_t . sum_{s <= t} k_s``
    (Katharopoulos et al.'s normaliser; the initial state is not counted, as in fla).
    """
    return _linear_attn("chunk", q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens,
                        backend)


def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                                reverse=False, normalize=False, cu_seqlens=None, *, backend=None):
    """Linear attention one token at a time; as ``chunk_linear_attn`` (``normalize`` defaults to
    False here, as in fla)."""
    if reverse and normalize:
        raise ValueError("`reverse=True` with `normalize=True` is not supported by fused_recurrent_linear_attn")
    x, back = fla_compat.time_reversed(reverse, cu_seqlens, dict(q=q, k=k, v=v))
    o, S = _linear_attn("fused_recurrent", x["q"], x["k"], x["v"], scale, initial_state, output_final_state,
                        normalize, cu_seqlens, backend)
    return back(o), S


def _retention(mode, q, k, v, scale, initial_state, output_final_state, cu_seqlens, backend):
    return _op("retention", mode, backend, dict(q=q, k=k, v=v), scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, *,
                    backend=None, **kwargs):
    """RetNet: S_t = gamma_h S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t), gamma_h = 1 - 2^(-5-h) per value head h.

    q, k: [B, T, H, K]; v: [B, T, HV, V]. Returns (o [B, T, HV, V], final state [N, HV, K, V] or None).
    """
    fla_compat.extra_kwargs("chunk_retention", kwargs)
    return _retention("chunk", q, k, v, scale, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
                              state_v_first=False, cu_seqlens=None, *, backend=None, **kwargs):
    """RetNet one token at a time; as ``chunk_retention``."""
    _, v_first = fla_compat.extra_kwargs("fused_recurrent_retention", kwargs, state_v_first)
    x, back = fla_compat.time_reversed(reverse, cu_seqlens, dict(q=q, k=k, v=v))
    o, S = fla_compat.state_out(_retention("fused_recurrent", x["q"], x["k"], x["v"], scale, fla_compat.state_in(
        initial_state, v_first), output_final_state, cu_seqlens, backend), v_first)
    return back(o), S


def _simple_gla(mode, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens, backend):
    return _op("simple_gla", mode, backend, dict(q=q, k=k, v=v, g=g, g_gamma=g_gamma), scale=scale,
               head=("g",), params=dict(g_gamma=("HV",)), optional=("g", "g_gamma"), log=("g", "g_gamma"),
               initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, *, backend=None, **kwargs):
    """Scalar-gated linear attention: S_t = exp(g_t + g_gamma) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] data-dependent log decay and/or g_gamma:
    [HV] a fixed log decay per head (either may be None: no decay from it). Mamba-2 is
    ``g = dt * A`` with ``k`` scaled by dt. Returns (o [B, T, HV, V], final state or None).
    fla's further options: ``fastweight.fla_compat``.
    """
    _, v_first = fla_compat.extra_kwargs("chunk_simple_gla", kwargs, state_v_first)
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return fla_compat.state_out(_simple_gla("chunk", q, k, v, g, g_gamma, scale, fla_compat.state_in(
        initial_state, v_first), output_final_state, cu_seqlens, backend), v_first)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None, *,
                               backend=None, **kwargs):
    """Scalar-gated linear attention one token at a time; as ``chunk_simple_gla``."""
    _, v_first = fla_compat.extra_kwargs("fused_recurrent_simple_gla", kwargs, state_v_first)
    x, back = fla_compat.time_reversed(reverse, cu_seqlens, dict(q=q, k=k, v=v, g=g))
    o, S = fla_compat.state_out(_simple_gla("fused_recurrent", x["q"], x["k"], x["v"], x["g"], g_gamma, scale,
                                            fla_compat.state_in(initial_state, v_first), output_final_state,
                                            cu_seqlens, backend), v_first)
    return back(o), S


def _gla(mode, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, backend):
    gate = "g" if mode == "chunk" else "gk"
    checks.check_tensor(gate, g)
    return _op("gla", mode, backend, dict(q=q, k=k, v=v, g=g), scale=scale, key=("g",), log=("g",),
               initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None, *, backend=None):
    """GLA: S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k, g (log decay per key channel, <= 0): [B, T, H, K]; v: [B, T, HV, V].
    Returns (o [B, T, HV, V], final state [N, HV, K, V] or None).
    """
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return fla_compat.state_out(_gla("chunk", q, k, v, g, scale, fla_compat.state_in(initial_state, state_v_first),
                                     output_final_state, cu_seqlens, backend), state_v_first)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, *, backend=None, **kwargs):
    """GLA one token at a time; as ``chunk_gla``, with fla's name ``gk`` for the gate (``g``, chunk_gla's
    name, is accepted as a keyword too). fla's value-side gate ``gv`` is not supported."""
    extra, v_first = fla_compat.extra_kwargs("fused_recurrent_gla", kwargs, state_v_first, allowed=("g",))
    fla_compat.refuse("fused_recurrent_gla", gv=(gv, None))
    if extra.get("g") is not None:
        if gk is not None:
            raise TypeError("pass the GLA gate once: `gk` or `g`, not both")
        gk = extra["g"]
    x, back = fla_compat.time_reversed(reverse, cu_seqlens, dict(q=q, k=k, v=v, gk=gk))
    o, S = fla_compat.state_out(_gla("fused_recurrent", x["q"], x["k"], x["v"], x["gk"], scale, fla_compat.state_in(
        initial_state, v_first), output_final_state, cu_seqlens, backend), v_first)
    return back(o), S


def _rwkv6(mode, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, backend):
    return _op("rwkv6", mode, backend, dict(r=r, k=k, v=v, w=w, u=u), scale=scale, names=("r", "k", "v"),
               key=("w",), params=dict(u=("H", "K")), log=("w",), same_heads=True,
               initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                cu_seqlens_cpu=None, *, backend=None, **kwargs):
    """RWKV-6: S_t = Diag(exp w_t) S_{t-1} + k_t v_t^T, o_t = S_{t-1}^T (scale r_t) + (scale r_t . (u * k_t)) v_t.

    r, k, w (log decay, <= 0): [B, T, H, K]; v: [B, T, H, V]; u (current-token bonus): [H, K].
    Returns (o [B, T, H, V], final state [N, H, K, V] or None).
    """
    fla_compat.extra_kwargs("chunk_rwkv6", kwargs)
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return _rwkv6("chunk", r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, reverse=False,
                          cu_seqlens=None, *, backend=None):
    """RWKV-6 one token at a time; as ``chunk_rwkv6``."""
    x, back = fla_compat.time_reversed(reverse, cu_seqlens, dict(r=r, k=k, v=v, w=w))
    o, S = _rwkv6("fused_recurrent", x["r"], x["k"], x["v"], x["w"], u, scale, initial_state, output_final_state,
                  cu_seqlens, backend)
    return back(o), S


def _hgrn2(mode, q, v, g, scale, initial_state, output_final_state, cu_seqlens, backend):
    return _op("hgrn2", mode, backend, dict(q=q, g=g, v=v), scale=scale, names=("q", "g", "v"), log=("g",),
               initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_hgrn2(q, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, *,
                backend=None):
    """HGRN2: S_t = Diag(exp g_t) S_{t-1} + (1 - exp g_t) v_t^T, o_t = S_t^T (scale q_t).

    The key is the forget gate's complement (fla runs it as ``chunk_gla(q, 1 - exp(g), v, g)``).
    q, g (log forget gate, <= 0): [B, T, H, K]; v: [B, T, HV, V]. Returns (o, final state or None).
    """
    return _hgrn2("chunk", q, v, g, scale, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_hgrn2(q, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, *,
                          backend=None):
    """HGRN2 one token at a time; as ``chunk_hgrn2``."""
    return _hgrn2("fused_recurrent", q, v, g, scale, initial_state, output_final_state, cu_seqlens, backend)
