"""Normalised linear attention's denominator in one pass: the running key sum, forward and backward.

    Z_t = z_0 + sum_{s <= t} k_s        (per sequence and key head; z_0 fla's carried-over sum, or 0)
    d_t = scale q_t . Z_t + 1e-10        y_t = o_t / d_t         (each of the key head's value heads)

with o the unnormalised output of the linear-attention op (fla's ``normalize=True``: Katharopoulos et
al.'s normaliser, the kv initial state not counted). The gradient, g_t = -scale sum_{v, value heads}
dy_t y_t / d_t (the cotangent of q_t . Z_t):

    do_t = dy_t / d_t     dq_t = g_t Z_t     dk_s = dZ_T + sum_{t >= s} g_t q_t     dz_0 = dk at s = 0

(dZ_T the cotangent of the returned key sum z_state, which every key of the sequence and z_0 reach).
Why a kernel: in PyTorch the scan, the products and their autograd graph cost 19 ms of a 21.6 ms
forward and 47 ms of a 65 ms forward+backward at (8, 16384, 64, 64) bf16 on the H100, where the
bytes (q, k, o read, y written) take about 1.3 ms.

One program per (sequence, key head) walks the sequence's chunks of ``BT`` tokens in order with Z's
carry [K] in fp32, as ``state_fwd`` walks its states (sequences longest first); the backward walks
forward for do, dq (and g, kept in an fp32 [T, H] buffer) and then back for dk's reverse sum.
Layout: q, k [B, T, H, K] and o [B, T, H*G, V] contiguous, value head h*G + j reading key head h;
K <= ``MAX_K`` (one key block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from fastweight.kernels.common import alloc, prepare_chunks, while_loops

MAX_K = 256
BT, BV = 64, 128
# The chunk loop's software pipelining: None leaves the loop unannotated, and Triton then prefetches only
# loads that feed a dot (this kernel has none), so each chunk's loads wait on memory in turn; 3 stages
# prefetch the next chunks' q, k, o through shared memory. With one 128-wide value block, H100 linear
# attention (normalize=True) fwd / fwd+bwd: (8, 16384, 64, 64) 3.86 / 18.14 -> 3.38 / 17.53 ms, (4, 8192,
# 16, 128) 1.475 / 4.30 -> 0.955 / 4.03 (docs/bench/decay_dplr.md). For 16-bit inputs only
# (``loop_stages``): fp32's stages at K = 256 need 264-329 KB of shared memory (sm_90 has 227).
LOOP_STAGES = 3
NUM_WARPS = 4


@triton.jit
def _sequence(cu_seqlens, order, H: tl.constexpr):
    """(sequence n, key head h, its first and end rows) of this program (sequences longest first)."""
    i_nh = tl.program_id(0)
    i_n, i_h = tl.load(order + i_nh // H).to(tl.int64), i_nh % H
    return i_n, i_h, tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)


@triton.jit
def _key_tile(rows, m_t, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """(offsets, mask) of the rows' [BT, BK] key-head tile in a [B*T, H, K] tensor (q, k, dq, dk)."""
    o_k = tl.arange(0, BK)
    return (rows * H + i_h)[:, None] * K + o_k[None, :], m_t[:, None] & (o_k < K)[None, :]


@triton.jit
def _value_tile(rows, m_t, i_h, i_g, i_v, H: tl.constexpr, G: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """(offsets, mask) of value block i_v of value head i_h * G + i_g: a [BT, BV] tile of o, y, dy or do."""
    o_v = i_v * BV + tl.arange(0, BV)
    return (rows * (H * G) + i_h * G + i_g)[:, None] * V + o_v[None, :], m_t[:, None] & (o_v < V)[None, :]


@triton.jit
def _fwd_chunk(i_t, b_z, q, k, o, y, den, bos, eos, i_h, scale, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Chunk i_t of the forward: d, y stored; returns the carry b_z [BK] past the chunk."""
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_t = rows < eos
    p_x, m_x = _key_tile(rows, m_t, i_h, H, K, BK)
    b_k = tl.load(k + p_x, mask=m_x, other=0.).to(tl.float32)
    b_q = tl.load(q + p_x, mask=m_x, other=0.).to(tl.float32)
    b_d = tl.sum(scale * b_q * (tl.cumsum(b_k, axis=0) + b_z[None, :]), axis=1) + 1e-10
    tl.store(den + rows * H + i_h, b_d, mask=m_t)
    for i_g in range(G):
        for i_v in range(tl.cdiv(V, BV)):
            p_o, m_o = _value_tile(rows, m_t, i_h, i_g, i_v, H, G, V, BV)
            b_o = tl.load(o + p_o, mask=m_o, other=0.).to(tl.float32)
            tl.store(y + p_o, (b_o / b_d[:, None]).to(y.dtype.element_ty), mask=m_o)
    return b_z + tl.sum(b_k, axis=0)


@triton.jit
def _bwd_forward_chunk(i_t, b_z, k, y, den, dy, gbuf, dq, do, bos, eos, i_h, scale, H: tl.constexpr,
                       G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr):
    """Chunk i_t of the backward's forward walk: do, g (into gbuf) and dq = g Z stored; returns the carry."""
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_t = rows < eos
    b_d = tl.load(den + rows * H + i_h, mask=m_t, other=1.)
    b_g = tl.zeros([BT], dtype=tl.float32)
    for i_g in range(G):
        for i_v in range(tl.cdiv(V, BV)):
            p_o, m_o = _value_tile(rows, m_t, i_h, i_g, i_v, H, G, V, BV)
            b_dy = tl.load(dy + p_o, mask=m_o, other=0.).to(tl.float32)
            b_g += tl.sum(b_dy * tl.load(y + p_o, mask=m_o, other=0.).to(tl.float32), axis=1)
            tl.store(do + p_o, (b_dy / b_d[:, None]).to(do.dtype.element_ty), mask=m_o)
    b_g = -scale * b_g / b_d
    tl.store(gbuf + rows * H + i_h, b_g, mask=m_t)
    p_x, m_x = _key_tile(rows, m_t, i_h, H, K, BK)
    b_k = tl.load(k + p_x, mask=m_x, other=0.).to(tl.float32)
    tl.store(dq + p_x, (b_g[:, None] * (tl.cumsum(b_k, axis=0) + b_z[None, :])).to(dq.dtype.element_ty), mask=m_x)
    return b_z + tl.sum(b_k, axis=0)


@triton.jit
def _bwd_reverse_chunk(i_t, b_c, q, gbuf, dk, bos, eos, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr):
    """Chunk i_t of the backward's reverse walk: dk = b_c + the reverse sum of g q; returns the carry."""
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_t = rows < eos
    p_x, m_x = _key_tile(rows, m_t, i_h, H, K, BK)
    b_dZ = (tl.load(gbuf + rows * H + i_h, mask=m_t, other=0.)[:, None]
            * tl.load(q + p_x, mask=m_x, other=0.).to(tl.float32))
    tl.store(dk + p_x, (tl.cumsum(b_dZ, axis=0, reverse=True) + b_c[None, :]).to(dk.dtype.element_ty), mask=m_x)
    return b_c + tl.sum(b_dZ, axis=0)


@triton.jit
def key_sum_fwd_kernel(q, k, o, z0, y, den, zt, cu_seqlens, order, scale, H: tl.constexpr, G: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       USE_Z0: tl.constexpr, WHILE_LOOP: tl.constexpr, LOOP_STAGES: tl.constexpr):
    i_n, i_h, bos, eos = _sequence(cu_seqlens, order, H)
    o_k = tl.arange(0, BK)
    b_z = tl.zeros([BK], dtype=tl.float32)
    if USE_Z0:
        b_z += tl.load(z0 + (i_n * H + i_h) * K + o_k, mask=o_k < K, other=0.).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    if WHILE_LOOP:
        i_t = 0
        while i_t < NT:
            b_z = _fwd_chunk(i_t, b_z, q, k, o, y, den, bos, eos, i_h, scale, H, G, K, V, BT, BK, BV)
            i_t += 1
    else:
        for i_t in tl.range(NT, num_stages=LOOP_STAGES):
            b_z = _fwd_chunk(i_t, b_z, q, k, o, y, den, bos, eos, i_h, scale, H, G, K, V, BT, BK, BV)
    tl.store(zt + (i_n * H + i_h) * K + o_k, b_z.to(zt.dtype.element_ty), mask=o_k < K)


@triton.jit
def key_sum_bwd_kernel(q, k, y, den, z0, dy, dzt, gbuf, dq, dk, do, dz0, cu_seqlens, order, scale,
                       H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, USE_Z0: tl.constexpr, USE_DZT: tl.constexpr,
                       WHILE_LOOP: tl.constexpr, LOOP_STAGES: tl.constexpr):
    i_n, i_h, bos, eos = _sequence(cu_seqlens, order, H)
    o_k = tl.arange(0, BK)
    NT = tl.cdiv(eos - bos, BT)
    # forward walk: do, g and dq = g Z
    b_z = tl.zeros([BK], dtype=tl.float32)
    if USE_Z0:
        b_z += tl.load(z0 + (i_n * H + i_h) * K + o_k, mask=o_k < K, other=0.).to(tl.float32)
    # backward walk's carry: dk_s = dZ_T + sum_{t >= s} g_t q_t, its total dz_0
    b_c = tl.zeros([BK], dtype=tl.float32)
    if USE_DZT:
        b_c += tl.load(dzt + (i_n * H + i_h) * K + o_k, mask=o_k < K, other=0.).to(tl.float32)
    if WHILE_LOOP:
        i_t = 0
        while i_t < NT:
            b_z = _bwd_forward_chunk(i_t, b_z, k, y, den, dy, gbuf, dq, do, bos, eos, i_h, scale, H, G, K, V, BT,
                                     BK, BV)
            i_t += 1
        i_t = NT - 1
        while i_t >= 0:
            b_c = _bwd_reverse_chunk(i_t, b_c, q, gbuf, dk, bos, eos, i_h, H, K, BT, BK)
            i_t -= 1
    else:
        for i_t in tl.range(NT, num_stages=LOOP_STAGES):
            b_z = _bwd_forward_chunk(i_t, b_z, k, y, den, dy, gbuf, dq, do, bos, eos, i_h, scale, H, G, K, V, BT,
                                     BK, BV)
        # every thread's g stores visible before the reverse walk reads them
        tl.debug_barrier()
        for j in tl.range(NT, num_stages=LOOP_STAGES):
            b_c = _bwd_reverse_chunk(NT - 1 - j, b_c, q, gbuf, dk, bos, eos, i_h, H, K, BT, BK)
    if USE_Z0:
        tl.store(dz0 + (i_n * H + i_h) * K + o_k, b_c.to(dz0.dtype.element_ty), mask=o_k < K)


def _launch(q, o):
    """(grid, constexprs) shared by both kernels."""
    _, _, H, K = q.shape
    HV, V = o.shape[2], o.shape[3]
    return dict(H=H, G=HV // H, K=K, V=V, BT=BT, BK=max(16, triton.next_power_of_2(K)),
                BV=min(BV, max(16, triton.next_power_of_2(V))), WHILE_LOOP=while_loops(),
                LOOP_STAGES=loop_stages(q.dtype), num_warps=NUM_WARPS)


def loop_stages(dtype: torch.dtype):
    """The chunk loop's pipelining stages for inputs of ``dtype``: ``LOOP_STAGES`` for 16-bit ones, None
    (unannotated) for fp32, whose prefetch buffers do not fit in shared memory at the larger K."""
    return LOOP_STAGES if dtype in (torch.float16, torch.bfloat16) else None


class KeySumNormalize(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, o, z0, scale: float, cu_seqlens):
        B, T, H, K = q.shape
        q, k, o = q.contiguous(), k.contiguous(), o.contiguous()
        chunks = prepare_chunks(cu_seqlens, B, T, BT, q.device)
        y = alloc(o.shape, dtype=o.dtype, device=o.device)
        den = alloc((B * T, H), dtype=torch.float32, device=q.device)
        zt = alloc((chunks.N, 1, H, K), dtype=k.dtype, device=k.device)
        z0c = z0.contiguous() if z0 is not None else None
        key_sum_fwd_kernel[(chunks.N * H,)](q, k, o, z0c if z0c is not None else k, y, den, zt, chunks.cu_seqlens,
                                            chunks.order, scale, USE_Z0=z0c is not None, **_launch(q, o))
        ctx.save_for_backward(q, k, y, den, z0c)
        ctx.scale, ctx.chunks = scale, chunks
        return y, zt

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dzt):
        q, k, y, den, z0 = ctx.saved_tensors
        chunks = ctx.chunks
        B, T, H, K = q.shape
        dy = dy.contiguous()
        dzt = dzt.contiguous() if dzt is not None else None
        dq, dk = alloc(q.shape, dtype=q.dtype, device=q.device), alloc(k.shape, dtype=k.dtype, device=k.device)
        do = alloc(y.shape, dtype=y.dtype, device=y.device)
        dz0 = alloc(z0.shape, dtype=z0.dtype, device=z0.device) if z0 is not None else None
        gbuf = torch.empty((B * T, H), dtype=torch.float32, device=q.device)
        key_sum_bwd_kernel[(chunks.N * H,)](q, k, y, den, z0 if z0 is not None else k, dy,
                                            dzt if dzt is not None else k, gbuf, dq, dk, do,
                                            dz0 if dz0 is not None else k, chunks.cu_seqlens, chunks.order,
                                            ctx.scale, USE_Z0=z0 is not None, USE_DZT=dzt is not None,
                                            **_launch(q, y))
        return dq, dk, do, dz0, None, None


def normalize(q, k, o, scale: float, cu_seqlens=None, z_init=None):
    """(o_t / (scale q_t . Z_t + 1e-10) [B, T, HV, V] in o's dtype, z_state [N, 1, H, K] in k's dtype:
    Z at each sequence's last token, z_init (or 0) for an empty one). q, k: [B, T, H, K], K <= ``MAX_K``;
    o: [B, T, HV, V]; z_init: [N, 1, H, K] or None. Differentiable in q, k, o and z_init. The result is
    saved for the backward (as torch.exp saves its own): changing it in place before backward is an error."""
    B, T, H, K = q.shape
    if K > MAX_K:
        raise ValueError(f"key_sum.normalize: K must be <= {MAX_K} (one key block), got {K}")
    if k.shape != q.shape or o.dim() != 4 or o.shape[:2] != (B, T) or o.shape[2] % H:
        raise ValueError(f"key_sum.normalize: q, k [B, T, H, K] alike and o [B, T, G*H, V], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(o.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"key_sum.normalize: with cu_seqlens, B must be 1, got {B}")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if z_init is not None and tuple(z_init.shape) != (N, 1, H, K):
        raise ValueError(f"key_sum.normalize: z_init must be [N, 1, H, K] = {[N, 1, H, K]}, got {list(z_init.shape)}")
    return KeySumNormalize.apply(q, k, o, z_init, float(scale), cu_seqlens)
