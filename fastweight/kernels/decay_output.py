"""Output of the decay family per chunk, and the backward kernels that mirror it.

Forward, for a chunk with state S = h[c] before it (gq, gc as in ``decay_intra.py``):

    o = scale (q * exp(gq)) S + A v,    A = lower(scale (q k^T) * exp(gq_t - gc_s))

With a per-channel gate A comes precomputed from ``decay_intra.py`` (``USE_A``); with a
scalar gate or none it is formed here, the decay matrix exp(gq_t - gc_s) <= 1 being safe.
The generic DPLR output adds a second term lower(A2) v2 (``USE_A2``: A_qb times the reads U).

Backward (dh[c] = dL/dS after chunk c, G = gc at the chunk's last token):

    dA = lower(do v^T)                     (for the intra-chunk dq, dk: stored by the dv kernel, or
                                            formed again by the dq/dk kernel in its wide form)
    dv = A^T do + (k * exp(G - gc)) dh[c]
    dq = scale exp(gq) (do S^T) + (dA * D) k,   dk = exp(G - gc) (v dh[c]^T) + (dA * D)^T q
    with D = scale exp(gq_t - gc_s) masked (scalar gate or none; the per-channel case is in
    ``decay_intra.py``). A scalar gate's gradient is formed in the same program, over the whole
    chunk (the terms of ``decay.py``'s formula summed over the channels):

    dg_u = sum_{t >= u} (q dq' - k dk')_t + sum_{t < u} (k dk^inter)_t + exp(G) sum(h[c] * dh[c])

    with dq', dk' the inter-chunk part of dq and the pairs s < t of the intra-chunk parts (the
    diagonal s = t, whose gate difference is 0, is added to dq, dk after).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, MIN_DOT_BLOCK, dot_at, dot_precision, exp


@triton.jit
def decay_output_fwd_kernel(q, k, v, gq, gc, h, A, A2, v2, o, cu_seqlens, chunk_indices, scale, H: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, GATE: tl.constexpr, USE_A: tl.constexpr, USE_A2: tl.constexpr,
                            DOT_PRECISION: tl.constexpr):
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    i_n, i_c = tl.load(chunk_indices + i_t * 2).to(tl.int64), tl.load(chunk_indices + i_t * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    if GATE == 1:
        p_g = tl.make_block_ptr(gq + bos * H + i_h, (T,), (H,), (i_c * BT,), (BT,), (0,))
        b_gq = tl.load(p_g, boundary_check=(0,))
        p_g = tl.make_block_ptr(gc + bos * H + i_h, (T,), (H,), (i_c * BT,), (BT,), (0,))
        b_gc = tl.load(p_g, boundary_check=(0,))
    m_s = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_c * BT, i_k * BK), (BT, BK), (1, 0))
        p_h = tl.make_block_ptr(h + (i_t * H + i_h) * K * V, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_h = tl.load(p_h, boundary_check=(0, 1)).to(b_q.dtype)
        if GATE == 2:
            p_g = tl.make_block_ptr(gq + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_c * BT, i_k * BK), (BT, BK),
                                    (1, 0))
            b_qg = (b_q.to(tl.float32) * exp(tl.load(p_g, boundary_check=(0, 1)))).to(b_q.dtype)
        elif GATE == 1:
            b_qg = (b_q.to(tl.float32) * exp(b_gq)[:, None]).to(b_q.dtype)
        else:
            b_qg = b_q
        b_o += dot_at(b_qg, b_h, DOT_PRECISION)
        if not USE_A:
            p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, T), (1, H * K), (i_k * BK, i_c * BT), (BK, BT), (0, 1))
            b_A += dot_at(b_q, tl.load(p_k, boundary_check=(0, 1)), DOT_PRECISION)
    if USE_A:
        p_A = tl.make_block_ptr(A + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_c * BT, 0), (BT, BT), (1, 0))
        b_A = tl.where(m_s, tl.load(p_A, boundary_check=(0, 1)), 0.)
    else:
        if GATE == 1:
            b_A *= exp(tl.where(m_s, b_gq[:, None] - b_gc[None, :], 0.))
        b_A = tl.where(m_s, b_A * scale, 0.)
    p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_c * BT, i_v * BV), (BT, BV), (1, 0))
    b_v = tl.load(p_v, boundary_check=(0, 1))
    b_o = b_o * scale + dot_at(b_A.to(b_v.dtype), b_v, DOT_PRECISION)
    if USE_A2:
        p_A = tl.make_block_ptr(A2 + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_c * BT, 0), (BT, BT), (1, 0))
        b_A2 = tl.where(m_s, tl.load(p_A, boundary_check=(0, 1)), 0.)
        p_v = tl.make_block_ptr(v2 + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_c * BT, i_v * BV), (BT, BV), (1, 0))
        # the reads may be kept wider than v (fp32 for fp16 inputs): multiplied in v's dtype
        b_v2 = tl.load(p_v, boundary_check=(0, 1)).to(v.dtype.element_ty)
        b_o += dot_at(b_A2.to(b_v2.dtype), b_v2, DOT_PRECISION)
    p_o = tl.make_block_ptr(o + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_c * BT, i_v * BV), (BT, BV), (1, 0))
    tl.store(p_o, b_o.to(o.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def decay_bwd_dv_kernel(q, k, v, gq, gc, A, dh, do, dv, dA, cu_seqlens, chunk_indices, scale, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        GATE: tl.constexpr, USE_A: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, STORE_DA: tl.constexpr):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_n, i_c = tl.load(chunk_indices + i_t * 2).to(tl.int64), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    last = bos + tl.minimum(T, i_c * BT + BT) - 1
    m_all = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    m_s = m_all
    if GATE == 1:
        b_gc = tl.load(gc + (bos + o_t) * H + i_h, mask=m_t, other=0.)
        b_gl = tl.load(gc + last * H + i_h)
    if USE_A:
        b_A = tl.load(A + ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :], mask=m_s, other=0.)
    else:
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            p_k = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            b_q = tl.load(q + p_k, mask=m_tk, other=0.)
            b_k = tl.load(k + p_k, mask=m_tk, other=0.)
            b_A += dot_at(b_q, tl.trans(b_k), DOT_PRECISION)
        if GATE == 1:
            b_gq = tl.load(gq + (bos + o_t) * H + i_h, mask=m_t, other=0.)
            b_A *= exp(tl.where(m_s, b_gq[:, None] - b_gc[None, :], 0.))
        b_A = tl.where(m_s, b_A * scale, 0.)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_t[:, None] & m_v[None, :], other=0.)
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.)
        if STORE_DA:
            b_dA += dot_at(b_do, tl.trans(b_v), DOT_PRECISION)
        if GATE == 2 and b_do.dtype == tl.bfloat16:
            # per-channel decay (GLA, RWKV-6): the scores stay fp32 at TF32 for bf16; rounded to bf16 they
            # put dv at 1.19x fla's error (GPU emulation on the CPU: 3.09e-3 against 2.60e-3; 2.78e-3 so)
            b_dv = dot_at(tl.trans(b_A), b_do.to(tl.float32), "tf32")
        else:
            b_dv = dot_at(tl.trans(b_A).to(b_do.dtype), b_do, DOT_PRECISION)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            b_k = tl.load(k + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.)
            if GATE == 1:
                b_k = (b_k.to(tl.float32) * exp(b_gl - b_gc)[:, None]).to(b_k.dtype)
            elif GATE == 2:
                b_gk = tl.load(gc + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :],
                               mask=m_t[:, None] & m_k[None, :], other=0.)
                b_glk = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.)
                b_k = (b_k.to(tl.float32) * exp(b_glk[None, :] - b_gk)).to(b_k.dtype)
            b_dh = tl.load(dh + ((i_t * H + i_h) * K + o_k[:, None]) * V + o_v[None, :],
                           mask=m_k[:, None] & m_v[None, :], other=0.)
            b_dv += dot_at(b_k, b_dh.to(b_k.dtype), DOT_PRECISION)
        tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
    if STORE_DA:
        tl.store(dA + ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :], tl.where(m_all, b_dA, 0.),
                 mask=m_t[:, None])


@triton.jit
def decay_bwd_dqk_kernel(q, k, v, gq, gc, h, hl, dh, dhl, do, dA, dq, dk, dg, cu_seqlens, chunk_indices, scale,
                         T_all, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, FORM_DA: tl.constexpr):
    i_k, i_t, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    i_n, i_c = tl.load(chunk_indices + i_t * 2).to(tl.int64), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    if not FORM_DA:
        b_q = tl.load(q + p_k, mask=m_tk, other=0.)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dki = tl.zeros([BT, BK], dtype=tl.float32)
    # sum of h * dh over the K block and every V: the state's own decay exp(G) in the gate gradient
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    if FORM_DA:  # do v^T, from the tiles loaded for the inter-chunk terms
        b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
        p_h = ((i_t * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_t[:, None] & m_v[None, :], other=0.)
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.)
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + p_h, mask=m_kv, other=0.)
        b_dh = tl.load(dh + p_h, mask=m_kv, other=0.)
        b_hi = b_h.to(b_do.dtype)
        b_dhi = b_dh.to(b_v.dtype)
        if FORM_DA:
            b_dA += dot_at(b_do, tl.trans(b_v), DOT_PRECISION)
        b_dq += dot_at(b_do, tl.trans(b_hi), DOT_PRECISION)
        b_dki += dot_at(b_v, tl.trans(b_dhi), DOT_PRECISION)
        if SPLIT:  # split states (16-bit planes hi, lo: decay.py): the residual planes dotted too
            b_hl = tl.load(hl + p_h, mask=m_kv, other=0.)
            b_dhl = tl.load(dhl + p_h, mask=m_kv, other=0.)
            b_dq += dot_at(b_do, tl.trans(b_hl), DOT_PRECISION)
            b_dki += dot_at(b_v, tl.trans(b_dhl), DOT_PRECISION)
            if GATE == 1:
                b_hdh += tl.sum((b_h.to(tl.float32) + b_hl.to(tl.float32))
                                * (b_dh.to(tl.float32) + b_dhl.to(tl.float32)), axis=1)
        elif GATE == 1:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    # the pairs s < t; the diagonal s = t (inclusive readout, decay exp(0)) is added on its own below
    m_s = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    if FORM_DA:
        # q, k loaded after the value loop: kept through it they spill at BK = 128 (sm_90)
        b_q = tl.load(q + p_k, mask=m_tk, other=0.)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.)
        b_dd = tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_dA, 0.), axis=1) * scale
        b_dA = tl.where(m_s, b_dA, 0.)
    else:
        b_dA = tl.load(dA + ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :], mask=m_s, other=0.)
        b_dd = tl.load(dA + ((bos + o_t) * H + i_h) * BT + tl.arange(0, BT), mask=m_t, other=0.) * scale
    if GATE == 1:
        b_gq = tl.load(gq + (bos + o_t) * H + i_h, mask=m_t, other=0.)
        b_gc = tl.load(gc + (bos + o_t) * H + i_h, mask=m_t, other=0.)
        b_gl = tl.load(gc + (bos + tl.minimum(T, i_c * BT + BT) - 1) * H + i_h)
        b_dq *= exp(b_gq)[:, None]
        b_dki *= exp(b_gl - b_gc)[:, None]
        b_dA *= exp(tl.where(m_s, b_gq[:, None] - b_gc[None, :], 0.))
    b_dA = tl.where(m_s, b_dA * scale, 0.)
    b_dq = b_dq * scale + dot_at(b_dA.to(b_k.dtype), b_k, DOT_PRECISION)
    b_dk = dot_at(tl.trans(b_dA).to(b_q.dtype), b_q, DOT_PRECISION)
    if GATE == 1:
        # per chunk, no cancelling terms (decay.py): the reverse cumsum of q dq - k dk over the
        # pairs s < t, the forward exclusive cumsum of k dk through dh, and exp(G) sum(h dh)
        b_x = tl.sum(b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk, axis=1)
        b_y = tl.sum(b_k.to(tl.float32) * b_dki, axis=1)
        b_g = (tl.cumsum(b_x, axis=0, reverse=True)
               + tl.sum(tl.where(o_t[:, None] > o_t[None, :], b_y[None, :], 0.), axis=1)
               + exp(b_gl) * tl.sum(b_hdh, axis=0))
        tl.store(dg + i_k * T_all * H + (bos + o_t) * H + i_h, b_g, mask=m_t)
    b_dq += b_dd[:, None] * b_k.to(tl.float32)
    b_dk += b_dd[:, None] * b_q.to(tl.float32)
    b_dk += b_dki
    tl.store(dq + p_k, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)


# The key and value blocks of the three kernels: ``common.MIN_DOT_BLOCK``, a smaller K or V padded
# (masked): with narrower blocks the bf16 backward dv kernel at V = 16 with 8 warps made illegal
# memory accesses, and simple_gla at K = 64, V = 16 gave NaN outputs in bf16 (the dq/dk kernel's
# wide form takes a 128-wide key block, ``BK_DQK`` below). The output kernel's value block: 128 would
# read q and k once at V = 128; 64 gives more programs.
BK_OUT = BV_OUT = MIN_DOT_BLOCK
# (num_warps, num_stages) of each kernel: the fastest of `python -m fastweight.bench.gpu_sweep` on
# the H200. 4 warps for the output and dv kernels take 0.11 / 0.34 ms
# off simple_gla's 2.29 ms fwd+bwd at (4, 8192, 16, 128) and 0.88 / 2.44 ms off GLA's 37.7 at
# (8, 16384, 64, 64), against 8 warps and 2 stages; the dq/dk kernel runs 8 warps with one stage.
OUTPUT_FWD_CONFIG, BWD_DV_CONFIG, BWD_DQK_CONFIG = (4, 3), (4, 3), (8, 1)
# The dq/dk kernel capped at BWD_DQK_MAXNREG registers a thread where K <= 64 in bf16: two 8-warp programs an SM
# where one fitted at 198 registers (248 B of stack, sm_90). H100 simple_gla (8, 16384, 64, 64) fwd+bwd 18.18 ->
# 17.52 ms; at K = 128 the cap spills a kilobyte and lost 60% (2.864 -> 4.590), so it keeps no cap there; fp16
# untimed (docs/bench/decay_dplr.md).
BWD_DQK_MAXNREG, BWD_DQK_MAXNREG_MAX_K, BWD_DQK_MAXNREG_DTYPES = 128, 64, (torch.bfloat16,)
# The dq/dk kernel's wide form (``wide_dqk``): all of K <= 128 in one key block, the scores do v^T formed
# from the do, v tiles it loads, so that they are loaded once a chunk rather than once per 64 keys and
# the dv kernel stores no dA. H100 simple_gla fwd+bwd: (4, 8192, 16, 128) 3.136 -> 2.872 ms in bf16 and
# 3.13 -> 2.86 in fp16, with 64-wide value blocks (328 B of stack a thread, sm_90; 32-wide ones spill
# 56 B but took 3.080); (8, 16384, 64, 64), where only dA's round trip goes, 19.46 -> 18.16 in bf16 and
# 19.44 -> 18.14 in fp16. fp32 keeps the 64-wide key blocks and dA from the dv kernel: its spill would
# grow from 1.2 to 1.9 KB a thread.
BK_DQK = 128
WIDE_DQK_DTYPES = (torch.bfloat16, torch.float16)


def wide_dqk(K: int, dtype: torch.dtype) -> bool:
    """Whether the dq/dk kernel takes its wide form (all of K in one key block, do v^T formed there):
    K <= ``BK_DQK`` in a 16-bit dtype (``WIDE_DQK_DTYPES``)."""
    return K <= BK_DQK and dtype in WIDE_DQK_DTYPES


def _exclusive_has_scores(name: str, exclusive: bool, A):
    """The kernels form the intra-chunk scores themselves for the inclusive readout only (a scalar gate or
    none); the exclusive one (RWKV-6, ``chunk_decay``'s check) has a per-channel gate and reads them."""
    if exclusive and A is None:
        raise ValueError(f"{name}: the exclusive readout needs the per-channel gate's scores A (decay_intra)")


def output_fwd(q, k, v, gq, gc, h, A, scale: float, chunks: Chunks, exclusive: bool, A2=None,
               v2=None) -> torch.Tensor:
    """o [1, T, H, V] in v's dtype (plus lower(A2) v2 when given: the DPLR reads' term). The exclusive
    readout (RWKV-6) comes with a per-channel gate, whose scores A the kernel reads (``decay_intra.py``)."""
    _exclusive_has_scores("output_fwd", exclusive, A)
    _, T, H, K = q.shape
    V = v.shape[-1]
    gate = 0 if gc is None else (1 if gc.dim() == 3 else 2)
    BK, BV = BK_OUT, BV_OUT
    o = torch.empty_like(v)
    grid = (triton.cdiv(V, BV), chunks.NC, H)
    decay_output_fwd_kernel[grid](q, k, v, gq if gq is not None else q, gc if gc is not None else q, h,
                                  A if A is not None else q, A2 if A2 is not None else q,
                                  v2 if v2 is not None else v, o, chunks.cu_seqlens, chunks.chunk_indices, scale,
                                  H=H, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV, GATE=gate,
                                  USE_A=A is not None, USE_A2=A2 is not None, DOT_PRECISION=dot_precision(q.dtype),
                                  num_warps=OUTPUT_FWD_CONFIG[0], num_stages=OUTPUT_FWD_CONFIG[1])
    return o


def bwd_dv(q, k, v, gq, gc, A, dh, do, scale: float, chunks: Chunks, exclusive: bool, need_dA: bool):
    """dv [1, T, H, V] in v's dtype and dA = lower(do v^T) [1, T, H, BT] fp32 (None unless ``need_dA``:
    the wide form of :func:`bwd_dqk` forms its own from the do, v tiles it loads anyway)."""
    _exclusive_has_scores("bwd_dv", exclusive, A)
    _, T, H, K = q.shape
    V = v.shape[-1]
    gate = 0 if gc is None else (1 if gc.dim() == 3 else 2)
    BK, BV = BK_OUT, BV_OUT
    dv = torch.empty_like(v)
    dA = torch.empty(1, T, H, chunks.BT, dtype=torch.float32, device=q.device) if need_dA else None
    decay_bwd_dv_kernel[(chunks.NC, H)](q, k, v, gq if gq is not None else q, gc if gc is not None else q,
                                        A if A is not None else q, dh, do, dv, dA if need_dA else dv,
                                        chunks.cu_seqlens,
                                        chunks.chunk_indices, scale, H=H, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV,
                                        GATE=gate, USE_A=A is not None,
                                        DOT_PRECISION=dot_precision(q.dtype), STORE_DA=need_dA,
                                        num_warps=BWD_DV_CONFIG[0],
                                        num_stages=BWD_DV_CONFIG[1])
    return dv, dA


def _dqk_cap(K: int, dtype: torch.dtype) -> dict:
    """The dq/dk launch's register cap (``BWD_DQK_MAXNREG``), where it was timed faster."""
    return dict(maxnreg=BWD_DQK_MAXNREG) if K <= BWD_DQK_MAXNREG_MAX_K and dtype in BWD_DQK_MAXNREG_DTYPES else {}


def bwd_dqk(q, k, v, gq, gc, h, dh, do, dA, scale: float, chunks: Chunks, exclusive: bool):
    """dq, dk (inputs' dtype) and, with a scalar gate, dg [1, T, H] fp32: the gradient of each
    token's log gate (inclusive readout only). h, dh [NC, H, K, V], or both split [2, NC, H, K, V]
    (``state.state_fwd(state_dtype="split")``). dA: :func:`bwd_dv`'s, or None for the wide form
    (:func:`wide_dqk`), which forms it."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    gate = 0 if gc is None else 1
    if exclusive:
        raise ValueError("bwd_dqk: a scalar gate or none has the inclusive readout only (the exclusive one's "
                         "per-channel gate takes decay_intra.intra_bwd)")
    split = h.dim() == 5
    if split != (dh.dim() == 5):
        raise ValueError("bwd_dqk: h and dh are both split states or neither")
    form = dA is None
    if form and not wide_dqk(K, q.dtype):
        raise ValueError("bwd_dqk: dA may be None only where the wide form applies (wide_dqk)")
    BK, BV = (max(BK_OUT, min(BK_DQK, triton.next_power_of_2(K))) if form else BK_OUT), BV_OUT
    NK = triton.cdiv(K, BK)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty(NK, T, H, dtype=torch.float32, device=q.device) if gate else None
    decay_bwd_dqk_kernel[(NK, chunks.NC, H)](q, k, v, gq if gq is not None else q, gc if gc is not None else q,
                                             h[0] if split else h, h[1] if split else None,
                                             dh[0] if split else dh, dh[1] if split else None, do,
                                             dq if form else dA, dq, dk, dg if dg is not None else dq,
                                             chunks.cu_seqlens, chunks.chunk_indices, scale, T, H=H, K=K, V=V,
                                             BT=chunks.BT, BK=BK, BV=BV, GATE=gate,
                                             DOT_PRECISION=dot_precision(q.dtype),
                                             SPLIT=split, FORM_DA=form,
                                             num_warps=BWD_DQK_CONFIG[0],
                                             num_stages=BWD_DQK_CONFIG[1], **_dqk_cap(K, q.dtype))
    return dq, dk, (dg.sum(0, keepdim=True) if dg is not None else None)
