"""Public functional API, fla's names and arguments.

Every op returns ``(o, final_state_or_None)``. Layout: q, k (and gates per key channel)
``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads); scalar
gates and beta ``[B, T, HV]``; states ``[N, HV, K, V]`` in float32 (float64 for float64
inputs); o in the dtype of v. Gates are log decays
(``g = log alpha <= 0``). ``scale`` defaults to ``K ** -0.5`` (``1.0`` for RWKV-7, as fla).
``initial_state`` ``[N, HV, K, V]`` starts each sequence; ``output_final_state`` returns the
state after the last token. ``cu_seqlens`` (int64 or int32, ``[N+1]``, B must be 1) packs N sequences
along T as in flash-attn. ``backend`` picks the implementation (``"triton"``, ``"torch"``,
``"reference"``; None = best for the device; float64 inputs take the PyTorch chunk path on every
device, exact in float64, and ``"triton"`` refuses them). Every argument is validated here
(``fastweight.checks``) before any kernel runs; the checks that read tensor values (NaN, gate
sign, beta's range) run by default for CPU tensors only, so a default CUDA call syncs only to read
``cu_seqlens`` (``FASTWEIGHT_VALUE_CHECKS=1`` turns them on everywhere). ``allow_neg_eigval`` (delta
family): beta may lie in [0, 2] instead of [0, 1], so the transition's eigenvalue along k, 1 - beta,
may be negative.
"""

from __future__ import annotations

import torch

from fastweight import checks, fla_compat, mechanisms
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


# Decay family: S_t = Diag(w_t) S_{t-1} + k_t v_t^T.

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


# Delta family: S_t = (Diag(w_t) + a_t b_t^T) S_{t-1} + k_t v_t^T with a = -beta k.

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


# Generic DPLR, fla's meaning of (a, b): S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T.

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


OPS = tuple(mechanisms.OPS)   # every op above, in the registry's order
