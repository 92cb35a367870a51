"""Public functional API, fla's names and arguments.

Every op returns ``(o, final_state_or_None)``. Layout: q, k (and gates per key channel)
``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads); scalar
gates and beta ``[B, T, HV]``; states ``[N, HV, K, V]`` in float32. Gates are log decays
(``g = log alpha <= 0``). ``scale`` defaults to ``K ** -0.5``. ``cu_seqlens`` (int64,
``[N+1]``, B must be 1) packs N sequences along T as in flash-attn. ``backend`` picks the
implementation (``"triton"``, ``"torch"``, ``"reference"``; None = best for the device).
"""

from __future__ import annotations

from fastweight import checks
from fastweight.dispatch import call


def _common(q, k, v, scale, initial_state, cu_seqlens):
    B, T, H, K, HV, V = checks.check_qkv(q, k, v)
    n = checks.check_cu_seqlens(cu_seqlens, B, T) or B
    checks.check_initial_state(initial_state, n, HV, K, V)
    checks.check_same_device(q=q, initial_state=initial_state, cu_seqlens=cu_seqlens)
    checks.check_finite(q=q, k=k, v=v, initial_state=initial_state)
    return (B, T, H, K, HV, V), checks.check_scale(scale, K)


def _gated_delta(mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel, backend):
    (B, T, H, K, HV, V), scale = _common(q, k, v, scale, initial_state, cu_seqlens)
    checks.check_tensor("g", g, ndim=3, shape=(B, T, HV))
    checks.check_tensor("beta", beta, ndim=3, shape=(B, T, HV))
    checks.check_same_device(q=q, g=g, beta=beta)
    checks.check_log_gate("g", g)
    checks.check_finite(beta=beta)
    return call("gated_delta_rule", mode, backend, dict(q=q, k=k, v=v, g=g, beta=beta),
                use_qk_l2norm=use_qk_l2norm_in_kernel, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, backend=None):
    """Gated delta rule, chunkwise: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T (scale q_t).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g (log decay, <= 0), beta: [B, T, HV].
    initial_state: [N, HV, K, V]. Returns (o [B, T, HV, V], final state [N, HV, K, V] fp32 or None).
    """
    return _gated_delta("chunk", q, k, v, g, beta, scale, initial_state, output_final_state,
                        cu_seqlens, use_qk_l2norm_in_kernel, backend)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None,
                                     use_qk_l2norm_in_kernel=False, backend=None):
    """The gated delta rule one token at a time (decode / short sequences); as ``chunk_gated_delta_rule``."""
    return _gated_delta("fused_recurrent", q, k, v, g, beta, scale, initial_state, output_final_state,
                        cu_seqlens, use_qk_l2norm_in_kernel, backend)


def _dplr(mode, q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, backend):
    (B, T, H, K, HV, V), scale = _common(q, k, v, scale, initial_state, cu_seqlens)
    for name, t in (("a", a), ("b", b), ("gk", gk)):
        checks.check_tensor(name, t, ndim=4, shape=(B, T, H, K))
    checks.check_same_device(q=q, a=a, b=b, gk=gk)
    checks.check_finite(a=a, b=b)
    checks.check_log_gate("gk", gk)
    return call("dplr_delta_rule", mode, backend, dict(q=q, k=k, v=v, a=a, b=b, gk=gk),
                key_tensors=("q", "k", "a", "b", "gk"), scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, backend=None):
    """Generic DPLR, fla's argument meaning: S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,
    o_t = S_t^T (scale q_t). Note fla's ``a`` is read against the state (``a^T S``) and ``b`` is
    the write direction: the core's (a, b) are fla's (b, a).

    q, k, a, b, gk: [B, T, H, K]; v: [B, T, H, V]. Returns (o, final state or None).
    """
    return _dplr("chunk", q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                    output_final_state=False, cu_seqlens=None, backend=None):
    """Generic DPLR one token at a time; as ``chunk_dplr_delta_rule``."""
    return _dplr("fused_recurrent", q, k, v, a, b, gk, scale, initial_state, output_final_state,
                 cu_seqlens, backend)
