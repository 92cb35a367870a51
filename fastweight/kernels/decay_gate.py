"""Log-gate bookkeeping for the decay family: chunk-local cumulative sums (forward), and the sums
that turn per-position gate-gradient terms into ``dg``: inside each chunk (the decay family,
``decay.py``), or over the whole sequence (the DPLR kernels).

    gc[t] = sum_{s <= t, s in chunk(t)} g[s] + g_gamma * (t - chunk_start(t) + 1)
    gp[t] = gc[t] - g[t]                  (optional: the same sum one token earlier)
    dg[u] = sum_{t >= u} x[t] + sum_{t > u} a[t] + sum_{t < u} y[t]     (t in chunk(u); a optional)
    dg[s] = carry + sum_{t >= s, t in sequence(s)} x[t] - sub[s]      (sub optional)

Gates are ``[1, T, H]`` (scalar, D = 1) or ``[1, T, H, D]`` (per channel), packed as in
:mod:`fastweight.kernels.common`; outputs are float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks
from fastweight.kernels.decay_state import while_loops


@triton.jit
def decay_gate_cumsum_kernel(g, g_gamma, gc, gp, cu_seqlens, chunk_indices, H: tl.constexpr, D: tl.constexpr,
                             BT: tl.constexpr, BD: tl.constexpr, USE_G: tl.constexpr,
                             USE_G_GAMMA: tl.constexpr, STORE_GP: tl.constexpr):
    i_c, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m = ((i_t * BT + o_t) < (eos - bos))[:, None] & (o_d < D)[None, :]
    o_x = ((bos + i_t * BT + o_t) * H + i_h)[:, None] * D + o_d[None, :]
    b_c = tl.zeros([BT, BD], dtype=tl.float32)
    if USE_G:
        b_g = tl.load(g + o_x, mask=m, other=0.).to(tl.float32)
        b_c += tl.cumsum(b_g, axis=0)
    if USE_G_GAMMA:
        b_c += tl.load(g_gamma + i_h).to(tl.float32) * (o_t + 1).to(tl.float32)[:, None]
    tl.store(gc + o_x, b_c, mask=m)
    if STORE_GP:
        tl.store(gp + o_x, b_c - b_g, mask=m)


@triton.jit
def decay_gate_chunk_grad_kernel(x, a, y, dg, cu_seqlens, chunk_indices, H: tl.constexpr, D: tl.constexpr,
                                 BT: tl.constexpr, BD: tl.constexpr, USE_A: tl.constexpr):
    i_c, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = (o_d < D)[None, :]
    o_x = ((bos + i_t * BT + o_t) * H + i_h)[:, None] * D + o_d[None, :]
    m = ((i_t * BT + o_t) < (eos - bos))[:, None] & m_d
    b_x = tl.load(x + o_x, mask=m, other=0.)
    if USE_A:
        # a one row later: its reverse cumsum is sum_{t > u}
        m_a = ((o_t + 1 < BT) & (i_t * BT + o_t + 1 < eos - bos))[:, None] & m_d
        b_x += tl.load(a + o_x + H * D, mask=m_a, other=0.)
    # y one row earlier: its cumsum is sum_{t < u}
    m_y = ((o_t > 0) & (i_t * BT + o_t < eos - bos))[:, None] & m_d
    b_y = tl.load(y + o_x - H * D, mask=m_y, other=0.)
    b_dg = tl.cumsum(b_x, axis=0, reverse=True) + tl.cumsum(b_y, axis=0)
    tl.store(dg + o_x, b_dg.to(dg.dtype.element_ty), mask=m)


@triton.jit
def decay_gate_reverse_cumsum_step(b_carry, i_t, x, sub, y, bos, T, i_h, o_d, m_d, H: tl.constexpr, D: tl.constexpr,
                                   BT: tl.constexpr, USE_SUB: tl.constexpr):
    o_t = i_t * BT + tl.arange(0, BT)
    m = (o_t < T)[:, None] & m_d[None, :]
    o_x = ((bos + o_t) * H + i_h)[:, None] * D + o_d[None, :]
    b_x = tl.load(x + o_x, mask=m, other=0.).to(tl.float32)
    b_y = tl.cumsum(b_x, axis=0, reverse=True) + b_carry[None, :]
    if USE_SUB:
        b_y -= tl.load(sub + o_x, mask=m, other=0.).to(tl.float32)
    tl.store(y + o_x, b_y.to(y.dtype.element_ty), mask=m)
    return b_carry + tl.sum(b_x, axis=0)


@triton.jit
def decay_gate_reverse_cumsum_kernel(x, carry, sub, y, cu_seqlens, H: tl.constexpr, D: tl.constexpr,
                                     BT: tl.constexpr, BD: tl.constexpr, USE_CARRY: tl.constexpr,
                                     USE_SUB: tl.constexpr, WHILE_LOOP: tl.constexpr):
    i_n, i_h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_carry = tl.zeros([BD], dtype=tl.float32)
    if USE_CARRY:
        b_carry += tl.load(carry + (i_n * H + i_h) * D + o_d, mask=m_d, other=0.)
    if WHILE_LOOP:
        i_c = 0
        while i_c < NT:
            b_carry = decay_gate_reverse_cumsum_step(b_carry, NT - 1 - i_c, x, sub, y, bos, eos - bos, i_h, o_d, m_d,
                                                     H, D, BT, USE_SUB)
            i_c += 1
    else:
        for i_c in range(0, NT):
            b_carry = decay_gate_reverse_cumsum_step(b_carry, NT - 1 - i_c, x, sub, y, bos, eos - bos, i_h, o_d, m_d,
                                                     H, D, BT, USE_SUB)


def gate_cumsum(g: torch.Tensor | None, g_gamma: torch.Tensor | None, chunks: Chunks, H: int,
                T: int, exclusive: bool = False):
    """Chunk-local cumulative log decay, fp32: g [1, T, H(, D)] and/or g_gamma [H] -> [1, T, H(, D)];
    with ``exclusive`` (g given, no g_gamma) also gp = gc - g, returned as (gc, gp)."""
    D = g.shape[3] if g is not None and g.dim() == 4 else 1
    shape = (1, T, H, D) if D > 1 else (1, T, H)
    gc = torch.empty(shape, dtype=torch.float32, device=chunks.cu_seqlens.device)
    if exclusive and (g is None or g_gamma is not None):
        raise ValueError("gate_cumsum: exclusive needs g and no g_gamma")
    gp = torch.empty_like(gc) if exclusive else None
    BD = min(64, triton.next_power_of_2(D))
    grid = (chunks.NC, H, triton.cdiv(D, BD))
    decay_gate_cumsum_kernel[grid](g.contiguous() if g is not None else gc, g_gamma if g_gamma is not None else gc,
                                   gc, gp if exclusive else gc, chunks.cu_seqlens, chunks.chunk_indices, H=H, D=D,
                                   BT=chunks.BT, BD=BD, USE_G=g is not None, USE_G_GAMMA=g_gamma is not None,
                                   STORE_GP=exclusive)
    return (gc, gp) if exclusive else gc


def gate_chunk_grad(x: torch.Tensor, a: torch.Tensor | None, y: torch.Tensor, chunks: Chunks,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """dg[u] = sum_{t >= u} x[t] + sum_{t > u} a[t] + sum_{t < u} y[t] over the tokens t of u's chunk:
    x, a, y [1, T, H(, D)] fp32 (a optional); dg in ``dtype`` (default fp32), summed in fp32."""
    H = x.shape[2]
    D = x.shape[3] if x.dim() == 4 else 1
    dg = torch.empty_like(x, dtype=dtype or x.dtype)
    BD = min(64, triton.next_power_of_2(D))
    grid = (chunks.NC, H, triton.cdiv(D, BD))
    decay_gate_chunk_grad_kernel[grid](x, a if a is not None else x, y, dg, chunks.cu_seqlens, chunks.chunk_indices,
                                       H=H, D=D, BT=chunks.BT, BD=BD, USE_A=a is not None)
    return dg


def gate_reverse_cumsum(x: torch.Tensor, chunks: Chunks, carry: torch.Tensor | None = None,
                        sub: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[s] = carry + sum_{t >= s} x[t] - sub[s] within each sequence: x, sub [1, T, H(, D)] fp32,
    carry [N, H(, D)]; y in ``dtype`` (default fp32), summed in fp32."""
    H = x.shape[2]
    D = x.shape[3] if x.dim() == 4 else 1
    y = torch.empty_like(x, dtype=dtype or x.dtype)
    BD = min(64, triton.next_power_of_2(D))
    grid = (chunks.N, H, triton.cdiv(D, BD))
    decay_gate_reverse_cumsum_kernel[grid](x, carry.contiguous() if carry is not None else x,
                                           sub if sub is not None else x, y, chunks.cu_seqlens, H=H, D=D,
                                           BT=chunks.BT, BD=BD, USE_CARRY=carry is not None,
                                           USE_SUB=sub is not None, WHILE_LOOP=while_loops())
    return y
