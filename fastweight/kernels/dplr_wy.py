"""The WY stage of the generic DPLR chunk algorithm and the per-chunk backward that mirrors it.

fla's names: ``a`` is read against the state, ``b`` is the write direction. Per chunk (G the
chunk-local cumulative log decay, G^- = G one token earlier, all decays <= 1; the intra-chunk
matrices from ``decay_intra.py``):

    A_ab = strictLower(a b^T * exp(G^-_t - G_s))    A_ak = strictLower(a k^T * exp(G^-_t - G_s))
    T    = (I - A_ab)^{-1}                          (``kkt_solve.solve``, blockwise exact)
    W    = T (a * exp(G^-))     U~ = T A_ak V       (this file, forward)

Backward, per chunk, given the state S = h[c], its gradient after the chunk dS' = dh[c], the
reads U = W S + U~ and their gradient dU (``state.py``):

    dX = T^T dU,   dA~ = T^T (dU S^T)                       (the transposed solves)
    dV = A_qk^T dO + A_ak^T dX + (k * exp(G_e - G)) dS'
    dA_qk = dO V^T,  dA_qb = dO U^T,  dA_ak = dX V^T,  dA_ab = dA~ W^T + dX U~^T   (masked; dX U~^T = dA_ak A_ak^T T^T
                                                  where U~ is not kept)
    da (via W) = dA~ * exp(G^-),  dq (via S) = scale (dO S^T) * exp(G),
    db, dk (via S') = (U dS'^T, V dS'^T) * exp(G_e - G)

``local_grads`` is the backward's first half (``dplr_bwd.py`` runs it, then the intra-chunk
matrices' gradients to q, k, a, b of ``dplr_intra.py``, in one program per chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, dot_at, dot_precision, exp
from fastweight.kernels.decay_intra import diag_precision
from fastweight.kernels.kkt_solve import merge_precision, solved_blocks, store_lower_blocks


@triton.jit
def dplr_wy_fwd_kernel(ag, v, Ai, Aak, w, ut, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, UT_PRECISION: tl.constexpr):
    """W = T (a exp(G^-)) and U~ = T (A_ak V) of a chunk, ag = a exp(G^-) from the intra kernel.
    UT_PRECISION (3 x TF32 for fp16) serves U~'s two fp32 x fp32 dots: the H200's TF32 truncates
    their operands, a bias the backward's exact dh dots (``local_grads``) no longer cancel (db up
    to 11.8x the fp16 floor under ``testing.emulate_tf32``; the all-exact figure with these two
    exact)."""
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_n, i_c = tl.load(chunk_indices + i_t * 2).to(tl.int64), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_all = m_t[:, None] & m_t[None, :]
    p_A = ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
    b_T = tl.load(Ai + p_A, mask=m_all & (o_t[:, None] >= o_t[None, :]), other=0.).to(tl.float32)
    b_Aak = tl.load(Aak + p_A, mask=m_all & (o_t[:, None] > o_t[None, :]), other=0.).to(tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_k = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
        b_w = dot_at(b_T, tl.load(ag + p_k, mask=m_tk, other=0.).to(tl.float32), DOT_PRECISION)
        tl.store(w + p_k, b_w.to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)
        b_y = dot_at(b_Aak, b_v, UT_PRECISION)
        b_ut = dot_at(b_T, b_y, UT_PRECISION)
        tl.store(ut + p_v, b_ut.to(ut.dtype.element_ty), mask=m_tv)


@triton.jit
def _rows16(x, T, r0, c0, HD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Rows r0 .. r0 + 15, columns c0 .. c0 + BD - 1 of a head's [T, D] slice (rows HD apart), in fp32."""
    p = tl.make_block_ptr(x, (T, D), (HD, 1), (r0, c0), (16, BD), (1, 0))
    return tl.load(p, boundary_check=(0, 1)).to(tl.float32)


@triton.jit
def _store16(x, b_x, T, r0, c0, HD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    p = tl.make_block_ptr(x, (T, D), (HD, 1), (r0, c0), (16, BD), (1, 0))
    tl.store(p, b_x.to(p.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _tri16(A, T, r0, c0, H: tl.constexpr, BT: tl.constexpr, STRICT: tl.constexpr):
    """A [16, 16] block of a per-chunk [T, BT] matrix in fp32 (STRICT: its part below the diagonal)."""
    b_A = _rows16(A, T, r0, c0, H * BT, BT, 16)
    if STRICT:
        o_i = tl.arange(0, 16)
        b_A = tl.where(o_i[:, None] > o_i[None, :], b_A, 0.)
    return b_A


@triton.jit
def _lower_times_rows(x, y, T, t0, c0, SD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, P: tl.constexpr, b_L11,
                      b_L21, b_L22, b_L31, b_L32, b_L33, b_L41, b_L42, b_L43, b_L44):
    """y = L x on a chunk's columns c0 .. c0 + BD - 1, L block lower triangular (its ten [16, 16] blocks),
    16 rows at a time: y_r = sum_{c <= r} L_rc x_c (rows SD apart; dots at precision P)."""
    b_x1 = _rows16(x, T, t0, c0, SD, D, BD)
    _store16(y, dot_at(b_L11, b_x1, P), T, t0, c0, SD, D, BD)
    b_x2 = _rows16(x, T, t0 + 16, c0, SD, D, BD)
    _store16(y, dot_at(b_L21, b_x1, P) + dot_at(b_L22, b_x2, P), T, t0 + 16, c0, SD, D, BD)
    b_x3 = _rows16(x, T, t0 + 32, c0, SD, D, BD)
    _store16(y, dot_at(b_L31, b_x1, P) + dot_at(b_L32, b_x2, P) + dot_at(b_L33, b_x3, P), T, t0 + 32, c0, SD, D, BD)
    b_x4 = _rows16(x, T, t0 + 48, c0, SD, D, BD)
    _store16(y, dot_at(b_L41, b_x1, P) + dot_at(b_L42, b_x2, P) + dot_at(b_L43, b_x3, P) + dot_at(b_L44, b_x4, P),
             T, t0 + 48, c0, SD, D, BD)


@triton.jit
def dplr_solve_wy_kernel(Aab, ag, v, Aak, Ai, w, ut, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         MERGE_PRECISION: tl.constexpr, DOT_PRECISION: tl.constexpr, UT_PRECISION: tl.constexpr,
                         STORE_T: tl.constexpr, ROUND_T: tl.constexpr):
    """The solve and the WY stage of one chunk in one program: T = (I - A_ab)^{-1} as ten [16, 16]
    blocks in registers (``kkt_solve.solved_blocks``), then W = T ag and U~ = (T A_ak) V by 16-row
    blocks, W_r = sum_{c <= r} T_rc ag_c, M_rc = sum_{c <= m <= r} T_rm A_ak,mc, U~_r = sum_{c <= r} M_rc V_c
    (the product T (A_ak V) regrouped, so that no [64, V] intermediate is held). STORE_T: T is stored
    for a backward; ROUND_T: W and U~ multiply T rounded as stored (w's dtype), as a separate
    WY stage reading it would."""
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_n, i_c = tl.load(chunk_indices + i_t * 2).to(tl.int64), tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    # block pointers take 32-bit offsets
    T = (eos - bos).to(tl.int32)
    t0 = (i_c * BT).to(tl.int32)
    Aab += (bos * H + i_h) * BT
    Aak += (bos * H + i_h) * BT
    ag += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    v += (bos * H + i_h) * V
    ut += (bos * H + i_h) * V
    # (I - A_ab)^{-1}: the solve's A is -A_ab
    b_T11, b_T21, b_T22, b_T31, b_T32, b_T33, b_T41, b_T42, b_T43, b_T44 = solved_blocks(
        -_tri16(Aab, T, t0, 0, H, BT, True),
        -_tri16(Aab, T, t0 + 16, 0, H, BT, False), -_tri16(Aab, T, t0 + 16, 16, H, BT, True),
        -_tri16(Aab, T, t0 + 32, 0, H, BT, False), -_tri16(Aab, T, t0 + 32, 16, H, BT, False),
        -_tri16(Aab, T, t0 + 32, 32, H, BT, True),
        -_tri16(Aab, T, t0 + 48, 0, H, BT, False), -_tri16(Aab, T, t0 + 48, 16, H, BT, False),
        -_tri16(Aab, T, t0 + 48, 32, H, BT, False), -_tri16(Aab, T, t0 + 48, 48, H, BT, True), MERGE_PRECISION)
    if STORE_T:
        store_lower_blocks(Ai + (bos * H + i_h) * BT, T, t0, H, BT, b_T11, b_T21, b_T22, b_T31, b_T32, b_T33, b_T41,
                           b_T42, b_T43, b_T44)
    if ROUND_T:
        dt = w.dtype.element_ty
        b_T11, b_T21, b_T22 = b_T11.to(dt).to(tl.float32), b_T21.to(dt).to(tl.float32), b_T22.to(dt).to(tl.float32)
        b_T31, b_T32, b_T33 = b_T31.to(dt).to(tl.float32), b_T32.to(dt).to(tl.float32), b_T33.to(dt).to(tl.float32)
        b_T41, b_T42 = b_T41.to(dt).to(tl.float32), b_T42.to(dt).to(tl.float32)
        b_T43, b_T44 = b_T43.to(dt).to(tl.float32), b_T44.to(dt).to(tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        _lower_times_rows(ag, w, T, t0, i_k * BK, H * K, K, BK, DOT_PRECISION, b_T11, b_T21, b_T22, b_T31, b_T32,
                          b_T33, b_T41, b_T42, b_T43, b_T44)
    # M = T A_ak by block columns (A_ak strictly lower: its diagonal blocks strict)
    b_K = _tri16(Aak, T, t0, 0, H, BT, True)
    b_M11 = dot_at(b_T11, b_K, UT_PRECISION)
    b_M21 = dot_at(b_T21, b_K, UT_PRECISION)
    b_M31 = dot_at(b_T31, b_K, UT_PRECISION)
    b_M41 = dot_at(b_T41, b_K, UT_PRECISION)
    b_K = _tri16(Aak, T, t0 + 16, 0, H, BT, False)
    b_M21 += dot_at(b_T22, b_K, UT_PRECISION)
    b_M31 += dot_at(b_T32, b_K, UT_PRECISION)
    b_M41 += dot_at(b_T42, b_K, UT_PRECISION)
    b_K = _tri16(Aak, T, t0 + 32, 0, H, BT, False)
    b_M31 += dot_at(b_T33, b_K, UT_PRECISION)
    b_M41 += dot_at(b_T43, b_K, UT_PRECISION)
    b_M41 += dot_at(b_T44, _tri16(Aak, T, t0 + 48, 0, H, BT, False), UT_PRECISION)
    b_K = _tri16(Aak, T, t0 + 16, 16, H, BT, True)
    b_M22 = dot_at(b_T22, b_K, UT_PRECISION)
    b_M32 = dot_at(b_T32, b_K, UT_PRECISION)
    b_M42 = dot_at(b_T42, b_K, UT_PRECISION)
    b_K = _tri16(Aak, T, t0 + 32, 16, H, BT, False)
    b_M32 += dot_at(b_T33, b_K, UT_PRECISION)
    b_M42 += dot_at(b_T43, b_K, UT_PRECISION)
    b_M42 += dot_at(b_T44, _tri16(Aak, T, t0 + 48, 16, H, BT, False), UT_PRECISION)
    b_K = _tri16(Aak, T, t0 + 32, 32, H, BT, True)
    b_M33 = dot_at(b_T33, b_K, UT_PRECISION)
    b_M43 = dot_at(b_T43, b_K, UT_PRECISION)
    b_M43 += dot_at(b_T44, _tri16(Aak, T, t0 + 48, 32, H, BT, False), UT_PRECISION)
    b_M44 = dot_at(b_T44, _tri16(Aak, T, t0 + 48, 48, H, BT, True), UT_PRECISION)
    for i_v in range(0, tl.cdiv(V, BV)):
        _lower_times_rows(v, ut, T, t0, i_v * BV, H * V, V, BV, UT_PRECISION, b_M11, b_M21, b_M22, b_M31, b_M32,
                          b_M33, b_M41, b_M42, b_M43, b_M44)


@triton.jit
def local_grads(q, k, v, gc, gk, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, dv, dq, dk, da, db, pairs, dAqk, dAqb, dAak,
                dAab, i_t, i_c, bos, T, i_h, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PRECISION: tl.constexpr,
                GRAD_PRECISION: tl.constexpr, UT_KEPT: tl.constexpr, EARLY: tl.constexpr):
    """Chunk i_t (i_c in its sequence): stores dv and the state parts of dq, dk, da, db (fp32) and
    returns the four matrices' gradients (dA_qk, dA_qb, dA_ak, dA_ab, [BT, BT] fp32, masked) without
    their gate-free pairs: the diagonal of dA_qk, dA_qb (decay exp(G_t - G_t) = 1) and the first
    subdiagonal of dA_ak, dA_ab (exp(G^-_t - G_{t-1}) = 1). Those go to ``pairs`` [1, T, H, 4] fp32,
    row t holding dA_qk[t, t], dA_qb[t, t], dA_ak[t, t-1], dA_ab[t, t-1] (0 at the chunk's first row):
    their terms in the gate gradient cancel exactly, so they are added to dq, dk, da, db only
    (``dplr_intra.bwd_finish``). EARLY (the split backward's first launch, ``DplrLaunch.bwd_early``):
    dA_qk and dA_qb (from dO, V and U alone) are formed, stored (the chunk's rows of the [T, H, BT]
    buffers dAqk, ...) and dropped before the rest, so that at most two accumulators are live at
    once, and dA_ak, dA_ab are stored at the end (the caller stores all four otherwise).
    GRAD_PRECISION serves the three dots with the state pass's fp32 dh (into dv, db, dk): the H200's
    TF32 truncates it (a bias of up to 2^-10 that does not average out where a gradient is a few
    terms, as under strong decay), so fp16 takes 3 x TF32 there (``decay_intra.diag_precision``);
    the dU dots keep DOT_PRECISION (their error stays within ~3x the fp16 floor)."""
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_all = m_t[:, None] & m_t[None, :]
    m_incl = m_all & (o_t[:, None] >= o_t[None, :])
    m_strict = m_all & (o_t[:, None] > o_t[None, :])
    last = bos + tl.minimum(T, i_c * BT + BT) - 1
    p_A = ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
    if EARLY:
        # dA_qk = dO V^T, dA_qb = dO U^T first, stored and dropped
        o_r = tl.arange(0, BT)
        m_diag = o_r[:, None] == o_r[None, :]
        m_sub = o_r[:, None] == o_r[None, :] + 1
        m_far = m_strict & (o_r[:, None] > o_r[None, :] + 1)
        p_p = ((bos + o_t) * H + i_h) * 4
        b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
        b_dAqb = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
            b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_dAqk += dot_at(b_do, tl.trans(tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)), DOT_PRECISION)
            b_dAqb += dot_at(b_do, tl.trans(tl.load(u + p_v, mask=m_tv, other=0.).to(tl.float32)), DOT_PRECISION)
        tl.store(pairs + p_p, tl.sum(tl.where(m_diag, b_dAqk, 0.), 1), mask=m_t)
        tl.store(pairs + p_p + 1, tl.sum(tl.where(m_diag, b_dAqb, 0.), 1), mask=m_t)
        b_dAqk = tl.where(m_strict, b_dAqk, 0.)
        b_dAqb = tl.where(m_strict, b_dAqb, 0.)
        tl.store(dAqk + p_A, b_dAqk, mask=m_t[:, None])
        tl.store(dAqb + p_A, b_dAqb, mask=m_t[:, None])
    # held through the rest: loading them where used is slower on the H200
    # (`python -m fastweight.bench.gpu_decay_dplr variants`)
    b_T = tl.load(Ai + p_A, mask=m_incl, other=0.).to(tl.float32)
    b_Aqk = tl.load(Aqk + p_A, mask=m_incl, other=0.).to(tl.float32)
    b_Aak = tl.load(Aak + p_A, mask=m_strict, other=0.).to(tl.float32)
    if not EARLY:
        b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
        b_dAqb = tl.zeros([BT, BT], dtype=tl.float32)
    b_dAak = tl.zeros([BT, BT], dtype=tl.float32)
    b_dAab = tl.zeros([BT, BT], dtype=tl.float32)
    o_h = (i_t * H + i_h) * K * V
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
        b_du = tl.load(du + p_v, mask=m_tv, other=0.).to(tl.float32)
        b_dx = dot_at(tl.trans(b_T), b_du, DOT_PRECISION)
        b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(tl.float32)
        b_dv = dot_at(tl.trans(b_Aqk), b_do, DOT_PRECISION)
        b_dv += dot_at(tl.trans(b_Aak), b_dx, DOT_PRECISION)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            p_k = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
            b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.)
            b_e = exp(tl.where(m_tk, b_gl[None, :] - tl.load(gc + p_k, mask=m_tk, other=0.), float("-inf")))
            b_kd = tl.load(k + p_k, mask=m_tk, other=0.).to(tl.float32) * b_e
            b_dh = tl.load(dh + o_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                           other=0.).to(tl.float32)
            b_dv += dot_at(b_kd, b_dh, GRAD_PRECISION)
        tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_tv)
        b_v = tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)
        if not EARLY:
            b_u = tl.load(u + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_dAqk += dot_at(b_do, tl.trans(b_v), DOT_PRECISION)
            b_dAqb += dot_at(b_do, tl.trans(b_u), DOT_PRECISION)
        b_dAak += dot_at(b_dx, tl.trans(b_v), DOT_PRECISION)
        if UT_KEPT:
            b_ut = tl.load(ut + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_dAab += dot_at(b_dx, tl.trans(b_ut), DOT_PRECISION)
    if not UT_KEPT:
        # dX U~^T = (dX V^T) A_ak^T T^T, U~ not kept from the forward; its two dots take the
        # forward's precision for U~ (3 x TF32 in fp16)
        b_y = dot_at(b_dAak, tl.trans(b_Aak), GRAD_PRECISION)
        b_dAab += dot_at(b_y, tl.trans(b_T), GRAD_PRECISION)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_k = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_dqi = tl.zeros([BT, BK], dtype=tl.float32)
        b_dbi = tl.zeros([BT, BK], dtype=tl.float32)
        b_dki = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
            p_h = o_h + o_k[:, None] * V + o_v[None, :]
            b_h = tl.load(h + p_h, mask=m_k[:, None] & m_v[None, :], other=0.).to(tl.float32)
            b_dh = tl.load(dh + p_h, mask=m_k[:, None] & m_v[None, :], other=0.).to(tl.float32)
            b_du = tl.load(du + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_do = tl.load(do + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_u = tl.load(u + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_v = tl.load(v + p_v, mask=m_tv, other=0.).to(tl.float32)
            b_dw += dot_at(b_du, tl.trans(b_h), DOT_PRECISION)
            b_dqi += dot_at(b_do, tl.trans(b_h), DOT_PRECISION)
            b_dbi += dot_at(b_u, tl.trans(b_dh), GRAD_PRECISION)
            b_dki += dot_at(b_v, tl.trans(b_dh), GRAD_PRECISION)
        b_da = dot_at(tl.trans(b_T), b_dw, DOT_PRECISION)
        b_w = tl.load(w + p_k, mask=m_tk, other=0.).to(tl.float32)
        b_dAab += dot_at(b_da, tl.trans(b_w), DOT_PRECISION)
        b_g = tl.load(gc + p_k, mask=m_tk, other=0.)
        b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_e = exp(tl.where(m_tk, b_gl[None, :] - b_g, float("-inf")))
        b_gp = b_g - tl.load(gk + p_k, mask=m_tk, other=0.).to(tl.float32)
        tl.store(da + p_k, b_da * exp(b_gp), mask=m_tk)
        tl.store(dq + p_k, b_dqi * scale * exp(b_g), mask=m_tk)
        tl.store(db + p_k, b_dbi * b_e, mask=m_tk)
        tl.store(dk + p_k, b_dki * b_e, mask=m_tk)
    if EARLY:
        tl.store(pairs + p_p + 2, tl.sum(tl.where(m_sub, b_dAak, 0.), 1), mask=m_t)
        tl.store(pairs + p_p + 3, tl.sum(tl.where(m_sub, b_dAab, 0.), 1), mask=m_t)
        b_dAak = tl.where(m_far, b_dAak, 0.)
        b_dAab = tl.where(m_far, b_dAab, 0.)
        tl.store(dAak + p_A, b_dAak, mask=m_t[:, None])
        tl.store(dAab + p_A, b_dAab, mask=m_t[:, None])
    else:
        o_r = tl.arange(0, BT)
        m_diag = o_r[:, None] == o_r[None, :]
        m_sub = o_r[:, None] == o_r[None, :] + 1
        p_p = ((bos + o_t) * H + i_h) * 4
        tl.store(pairs + p_p, tl.sum(tl.where(m_diag, b_dAqk, 0.), 1), mask=m_t)
        tl.store(pairs + p_p + 1, tl.sum(tl.where(m_diag, b_dAqb, 0.), 1), mask=m_t)
        tl.store(pairs + p_p + 2, tl.sum(tl.where(m_sub, b_dAak, 0.), 1), mask=m_t)
        tl.store(pairs + p_p + 3, tl.sum(tl.where(m_sub, b_dAab, 0.), 1), mask=m_t)
        m_far = m_strict & (o_r[:, None] > o_r[None, :] + 1)
        b_dAqk, b_dAqb = tl.where(m_strict, b_dAqk, 0.), tl.where(m_strict, b_dAqb, 0.)
        b_dAak, b_dAab = tl.where(m_far, b_dAak, 0.), tl.where(m_far, b_dAab, 0.)
    return b_dAqk, b_dAqb, b_dAak, b_dAab


def _blocks(K, V):
    return min(64, max(16, triton.next_power_of_2(K))), min(64, max(16, triton.next_power_of_2(V)))


def dplr_wy_fwd(ag, v, Ai, Aak, chunks: Chunks, dtype: torch.dtype):
    """W = T ag [1, T, H, K] (ag = a * exp(G^-), ``dplr_intra.dplr_intra_fwd``'s) and U~ = T A_ak V [1, T,
    H, V], both in ``dtype`` (the inputs')."""
    _, T, H, K = ag.shape
    V = v.shape[-1]
    BK, BV = _blocks(K, V)
    w = torch.empty(1, T, H, K, dtype=dtype, device=ag.device)
    ut = torch.empty(1, T, H, V, dtype=dtype, device=ag.device)
    # 4 warps: 0.16 ms faster than 8 (H200 sweep)
    dplr_wy_fwd_kernel[(chunks.NC, H)](ag, v, Ai, Aak, w, ut, chunks.cu_seqlens, chunks.chunk_indices, H=H,
                                       K=K, V=V, BT=chunks.BT, BK=BK, BV=BV, DOT_PRECISION=dot_precision(dtype),
                                       UT_PRECISION=diag_precision(dtype), num_warps=4, num_stages=1)
    return w, ut


# one warp: the substitution's row reductions stay inside it (the solve's SOLVE_WARPS);
# (num_warps, BK, BV): one warp and 32-wide blocks hold T's blocks and the row tiles without spilling
# (sm_90 bf16: 228-254 registers, no stack, at K = 64 and 128; 64-wide blocks spill 104-512 B)
SOLVE_WY_CONFIG = (1, 32, 32)


def dplr_solve_wy(Aab, ag, v, Aak, chunks: Chunks, dtype: torch.dtype, t_dtype: torch.dtype | None,
                  config: tuple[int, int, int] | None = None):
    """T = (I - A_ab)^{-1}, W = T ag and U~ = T A_ak V in one kernel (``dplr_solve_wy_kernel``): the
    solve and ``dplr_wy_fwd`` with T kept on chip between them. Aab [1, T, H, BT] fp32, Aak [1, T, H,
    BT], ag [1, T, H, K], v [1, T, H, V]; ``config`` (num_warps, BK, BV), default ``SOLVE_WY_CONFIG``. Returns (T in ``t_dtype``, or None where ``t_dtype`` is None
    and no backward needs it; W, U~ in ``dtype``)."""
    _, T, H, K = ag.shape
    V = v.shape[-1]
    num_warps, BK, BV = config or SOLVE_WY_CONFIG
    BK, BV = min(BK, _blocks(K, V)[0]), min(BV, _blocks(K, V)[1])
    w = torch.empty(1, T, H, K, dtype=dtype, device=ag.device)
    ut = torch.empty(1, T, H, V, dtype=dtype, device=ag.device)
    Ai = torch.empty(1, T, H, chunks.BT, dtype=t_dtype, device=ag.device) if t_dtype is not None else None
    # T rounded as the backward reads it; without a stored T, as a 16-bit T would be (the inputs' dtype)
    round_t = (t_dtype if t_dtype is not None else dtype) != torch.float32
    dplr_solve_wy_kernel[(chunks.NC, H)](Aab, ag, v, Aak, Ai if Ai is not None else w, w, ut, chunks.cu_seqlens,
                                         chunks.chunk_indices, H=H, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV,
                                         MERGE_PRECISION=merge_precision(dtype), DOT_PRECISION=dot_precision(dtype),
                                         UT_PRECISION=diag_precision(dtype), STORE_T=Ai is not None,
                                         ROUND_T=round_t, num_warps=num_warps)
    return Ai, w, ut
