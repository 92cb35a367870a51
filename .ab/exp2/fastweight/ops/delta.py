"""The delta family's public ops (fla's names): S_t = (Diag(w_t) + a_t b_t^T) S_{t-1} + k_t v_t^T, a = -beta k."""

from __future__ import annotations

import torch

from fastweight import checks, fla_compat
from fastweight.ops.common import _op, _beta_max, _default_beta

__all__ = [  # the public functions, re-exported by fastweight.ops
    "chunk_delta_rule", "fused_recurrent_delta_rule", "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule", "chunk_gdn", "fused_recurrent_gdn", "fused_chunk_delta_rule", "chunk_gated_delta_product",
    "fused_recurrent_gated_delta_product", "chunk_kda", "fused_recurrent_kda", "chunk_comba", "fused_recurrent_comba",
    "chunk_longhorn", "fused_recurrent_longhorn"]


def _delta_rule(mode, q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, allow_neg_eigval, backend):
    beta = _default_beta(beta, v)
    return _op("delta_rule", mode, backend, dict(q=q, k=k, v=v, beta=beta), scale=scale, head=("beta",),
               beta_max=_beta_max(allow_neg_eigval), use_qk_l2norm=use_qk_l2norm_in_kernel,
               initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, *, allow_neg_eigval=False,
                     backend=None, **kwargs):
    """DeltaNet: S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k: [B, T, H, K] (L2-normalised, or pass use_qk_l2norm_in_kernel=True); v: [B, T, HV, V];
    beta: [B, T, HV] in [0, 1] ([0, 2] with allow_neg_eigval). Returns (o, final state or None).
    """
    fla_compat.extra_kwargs("chunk_delta_rule", kwargs)
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return _delta_rule("chunk", q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm_in_kernel, allow_neg_eigval, backend)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, allow_neg_eigval=False,
                               backend=None):
    """DeltaNet one token at a time (beta None = 1); as ``chunk_delta_rule``."""
    return _delta_rule("fused_recurrent", q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm_in_kernel, allow_neg_eigval, backend)


def _gate_in_kernel(tensors, use_gate_in_kernel, A_log, dt_bias, per_channel):
    """Mamba-2's gate g = -exp(A_log) softplus(g + dt_bias) formed by the op (``g`` is then the
    pre-activation): adds A_log [HV] and dt_bias ([HV], or [HV * K] per channel) to ``tensors``;
    returns the names of the log gates left to check (none when the op forms the gate)."""
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"`{name}` is only used with use_gate_in_kernel=True (g is then the gate's "
                                 "pre-activation); pass the log decay as g, or set the flag")
        return ("g",)
    q, v = tensors["q"], tensors["v"]
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor):
        HV = v.shape[2]
        checks.check_tensor("A_log", A_log, ndim=1, shape=(HV,))
        size = HV * q.shape[-1] if per_channel else HV
        checks.check_tensor("dt_bias", dt_bias, ndim=1, shape=(size,))
    tensors.update(A_log=A_log, dt_bias=dt_bias)
    return ()


def _gated_delta(mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel, allow_neg_eigval, backend, use_gate_in_kernel=False, A_log=None,
                 dt_bias=None):
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta)
    log = _gate_in_kernel(tensors, use_gate_in_kernel, A_log, dt_bias, per_channel=False)
    return _op("gated_delta_rule", mode, backend, tensors, scale=scale,
               head=("g", "beta"), log=log, beta_max=_beta_max(allow_neg_eigval),
               use_qk_l2norm=use_qk_l2norm_in_kernel, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, backend=None, **kwargs):
    """Gated delta rule, chunkwise: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T (scale q_t).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g (log decay, <= 0), beta: [B, T, HV].
    initial_state: [N, HV, K, V] ([N, HV, V, K] with state_v_first). Returns (o [B, T, HV, V], final
    state fp32 (fp64 for fp64 inputs) or None).
    ``use_gate_in_kernel=True`` (keyword, as fla): ``g`` is the pre-activation of Mamba-2's gate,
    the log decay is ``-exp(A_log) softplus(g + dt_bias)`` (A_log, dt_bias: [HV]), formed by the op in
    float32 (float64 for float64 inputs). fla's other options: ``fastweight.fla_compat``.
    """
    extra, v_first = fla_compat.extra_kwargs("chunk_gated_delta_rule", kwargs, state_v_first,
                                             allowed=("use_gate_in_kernel", "A_log", "dt_bias"))
    fla_compat.refuse("chunk_gated_delta_rule", cp_context=(cp_context, None))
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    beta = fla_compat.beta_sigmoid(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return fla_compat.state_out(_gated_delta(
        "chunk", q, k, v, g, beta, scale, fla_compat.state_in(initial_state, v_first), output_final_state,
        cu_seqlens, use_qk_l2norm_in_kernel, allow_neg_eigval, backend, **extra), v_first)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, backend=None, **kwargs):
    """The gated delta rule one token at a time (decode / short sequences); as ``chunk_gated_delta_rule``.

    As in fla, ``gk`` [B, T, HV, K] instead of ``g`` is a per-key-channel decay applied before the
    delta step (KDA's recurrence: served by ``fused_recurrent_kda``); beta None means 1.
    """
    _, v_first = fla_compat.extra_kwargs("fused_recurrent_gated_delta_rule", kwargs, state_v_first)
    fla_compat.refuse("fused_recurrent_gated_delta_rule", gv=(gv, None))
    beta = _default_beta(beta, v) if beta is None else fla_compat.beta_sigmoid(
        beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    h0 = fla_compat.state_in(initial_state, v_first)
    if gk is not None:
        if g is not None:
            raise ValueError("pass one decay to fused_recurrent_gated_delta_rule: `g` (per head) or `gk` "
                             "(per key channel), not both")
        return fla_compat.state_out(_kda("fused_recurrent", q, k, v, gk, beta, scale, h0, output_final_state,
                                         cu_seqlens, use_qk_l2norm_in_kernel, allow_neg_eigval, backend,
                                         use_gate_in_kernel, A_log, dt_bias), v_first)
    return fla_compat.state_out(_gated_delta("fused_recurrent", q, k, v, g, beta, scale, h0, output_final_state,
                                             cu_seqlens, use_qk_l2norm_in_kernel, allow_neg_eigval, backend,
                                             use_gate_in_kernel, A_log, dt_bias), v_first)


# fla 0.6.0's short names (fla.ops exports both spellings of the gated delta rule: the same functions)
chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule


def fused_chunk_delta_rule(**kwargs):
    """Removed in fla 0.6.0 (it raises there too): use ``chunk_delta_rule``. Kept so that code importing it
    imports."""
    raise NotImplementedError("`fused_chunk_delta_rule` is deprecated (as in fla 0.6.0). Please use `chunk_delta_rule` "
                              "instead.")


def _gated_delta_product(mode, q, k, v, g, beta, num_householder, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, cu_seqlens, allow_neg_eigval, backend):
    if isinstance(num_householder, bool) or not isinstance(num_householder, int):
        raise TypeError(f"`num_householder` must be an int >= 1 (the delta steps per token), got "
                        f"{type(num_householder).__name__}")
    if num_householder < 1:
        raise ValueError(f"`num_householder` must be >= 1 (the delta steps per token), got {num_householder}")
    checks.check_tensor("q", q, ndim=4, shape=(None, None, None, None))
    n, T = num_householder, q.shape[1]
    for name, x, layout in (("k", k, "[B, T*n, H, K]"), ("v", v, "[B, T*n, HV, V]"), ("beta", beta, "[B, T*n, HV]")):
        checks.check_tensor(name, x)
        if x.dim() < 2 or x.shape[1] != T * n:
            raise ValueError(f"`{name}` must have T * num_householder = {T} * {n} = {T * n} rows along dim 1 "
                             f"({layout}: token t's substeps at rows t*n ... t*n+n-1), got shape {tuple(x.shape)}")
    return _op("gated_delta_product", mode, backend, dict(q=q, k=k, v=v, g=g, beta=beta), scale=scale,
               head=("g", "beta"), optional=("g",), log=("g",), beta_max=_beta_max(allow_neg_eigval),
               use_qk_l2norm=use_qk_l2norm_in_kernel, substeps=n, substep_args=("k", "v", "beta"),
               options=dict(num_householder=n), initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                              cu_seqlens_cpu=None, cp_context=None, *, allow_neg_eigval=False, backend=None):
    """Gated DeltaProduct, chunkwise: each token t takes n = num_householder delta steps, the gate on
    the first: S <- exp(g_t) S, then for j < n: S <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) S + beta_{t,j}
    k_{t,j} v_{t,j}^T; o_t = S_t^T (scale q_t) after the last.

    q: [B, T, H, K]; k: [B, T*n, H, K]; v: [B, T*n, HV, V]; beta: [B, T*n, HV] (token t's substeps
    at rows t*n ... t*n+n-1, fla's layout); g (log decay, <= 0): [B, T, HV], or None (no decay).
    ``cu_seqlens`` counts tokens (as fla: T, not T*n). beta in [0, 1] ([0, 2] with allow_neg_eigval).
    Returns (o [B, T, HV, V], final state [N, HV, K, V] or None). n = 1 is chunk_gated_delta_rule.
    """
    fla_compat.refuse("chunk_gated_delta_product", cp_context=(cp_context, None))
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return _gated_delta_product("chunk", q, k, v, g, beta, num_householder, scale, initial_state,
                                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, allow_neg_eigval, backend)


def fused_recurrent_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                        *, allow_neg_eigval=False, backend=None):
    """Gated DeltaProduct one token at a time (decode); as ``chunk_gated_delta_product`` (fla 0.6.0
    has no fused recurrent form of it: this one runs Gated DeltaNet's on the substeps)."""
    return _gated_delta_product("fused_recurrent", q, k, v, g, beta, num_householder, scale, initial_state,
                                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, allow_neg_eigval, backend)


def _kda(mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
         use_qk_l2norm_in_kernel, allow_neg_eigval, backend, use_gate_in_kernel=False, A_log=None, dt_bias=None):
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta)
    log = _gate_in_kernel(tensors, use_gate_in_kernel, A_log, dt_bias, per_channel=True)
    return _op("kda", mode, backend, tensors, scale=scale, head=("beta",),
               head_k=("g",), log=log, beta_max=_beta_max(allow_neg_eigval),
               use_qk_l2norm=use_qk_l2norm_in_kernel, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, *, backend=None, **kwargs):
    """KDA: S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g (log decay per key channel, <= 0): [B, T, HV, K];
    beta: [B, T, HV]. Returns (o [B, T, HV, V], final state [N, HV, K, V] or None).
    use_gate_in_kernel (as fla): ``g`` is the pre-activation, the log decay is
    ``-exp(A_log) softplus(g + dt_bias)`` with A_log [HV] and dt_bias [HV * K] (keywords, as fla),
    formed by the op as ``chunk_gated_delta_rule`` forms its gate; with ``lower_bound`` fla's bounded
    gate ``lower_bound sigmoid(exp(A_log) (g + dt_bias))`` (``fla_compat.kda_gate``). fla's other options:
    ``fastweight.fla_compat``.
    """
    extra, v_first = fla_compat.extra_kwargs("chunk_kda", kwargs, state_v_first, allowed=("A_log", "dt_bias"))
    fla_compat.refuse("chunk_kda", return_intermediate_states=(return_intermediate_states, False),
                      cp_context=(cp_context, None), use_graph=(use_graph, False), max_num_seqs=(max_num_seqs, None))
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    g, use_gate_in_kernel, A_log, dt_bias = fla_compat.kda_gate("chunk_kda", g, use_gate_in_kernel, safe_gate,
                                                                lower_bound, extra.get("A_log"), extra.get("dt_bias"))
    beta = fla_compat.beta_sigmoid(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return fla_compat.state_out(_kda(
        "chunk", q, k, v, g, beta, scale, fla_compat.state_in(initial_state, v_first), output_final_state,
        cu_seqlens, use_qk_l2norm_in_kernel, allow_neg_eigval, backend, use_gate_in_kernel, A_log, dt_bias), v_first)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, *, backend=None, **kwargs):
    """KDA one token at a time; as ``chunk_kda``."""
    _, v_first = fla_compat.extra_kwargs("fused_recurrent_kda", kwargs, state_v_first)
    g, use_gate_in_kernel, A_log, dt_bias = fla_compat.kda_gate("fused_recurrent_kda", g, use_gate_in_kernel, False,
                                                                lower_bound, A_log, dt_bias)
    beta = fla_compat.beta_sigmoid(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return fla_compat.state_out(_kda(
        "fused_recurrent", q, k, v, g, beta, scale, fla_compat.state_in(initial_state, v_first),
        output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, allow_neg_eigval, backend, use_gate_in_kernel,
        A_log, dt_bias), v_first)


def _comba(mode, q, k, v, p, g, beta, scale, initial_state, output_final_state, cu_seqlens,
           use_qk_l2norm_in_kernel, allow_neg_eigval, backend):
    p, beta = (k if p is None else p), _default_beta(beta, v)
    return _op("comba", mode, backend, dict(q=q, k=k, v=v, p=p, g=g, beta=beta), scale=scale, key=("p",),
               head=("g", "beta"), log=("g",), beta_max=_beta_max(allow_neg_eigval),
               use_qk_l2norm=use_qk_l2norm_in_kernel, l2norm_tensors=("q", "k", "p"),
               initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_comba(q, k, v, p, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, *, allow_neg_eigval=False,
                backend=None):
    """Comba: S_t = (exp(g_t) I - beta_t k_t p_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t).

    The prediction error ``v_t - S_{t-1}^T p_t`` is read by the auxiliary key ``p`` from the
    undecayed state (fla's layer passes p = d * k, a per-head d in (0, 1); None means p = k).
    q, k, p: [B, T, H, K]; v: [B, T, HV, V]; g (log decay, <= 0), beta: [B, T, HV] (None: 1, as fla).
    use_qk_l2norm_in_kernel normalises q, k and p. Returns (o [B, T, HV, V], final state or None).
    """
    fla_compat.host_seqlens(cu_seqlens, cu_seqlens_cpu)
    return _comba("chunk", q, k, v, p, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                  use_qk_l2norm_in_kernel, allow_neg_eigval, backend)


def fused_recurrent_comba(q, k, p, v, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, allow_neg_eigval=False, backend=None):
    """Comba one token at a time; as ``chunk_comba``. The argument order is fla's: ``(q, k, p, v, ...)``
    here, ``(q, k, v, p, ...)`` for ``chunk_comba`` (fla's two functions differ; pass p and v by name
    to be safe with either)."""
    return _comba("fused_recurrent", q, k, v, p, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                  use_qk_l2norm_in_kernel, allow_neg_eigval, backend)


def _longhorn(mode, q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens, diagonal_step, backend):
    if not isinstance(diagonal_step, bool):
        raise TypeError(f"`diagonal_step` must be a bool, got {type(diagonal_step).__name__}")
    return _op("longhorn", mode, backend, dict(q=q, k=k, v=v, beta=beta), scale=scale, head=("beta",),
               beta_max=float("inf"), initial_state=initial_state, output_final_state=output_final_state,
               cu_seqlens=cu_seqlens, options=dict(diagonal_step=True) if diagonal_step else None)


def chunk_longhorn(q, k, v, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, *,
                   diagonal_step=False, backend=None):
    """Longhorn: S_t = (I - eps_t k_t k_t^T) S_{t-1} + eps_t k_t v_t^T, eps_t = beta_t / (1 + beta_t k_t^T k_t),
    o_t = S_t^T (scale q_t): the proximal step on 1/2 ||S^T k - v||^2 (docs/objectives.md).

    ``diagonal_step=True``: the released Longhorn code's step, S_t = Diag(1 - eps_t k_t * k_t) S_{t-1}
    + eps_t k_t v_t^T (k k^T replaced by its diagonal: a per-key-channel decay in (0, 1] for beta >= 0);
    the default, False, is the exact step above.
    q, k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV] >= 0. Returns (o, final state or None).
    """
    return _longhorn("chunk", q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens, diagonal_step,
                     backend)


def fused_recurrent_longhorn(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                             cu_seqlens=None, *, diagonal_step=False, backend=None):
    """Longhorn one token at a time; as ``chunk_longhorn``."""
    return _longhorn("fused_recurrent", q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens,
                     diagonal_step, backend)
