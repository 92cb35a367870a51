"""The decay family's public ops (fla's names): S_t = Diag(w_t) S_{t-1} + k_t v_t^T."""

from __future__ import annotations

import torch

from fastweight import checks, dispatch, fla_compat
from fastweight.mechanisms.retnet import retnet_log_gamma
from fastweight.ops.common import _op

__all__ = [  # the public functions, re-exported by fastweight.ops
    "chunk_linear_attn", "fused_recurrent_linear_attn", "chunk_retention", "fused_recurrent_retention",
    "chunk_simple_gla", "fused_recurrent_simple_gla", "chunk_gla", "fused_recurrent_gla", "chunk_rwkv6",
    "fused_recurrent_rwkv6", "chunk_hgrn", "fused_recurrent_hgrn", "chunk_hgrn2", "fused_recurrent_hgrn2",
    "fused_chunk_linear_attn", "fused_chunk_retention", "fused_chunk_simple_gla", "fused_chunk_gla",
    "parallel_retention", "parallel_simple_gla", "chunk_lightning_attn", "fused_recurrent_lightning_attn"]


def _normalize_output(q, k, o, scale, cu_seqlens, z_init=None):
    """o_t / (scale q_t . z_t) with z_t = z_init + sum_{s <= t} k_s, the running key sum of each
    sequence (the kv initial state not counted, as in fla). q, k: [B, T, H, K]; o: [B, T, HV, V];
    z_init: [N, 1, H, K] or None. Returns (o, z_state [N, 1, H, K] in k's dtype: z at each
    sequence's last token, z_init for an empty one), fla's normaliser state."""
    dt = torch.float64 if o.dtype == torch.float64 else torch.float32
    kd = k.to(dt)
    z0 = None if z_init is None else z_init.to(dt)
    if cu_seqlens is None:
        k_sum = kd.cumsum(1) if z0 is None else kd.cumsum(1) + z0
        z_state = k_sum[:, -1:] if k.shape[1] else (z0 if z0 is not None else kd.new_zeros(k.shape[0], 1, *k.shape[2:]))
    else:
        bounds = checks.host_bounds(cu_seqlens)
        sums, ends = [], []
        for i, (b, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            c = kd[:, b:e].cumsum(1)
            start = z0[i:i + 1] if z0 is not None else kd.new_zeros(1, 1, *k.shape[2:])
            c = c + start
            sums.append(c)
            ends.append(c[:, -1:] if e > b else start)
        k_sum, z_state = torch.cat(sums, dim=1), torch.cat(ends, dim=0)
    z = (scale * q.to(dt) * k_sum).sum(-1, keepdim=True)
    z = z.repeat_interleave(o.shape[2] // q.shape[2], dim=2)
    return (o.to(dt) / (z + 1e-10)).to(o.dtype), z_state.to(k.dtype)


def _split_z(initial_state, normalize, k, cu_seqlens):
    """fla's normalised linear attention takes ``initial_state=(S, z)``, z [N, 1, H, K] the key sum
    carried over: (S, z), z None for a plain tensor (or None)."""
    if not isinstance(initial_state, (tuple, list)) or not torch.is_tensor(k) or k.dim() != 4:
        return initial_state, None      # the op's own checks name a bad argument
    if not normalize:
        raise TypeError("`initial_state` must be a torch.Tensor with normalize=False, got a tuple (fla's (S, z) pair "
                        "is the normalised form's state)")
    if len(initial_state) != 2 or not torch.is_tensor(initial_state[1]):
        raise TypeError("`initial_state` with normalize=True must be a tensor or a pair (S, z) with z a tensor "
                        f"[N, 1, H, K], got {type(initial_state).__name__} of {len(initial_state)}")
    S, z = initial_state
    N = k.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    want = (N, 1, k.shape[2], k.shape[3])
    if tuple(z.shape) != want:
        raise ValueError(f"`initial_state`'s z must be [N, 1, H, K] = {list(want)}, got {list(z.shape)}")
    if z.device != k.device:
        raise ValueError(f"`initial_state`'s z must be on k's device {k.device}, got {z.device}")
    if not z.is_floating_point():
        raise TypeError(f"`initial_state`'s z must be a floating tensor, got {z.dtype}")
    return S, z


def _kernel_normalizer(backend, q):
    """The normaliser's kernel (``kernels.key_sum``, K <= 256) goes with the Triton op: backend 'triton', or
    None on CUDA; float64 and wider keys take the PyTorch division (``_normalize_output``)."""
    if q.dtype == torch.float64 or q.shape[-1] > 256 or not dispatch.triton_usable(q.device):
        return False
    return backend == "triton" or (backend is None and q.device.type == "cuda")


def _linear_attn(mode, q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens, backend):
    initial_state, z_init = _split_z(initial_state, normalize, k, cu_seqlens)
    o, final_state = _op("linear_attn", mode, backend, dict(q=q, k=k, v=v), scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if normalize:
        scale = checks.check_scale(scale, q.shape[-1])
        if _kernel_normalizer(backend, q):
            from fastweight.kernels.key_sum import normalize as kernel_normalize
            o, z_state = kernel_normalize(q, k, o, scale, cu_seqlens, z_init)
        else:
            o, z_state = _normalize_output(q, k, o, scale, cu_seqlens, z_init)
        return o, (final_state, z_state)
    return o, final_state


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                      cu_seqlens=None, *, backend=None):
    """Linear attention: S_t = S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k: [B, T, H, K]; v: [B, T, HV, V]. Returns (o [B, T, HV, V], final state [N, HV, K, V] or None).
    ``normalize=True`` (fla's default here) divides o_t by ``scale q_t . z_t``, z_t = z_0 + sum_{s <= t}
    k_s (Katharopoulos et al.'s normaliser; the kv initial state is not counted, as in fla), and, as
    fla, takes ``initial_state`` as S or a pair (S, z_0), z_0 [N, 1, H, K], and returns the pair
    (final state or None, z_state [N, 1, H, K]) in place of the final state.
    """
    return _linear_attn("chunk", q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens,
                        backend)


def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                                reverse=False, normalize=False, cu_seqlens=None, *, backend=None):
    """Linear attention one token at a time; as ``chunk_linear_attn`` (``normalize`` defaults to
    False here, as in fla). ``reverse``: the sequence read from its end (the normaliser's key sum
    too, z_t = z_0 + sum_{s >= t} k_s)."""
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


def _hgrn(mode, x, g, initial_state, output_final_state, cu_seqlens, backend):
    """HGRN's elementwise recurrence is scalar-gated linear attention with one head per channel and
    K = V = 1 (q = k = 1, v = x): the PyTorch and reference paths run it as that; Triton (the
    default on CUDA) as its own scan kernel (``fastweight.kernels.hgrn``): simple_gla's tiles, sized for
    K, V >= 16, would do 16 x 16 work per channel and token at K = V = 1."""
    name = f"{mode}_hgrn"
    for arg, t in (("x", x), ("g", g)):
        if not torch.is_tensor(t) or t.dim() != 3:
            raise ValueError(f"{name}: `{arg}` must be a tensor [B, T, D], got "
                             f"{list(t.shape) if torch.is_tensor(t) else type(t).__name__}")
    if g.shape != x.shape:
        raise ValueError(f"{name}: `g` must have x's shape {list(x.shape)}, got {list(g.shape)}")
    if initial_state is not None:
        N = x.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        if not torch.is_tensor(initial_state) or tuple(initial_state.shape) != (N, x.shape[2]):
            raise ValueError(f"{name}: `initial_state` must be [N, D] = {[N, x.shape[2]]}, got "
                             f"{list(initial_state.shape) if torch.is_tensor(initial_state) else type(initial_state).__name__}")
    if backend == "triton" or (backend is None and x.is_cuda and x.dtype != torch.float64):
        # the scan kernel (one per mode: a token is D fused multiply-adds, nothing to chunk)
        from fastweight.dispatch import resolve
        from fastweight.kernels.hgrn import hgrn
        resolve("simple_gla", mode, "triton", x.device, x.dtype)   # the device and dtype refusals
        checks.check_same_device(x=x, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
        checks.check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
        checks.check_finite(x=x, initial_state=initial_state)
        checks.check_log_gate("g", g)
        return hgrn(x, g, initial_state, output_final_state, cu_seqlens)
    ones = x.new_ones(()).expand(*x.shape, 1)
    h0 = None if initial_state is None else initial_state[..., None, None]
    o, S = _simple_gla(mode, ones, ones, x[..., None], g, None, 1.0, h0, output_final_state, cu_seqlens, backend)
    return o[..., 0], None if S is None else S[..., 0, 0]


def chunk_hgrn(x, g, initial_state=None, output_final_state=False, *, cu_seqlens=None, backend=None):
    """HGRN (Qin et al. 2023, arXiv:2311.04823), its recurrence alone: h_t = exp(g_t) * h_{t-1} + x_t,
    elementwise over D (o_t = h_t); the layer forms x_t = (1 - exp g_t) * i_t itself.

    In the fast-weight view each channel is a 1 x 1 state with a scalar decay: ``chunk_simple_gla``
    with D heads, K = V = 1, q = k = 1, v = x (the PyTorch path runs it as that; Triton as a scan
    over time, in both modes: there is nothing to chunk in a state of D floats). x, g (log forget gate, <= 0): [B, T, D];
    initial_state [N, D]. Returns (o [B, T, D] in x's dtype, final state [N, D] (fp32; fp64 for fp64)
    or None). ``cu_seqlens`` (keyword: fla's chunk_hgrn has none) packs sequences as elsewhere.
    """
    return _hgrn("chunk", x, g, initial_state, output_final_state, cu_seqlens, backend)


def fused_recurrent_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None, *, backend=None):
    """HGRN one token at a time; as ``chunk_hgrn``."""
    return _hgrn("fused_recurrent", x, g, initial_state, output_final_state, cu_seqlens, backend)


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


# fla's other forms of the same ops. ``fused_chunk_*`` and ``parallel_*`` are fla kernels for the
# recurrences above (one kernel over the chunks; the quadratic form): here they run the chunk path,
# with fla's arguments in fla's order. Lightning attention is simple_gla at fixed per-head decays.


def fused_chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                            cu_seqlens=None, *, backend=None):
    """fla's fused_chunk form of ``chunk_linear_attn``: the same arguments, order and result."""
    return chunk_linear_attn(q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens,
                             backend=backend)


def fused_chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, *,
                          backend=None):
    """fla's fused_chunk form of ``chunk_retention``: the same arguments, order and result."""
    return chunk_retention(q, k, v, scale, initial_state, output_final_state, cu_seqlens, backend=backend)


def fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, *, backend=None):
    """fla's fused_chunk form of ``chunk_simple_gla`` (fla's order: no ``state_v_first``); the same result."""
    return chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens=cu_seqlens,
                            backend=backend)


def fused_chunk_gla(**kwargs):
    """Removed in fla 0.6.0 (it raises there too): use ``chunk_gla``. Kept so that code importing it
    (fla's own GLA layer does) imports."""
    raise NotImplementedError("`fused_chunk_gla` is deprecated (as in fla 0.6.0). Please use `chunk_gla` instead.")


def _scores(q, k, log_decay, scale, name):
    """The causal decayed scores of the parallel form, [B, H, T, T] in q's dtype:
    A_ij = scale q_i . k_j exp(sum_{j < s <= i} log_decay_s) for j <= i, else 0. log_decay: [B, T, H] or None."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    A = scale * torch.einsum("bihk,bjhk->bhij", q.to(dt), k.to(dt))
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if log_decay is not None:
        G = log_decay.to(dt).cumsum(1).transpose(1, 2)                      # [B, H, T]
        A = A * (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    return A.masked_fill(~causal, 0).to(q.dtype)


def _parallel(name, q, k, v, g, scale, output_attentions, cu_seqlens, run):
    o, _ = run()
    if not output_attentions:
        return o, None
    if cu_seqlens is not None:
        raise ValueError(f"{name}: `output_attentions=True` is not supported with `cu_seqlens` (as in fla)")
    if v.shape[2] != q.shape[2]:
        raise ValueError(f"{name}: `output_attentions=True` needs v with q's {q.shape[2]} heads, got {v.shape[2]}")
    return o, _scores(q, k, g, checks.check_scale(scale, q.shape[-1]), name)


def parallel_simple_gla(q, k, v, g=None, scale=None, output_attentions=False, cu_seqlens=None, cu_seqlens_cpu=None,
                        *, backend=None):
    """fla's parallel (quadratic) form of ``chunk_simple_gla``: o as chunk_simple_gla (no state in or out),
    and with ``output_attentions`` the scores A [B, H, T, T], A_ij = scale q_i . k_j exp(G_i - G_j) for
    j <= i (G the running sum of g), 0 above, in q's dtype (formed in PyTorch: T^2 memory)."""
    return _parallel("parallel_simple_gla", q, k, v, g, scale, output_attentions, cu_seqlens, lambda: chunk_simple_gla(
        q, k, v, g, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, backend=backend))


def parallel_retention(q, k, v, scale=None, output_attentions=False, cu_seqlens=None, *, backend=None):
    """fla's parallel form of ``chunk_retention``; with ``output_attentions`` the scores as
    ``parallel_simple_gla``'s at RetNet's per-head decays."""
    gamma = None
    if output_attentions and torch.is_tensor(q) and q.dim() == 4:
        gamma = retnet_log_gamma(q.shape[2], torch.float64, q.device).expand(*q.shape[:3])
    return _parallel("parallel_retention", q, k, v, gamma, scale, output_attentions, cu_seqlens,
                     lambda: chunk_retention(q, k, v, scale, cu_seqlens=cu_seqlens, backend=backend))


def lightning_log_gamma(num_heads: int, layer_idx: int, num_layers: int, device=None) -> torch.Tensor:
    """Lightning attention's fixed log decays (fla 0.6.0's rule): -(8 / H) (1 - layer_idx / num_layers) h for
    head h = 0..H-1, in fp32 (head 0 does not decay; later layers decay less)."""
    for name, x in (("layer_idx", layer_idx), ("num_layers", num_layers)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"`{name}` must be an int, got {x!r}")
    if num_layers < 1 or not 0 <= layer_idx < num_layers:
        raise ValueError(f"`layer_idx` must be in [0, num_layers) and `num_layers` >= 1, got layer_idx={layer_idx}, "
                         f"num_layers={num_layers}")
    return -(8 / num_heads * (1 - layer_idx / num_layers)) * torch.arange(num_heads, dtype=torch.float32,
                                                                           device=device)


def _lightning(name, q, v, layer_idx, num_layers):
    checks.check_tensor("q", q, ndim=4)
    checks.check_tensor("v", v, ndim=4)
    if v.shape[2] != q.shape[2]:
        raise ValueError(f"{name}: `v` must have q's {q.shape[2]} heads (one decay per head), got {v.shape[2]}")
    return lightning_log_gamma(q.shape[2], layer_idx, num_layers, q.device)


def chunk_lightning_attn(q, k, v, layer_idx, num_layers, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, *, backend=None, **kwargs):
    """Lightning attention (fla 0.6.0's ``chunk_lightning_attn``): S_t = exp(g_h) S_{t-1} + k_t v_t^T,
    o_t = S_t^T (scale q_t), g_h = ``lightning_log_gamma(H, layer_idx, num_layers)`` per head: simple_gla with
    ``g_gamma``. q, k: [B, T, H, K]; v: [B, T, H, V]. Returns (o, final state [N, H, K, V] or None)."""
    fla_compat.extra_kwargs("chunk_lightning_attn", kwargs)
    g_gamma = _lightning("chunk_lightning_attn", q, v, layer_idx, num_layers)
    return chunk_simple_gla(q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend)


def fused_recurrent_lightning_attn(q, k, v, layer_idx, num_layers, scale=None, initial_state=None,
                                   output_final_state=False, reverse=False, cu_seqlens=None, *, backend=None):
    """Lightning attention one token at a time; as ``chunk_lightning_attn``."""
    g_gamma = _lightning("fused_recurrent_lightning_attn", q, v, layer_idx, num_layers)
    return fused_recurrent_simple_gla(q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens,
                                      backend=backend)
