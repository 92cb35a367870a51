"""Chunk-local cumulative sum of log gates (forward) and its reverse (backward).

    g_cum[t] = sum_{s <= t, s in chunk(t)} g[s]          (REVERSE=False; USE_GATE: g from Mamba-2's gate)
    d_g[s]   = sum_{t >= s, t in chunk(s)} d_cum[t]       (REVERSE=True: the VJP of the above)

Works on scalar gates ``[1, T, H]`` (D = 1) and per-channel gates ``[1, T, H, D]`` alike; the
output is float32. Chunks follow :mod:`fastweight.kernels.common`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, alloc


@triton.jit
def chunk_local_cumsum_kernel(x, y, A_log, dt_bias, cu_seqlens, chunk_indices, H: tl.constexpr, D: tl.constexpr,
                              BT: tl.constexpr, BD: tl.constexpr, REVERSE: tl.constexpr, USE_GATE: tl.constexpr):
    i_c, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    p_x = tl.make_block_ptr(x + (bos * H + i_h) * D, (eos - bos, D), (H * D, 1), (i_t * BT, i_d * BD), (BT, BD), (1, 0))
    p_y = tl.make_block_ptr(y + (bos * H + i_h) * D, (eos - bos, D), (H * D, 1), (i_t * BT, i_d * BD), (BT, BD), (1, 0))
    b_x = tl.load(p_x, boundary_check=(0, 1)).to(tl.float32)
    if USE_GATE:
        # Mamba-2's gate: g = -exp(A_log) softplus(x + dt_bias), one A_log per head, dt_bias per head (and channel)
        o_d = i_d * BD + tl.arange(0, BD)
        b_x += tl.load(dt_bias + i_h * D + o_d, mask=o_d < D, other=0.).to(tl.float32)[None, :]
        b_sp = tl.where(b_x > 20., b_x, tl.log(1. + tl.exp(tl.minimum(b_x, 20.))))
        b_x = -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * b_sp
    # the reverse sum runs as a scan from the end, not as total - prefix: a strongly decayed chunk's
    # gradient is small at its end and the subtraction would leave the rounding of the whole sum there
    b_y = tl.cumsum(b_x, axis=0, reverse=REVERSE)
    tl.store(p_y, b_y.to(p_y.dtype.element_ty), boundary_check=(0, 1))


def chunk_local_cumsum(g: torch.Tensor, chunks: Chunks, reverse: bool = False,
                       out_dtype: torch.dtype = torch.float32, A_log: torch.Tensor | None = None,
                       dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """g: [1, T, H] or [1, T, H, D] (packed) -> same shape in ``out_dtype``.

    With ``A_log`` [H] and ``dt_bias`` [H * D] (forward only), ``g`` is the gate's pre-activation
    and the cumsum runs over ``-exp(A_log) * softplus(g + dt_bias)`` (Mamba-2's parameterisation)."""
    H = g.shape[2]
    D = g.shape[3] if g.dim() == 4 else 1
    BD = min(64, triton.next_power_of_2(D))
    g = g.contiguous()
    out = alloc(g.shape, dtype=out_dtype, device=g.device)
    grid = (chunks.NC, H, triton.cdiv(D, BD))
    use_gate = A_log is not None
    chunk_local_cumsum_kernel[grid](g, out, A_log, dt_bias, chunks.cu_seqlens, chunks.chunk_indices, H=H, D=D,
                                    BT=chunks.BT, BD=BD, REVERSE=reverse, USE_GATE=use_gate)
    return out
