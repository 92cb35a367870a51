"""The chunk-local sums of log gates, shared by every family: the cumulative gate (forward) and
the sums that turn per-position gate-gradient terms into ``dg`` (backward).

    gc[t] = sum_{s <= t, s in chunk(t)} g[s] + g_gamma (t - chunk_start(t) + 1)    (chunk_cumsum)
    gp[t] = gc[t] - g[t]                                 (``exclusive``: the same sum one token earlier)
    d[s]  = sum_{t >= s, t in chunk(s)} x[t]                             (``reverse``: the VJP of gc)
    dg[u] = sum_{t >= u} x[t] + sum_{t > u} a[t] + sum_{t < u} y[t]       (gate_chunk_grad; t in chunk(u))

``g`` may be the pre-activation of Mamba-2's gate (``A_log``, ``dt_bias``): the sum then runs over
``-exp(A_log) softplus(g + dt_bias)``. Gates are ``[1, T, H]`` (scalar, D = 1) or
``[1, T, H, D]`` (per channel), packed as in :mod:`fastweight.kernels.common`; sums are fp32. The
reverse sums run as scans from the chunk's end, not as total - prefix: a strongly decayed chunk's
gradient is small at its end and the subtraction would leave the rounding of the whole sum there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, alloc, exp


@triton.jit
def _chunk_rows(cu_seqlens, chunk_indices, i_c, i_d, H: tl.constexpr, D: tl.constexpr, i_h, BT: tl.constexpr,
                BD: tl.constexpr):
    """(offsets [BT, BD] of global chunk i_c's rows in a packed [1, T, H, D] tensor, the rows'
    index within the chunk [BT], the chunk's row count, the channel mask [BD])."""
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    n = tl.minimum(eos - bos - i_t * BT, BT)
    o_x = ((bos + i_t * BT + o_t) * H + i_h)[:, None] * D + o_d[None, :]
    return o_x, o_t, n, o_d < D


@triton.jit
def chunk_cumsum_kernel(g, g_gamma, A_log, dt_bias, gc, gp, cu_seqlens, chunk_indices, H: tl.constexpr,
                        D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, USE_G: tl.constexpr,
                        USE_G_GAMMA: tl.constexpr, USE_GATE: tl.constexpr, REVERSE: tl.constexpr,
                        STORE_GP: tl.constexpr):
    i_c, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_x, o_t, n, m_d = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_d, H, D, i_h, BT, BD)
    m = (o_t < n)[:, None] & m_d[None, :]
    b_c = tl.zeros([BT, BD], dtype=tl.float32)
    if USE_G:
        b_g = tl.load(g + o_x, mask=m, other=0.).to(tl.float32)
        if USE_GATE:
            # Mamba-2's gate: g = -exp(A_log) softplus(x + dt_bias), A_log per head, dt_bias per head (and channel)
            o_d = i_d * BD + tl.arange(0, BD)
            b_g += tl.load(dt_bias + i_h * D + o_d, mask=o_d < D, other=0.).to(tl.float32)[None, :]
            b_sp = tl.where(b_g > 20., b_g, tl.log(1. + exp(tl.minimum(b_g, 20.))))
            b_g = tl.where(m, -exp(tl.load(A_log + i_h).to(tl.float32)) * b_sp, 0.)
        b_c += tl.cumsum(b_g, axis=0, reverse=REVERSE)
    if USE_G_GAMMA:
        b_c += tl.load(g_gamma + i_h).to(tl.float32) * (o_t + 1).to(tl.float32)[:, None]
    tl.store(gc + o_x, b_c.to(gc.dtype.element_ty), mask=m)
    if STORE_GP:
        tl.store(gp + o_x, b_c - b_g, mask=m)


@triton.jit
def gate_chunk_grad_kernel(x, a, y, dg, cu_seqlens, chunk_indices, H: tl.constexpr, D: tl.constexpr,
                           BT: tl.constexpr, BD: tl.constexpr, USE_A: tl.constexpr):
    i_c, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_x, o_t, n, m_d = _chunk_rows(cu_seqlens, chunk_indices, i_c, i_d, H, D, i_h, BT, BD)
    m = (o_t < n)[:, None] & m_d[None, :]
    m_d = m_d[None, :]
    b_x = tl.load(x + o_x, mask=m, other=0.)
    if USE_A:
        # a one row later: its reverse cumsum is sum_{t > u}
        b_x += tl.load(a + o_x + H * D, mask=(o_t + 1 < n)[:, None] & m_d, other=0.)
    # y one row earlier: its cumsum is sum_{t < u}
    b_y = tl.load(y + o_x - H * D, mask=((o_t > 0) & (o_t < n))[:, None] & m_d, other=0.)
    b_dg = tl.cumsum(b_x, axis=0, reverse=True) + tl.cumsum(b_y, axis=0)
    tl.store(dg + o_x, b_dg.to(dg.dtype.element_ty), mask=m)


def _grid(x: torch.Tensor, chunks: Chunks):
    H = x.shape[2]
    D = x.shape[3] if x.dim() == 4 else 1
    BD = min(64, triton.next_power_of_2(D))
    return (chunks.NC, H, triton.cdiv(D, BD)), dict(H=H, D=D, BT=chunks.BT, BD=BD)


def chunk_cumsum(g: torch.Tensor | None, chunks: Chunks, *, g_gamma: torch.Tensor | None = None,
                 reverse: bool = False, exclusive: bool = False, A_log: torch.Tensor | None = None,
                 dt_bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                 heads: int | None = None, length: int | None = None):
    """The chunk-local cumulative sum of ``g`` [1, T, H] or [1, T, H, D] (and/or ``g_gamma`` [H],
    whose sum is g_gamma times the position in the chunk; with g None, ``heads`` and ``length``
    give the shape) in ``out_dtype``; ``reverse``: the sum from the chunk's end (the VJP);
    ``exclusive``: returns (gc, gp = gc - g); ``A_log`` [H], ``dt_bias`` [H * D]: g is Mamba-2's
    gate pre-activation (forward only)."""
    if g is None and g_gamma is None:
        raise ValueError("chunk_cumsum: needs g or g_gamma")
    if exclusive and (g is None or g_gamma is not None or reverse):
        raise ValueError("chunk_cumsum: exclusive needs g, no g_gamma and the forward sum")
    if g is not None:
        g = g.contiguous()
        shape = g.shape
    else:
        shape = (1, length, heads)
    device = chunks.cu_seqlens.device
    gc = alloc(shape, dtype=out_dtype, device=device)
    gp = alloc(shape, dtype=torch.float32, device=device) if exclusive else None
    grid, meta = _grid(gc, chunks)
    chunk_cumsum_kernel[grid](g, g_gamma, A_log, dt_bias, gc, gp, chunks.cu_seqlens, chunks.chunk_indices, **meta,
                              USE_G=g is not None, USE_G_GAMMA=g_gamma is not None, USE_GATE=A_log is not None,
                              REVERSE=reverse, STORE_GP=exclusive)
    return (gc, gp) if exclusive else gc


def gate_chunk_grad(x: torch.Tensor, a: torch.Tensor | None, y: torch.Tensor, chunks: Chunks,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """dg[u] = sum_{t >= u} x[t] + sum_{t > u} a[t] + sum_{t < u} y[t] over the tokens t of u's chunk:
    x, a, y [1, T, H(, D)] fp32 (a optional); dg in ``dtype`` (default fp32), summed in fp32."""
    dg = alloc(x.shape, dtype=dtype or x.dtype, device=x.device)
    grid, meta = _grid(x, chunks)
    gate_chunk_grad_kernel[grid](x, a if a is not None else x, y, dg, chunks.cu_seqlens, chunks.chunk_indices,
                                 **meta, USE_A=a is not None)
    return dg
