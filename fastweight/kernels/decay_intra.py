"""Intra-chunk attention of the per-channel decay family (GLA, RWKV-6, HGRN2), forward and backward.

    A[t, s] = scale * sum_c q[t, c] k[s, c] exp(gq[t, c] - gc[s, c])     s <= t (s < t: EXCLUSIVE)
    A[t, t] = scale * sum_c q[t, c] u[c] k[t, c]                          (EXCLUSIVE with RWKV-6's u)

gc is the chunk-local cumulative log decay, gq = gc (inclusive readout) or gc one token earlier
(RWKV-6). exp(gq_t - gc_s) is never split as exp(gq_t) exp(-gc_s) over a whole chunk, which
overflows for strong decays. The chunk (BT = 64) is cut into sub-chunks of BC = 16: a pair
of different sub-chunks i > j factors through the reference r = gc at the last token of
sub-chunk i - 1, exp(gq_t - r) exp(r - gc_s), both <= 1. A pair inside one sub-chunk factors
the same way through a reference m in the middle of the sub-chunk's gates (per channel, the
midpoint of their range), exp(gq_t - m) exp(m - gc_s), one tl.dot, when that sub-chunk's span
(largest gate minus smallest, over its rows and the K block's channels) is below
``SAFE_SPAN``: every factor is then within exp(+-SAFE_SPAN / 2). Otherwise the pairwise
difference is taken directly, one token of the sub-chunk at a time ([BC, BK] per step), with
every exponent <= 0. The branch is taken per (sub-chunk, K block) at run time; both paths are
exact (the factored products carry one rounding per factor, relative, as the pairwise ones).
No gate is clamped.

Backward, given dA[t, s] = do_t . v_s (s <= t) and the inter-chunk terms from the states:

    dq_t = scale exp(gq_t) (do_t h^T) + sum_s dA[t, s] dA/dq_t
    dk_s = exp(G - gc_s) (v_s dh^T)  + sum_t dA[t, s] dA/dk_s

and the per-token terms of the gate gradient (``decay.py``): with dq' = the inter-chunk part of
dq plus the pairs s < t (s < t - 1 for RWKV-6), dk' the same pairs' part of dk and dki the
inter-chunk part of dk, x = q dq' - k dk' (RWKV-6: a = q dq' apart, x = -k dk'), y = k dki and,
on the chunk's last row, x += exp(G) sum_v h dh; ``cumsum.gate_chunk_grad`` sums them
inside the chunk. The pairs left out (the diagonal; RWKV-6's t = s + 1), whose decay is exp(0),
are added to dq, dk elementwise. One program per (K block, sub-chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, SAFE_SPAN, dot_at, dot_precision, sub_chunk_rows, exp


def diag_precision(dtype: torch.dtype) -> str:
    """The factored diagonal sub-chunks' dots: exact fp32 for fp32 inputs; 3 x TF32 for fp16
    (whose 11-bit inputs one TF32 rounding of the fp32 products would match in error); one TF32
    pass for bf16, whose own rounding (8 bits) is 8 times coarser than TF32's, as the
    off-diagonal sub-chunks do (3 x TF32 cost the diagonals 3 tensor-core passes)."""
    if dtype == torch.float32:
        return "ieee"
    return "tf32x3" if dtype == torch.float16 else "tf32"


@triton.jit
def span_ref(b_gr, b_gc, m):
    """(span, ref) of a sub-chunk's gates: rows' gates b_gr, columns' b_gc ([BC, BK], valid where m).
    ref [BK] is the per-channel midpoint of their range, span the widest range over channels."""
    b_hi = tl.maximum(tl.max(tl.where(m, b_gr, float("-inf")), 0), tl.max(tl.where(m, b_gc, float("-inf")), 0))
    b_lo = tl.minimum(tl.min(tl.where(m, b_gr, float("inf")), 0), tl.min(tl.where(m, b_gc, float("inf")), 0))
    b_valid = b_hi >= b_lo
    b_hi, b_lo = tl.where(b_valid, b_hi, 0.), tl.where(b_valid, b_lo, 0.)
    return tl.max(b_hi - b_lo, 0), (b_hi + b_lo) * 0.5


@triton.jit
def factor(x, b_g, b_ref, m, ROW: tl.constexpr):
    """x * exp(g - ref) (ROW) or x * exp(ref - g), 0 where not m."""
    if ROW:
        return x * exp(tl.where(m, b_g - b_ref[None, :], float("-inf")))
    else:
        return x * exp(tl.where(m, b_ref[None, :] - b_g, float("-inf")))


@triton.jit
def decay_intra_fwd_kernel(q, k, gq, gc, u, A, cu_seqlens, chunk_indices, scale, H: tl.constexpr,
                           K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                           EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr, DOT_PRECISION: tl.constexpr,
                           DIAG_PRECISION: tl.constexpr, SPAN: tl.constexpr):
    i_tc, i_h = tl.program_id(0), tl.program_id(1)
    NC: tl.constexpr = BT // BC
    i_t, i_i, i_c, bos, T, o_i, m_i = sub_chunk_rows(i_tc, cu_seqlens, chunk_indices, BT, BC)
    if i_c * BT + i_i * BC >= T:
        return
    o_c = tl.arange(0, BC)
    # the reference row: last token of sub-chunk i - 1
    o_r = bos + i_c * BT + i_i * BC - 1
    for i_j in range(0, NC - 1):
        if i_j < i_i:
            o_j = i_c * BT + i_j * BC + o_c
            b_A = tl.zeros([BC, BC], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_ik = m_i[:, None] & m_k[None, :]
                p_i = ((bos + o_i) * H + i_h)[:, None] * K + o_k[None, :]
                p_j = ((bos + o_j) * H + i_h)[:, None] * K + o_k[None, :]
                b_gr = tl.load(gc + (o_r * H + i_h) * K + o_k, mask=m_k, other=0.)
                b_q = tl.load(q + p_i, mask=m_ik, other=0.).to(tl.float32)
                b_gq = tl.load(gq + p_i, mask=m_ik, other=0.)
                b_qg = b_q * exp(tl.where(m_ik, b_gq - b_gr[None, :], 0.))
                b_k = tl.load(k + p_j, mask=m_k[None, :], other=0.).to(tl.float32)
                b_gk = tl.load(gc + p_j, mask=m_k[None, :], other=0.)
                b_kg = b_k * exp(b_gr[None, :] - b_gk)
                b_A += dot_at(b_qg, tl.trans(b_kg), DOT_PRECISION)
            p_A = A + ((bos + o_i) * H + i_h)[:, None] * BT + (i_j * BC + o_c)[None, :]
            tl.store(p_A, b_A * scale, mask=m_i[:, None])
    # the diagonal sub-chunk: factored through the midpoint of its gates when their span allows,
    # else one column s at a time with the pairwise differences gq_t - gc_s
    b_A = tl.zeros([BC, BC], dtype=tl.float32)
    b_d = tl.zeros([BC], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        p_i = ((bos + o_i) * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + p_i, mask=m_ik, other=0.).to(tl.float32)
        b_gq = tl.load(gq + p_i, mask=m_ik, other=0.)
        b_k = tl.load(k + p_i, mask=m_ik, other=0.).to(tl.float32)
        b_g = tl.load(gc + p_i, mask=m_ik, other=0.)
        b_span, b_ref = span_ref(b_gq, b_g, m_ik)
        if b_span < SPAN:
            b_A += dot_at(factor(b_q, b_gq, b_ref, m_ik, True), tl.trans(factor(b_k, b_g, b_ref, m_ik, False)),
                          DIAG_PRECISION)
        else:
            for j in range(0, BC):  # a loop, not unrolled: the fallback keeps registers low
                m_kj = m_k & (i_c * BT + i_i * BC + j < T)
                p_j = ((bos + i_c * BT + i_i * BC + j) * H + i_h) * K + o_k
                b_kj = tl.load(k + p_j, mask=m_kj, other=0.).to(tl.float32)
                b_gj = tl.load(gc + p_j, mask=m_kj, other=0.)
                if EXCLUSIVE:
                    m_t = (o_c > j) & m_i
                else:
                    m_t = (o_c >= j) & m_i
                b_e = exp(tl.where(m_t[:, None], b_gq - b_gj[None, :], float("-inf")))
                b_a = tl.sum(b_q * b_kj[None, :] * b_e, axis=1)
                b_A += tl.where(o_c[None, :] == j, b_a[:, None], 0.)
        if USE_U:
            b_u = tl.load(u + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
            b_d += tl.sum(b_q * b_u[None, :] * b_k, axis=1)
    if EXCLUSIVE:
        b_A = tl.where(o_c[:, None] > o_c[None, :], b_A, 0.)
    else:
        b_A = tl.where(o_c[:, None] >= o_c[None, :], b_A, 0.)
    if USE_U:
        b_A += tl.where(o_c[:, None] == o_c[None, :], b_d[:, None], 0.)
    p_A = A + ((bos + o_i) * H + i_h)[:, None] * BT + (i_i * BC + o_c)[None, :]
    tl.store(p_A, b_A * scale, mask=m_i[:, None])


@triton.jit
def decay_intra_bwd_kernel(q, k, v, gq, gc, u, h, dh, do, dA, dq, dk, dgx, dga, dgy, du, cu_seqlens,
                           chunk_indices, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr, DOT_PRECISION: tl.constexpr,
                           DIAG_PRECISION: tl.constexpr, SPAN: tl.constexpr):
    i_k, i_tc, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_t, i_i, i_c, bos, T, o_i, m_i = sub_chunk_rows(i_tc, cu_seqlens, chunk_indices, BT, BC)
    if i_c * BT + i_i * BC >= T:
        return
    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ik = m_i[:, None] & m_k[None, :]
    p_i = ((bos + o_i) * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + p_i, mask=m_ik, other=0.).to(tl.float32)
    b_k = tl.load(k + p_i, mask=m_ik, other=0.).to(tl.float32)
    b_gq = tl.load(gq + p_i, mask=m_ik, other=0.)
    b_gk = tl.load(gc + p_i, mask=m_ik, other=0.)
    last = bos + tl.minimum(T, i_c * BT + BT) - 1
    b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.)
    # inter-chunk: through the state before the chunk (dq) and the state gradient after it (dki),
    # and sum_v h dh, the gradient of the state's own decay exp(G)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dki = tl.zeros([BC, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    o_h = ((i_t * H + i_h) * K + o_k[:, None]) * V
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = ((bos + o_i) * H + i_h)[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_i[:, None] & m_v[None, :], other=0.)
        b_v = tl.load(v + p_v, mask=m_i[:, None] & m_v[None, :], other=0.)
        b_h = tl.load(h + o_h + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.)
        b_dh = tl.load(dh + o_h + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.)
        b_dq += dot_at(b_do, tl.trans(b_h.to(b_do.dtype)), DOT_PRECISION)
        b_dki += dot_at(b_v, tl.trans(b_dh.to(b_v.dtype)), DOT_PRECISION)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    b_dq *= scale * exp(b_gq)
    b_dki *= exp(tl.where(m_ik, b_gl[None, :] - b_gk, 0.))
    # intra-chunk pairs (t, s), s < t (s < t - 1: EXCLUSIVE, whose pair t = s + 1 has no gate in
    # its decay and is added on its own below, as the diagonal of the inclusive readout)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    # earlier sub-chunks j < i (for dq) through the reference row before sub-chunk i
    if i_i > 0:
        o_r = bos + i_c * BT + i_i * BC - 1
        b_gr = tl.load(gc + (o_r * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_dqi = tl.zeros([BC, BK], dtype=tl.float32)
        for i_j in range(0, NC - 1):
            if i_j < i_i:
                o_j = i_c * BT + i_j * BC + o_c
                p_j = ((bos + o_j) * H + i_h)[:, None] * K + o_k[None, :]
                b_kj = tl.load(k + p_j, mask=m_k[None, :], other=0.).to(tl.float32)
                b_gkj = tl.load(gc + p_j, mask=m_k[None, :], other=0.)
                m_dA = m_i[:, None]
                if EXCLUSIVE:
                    m_dA = m_dA & ((o_c[:, None] + i_i * BC) > (o_c[None, :] + i_j * BC + 1))
                b_dA = tl.load(dA + ((bos + o_i) * H + i_h)[:, None] * BT + (i_j * BC + o_c)[None, :],
                               mask=m_dA, other=0.)
                b_dqi += dot_at(b_dA, b_kj * exp(b_gr[None, :] - b_gkj), DOT_PRECISION)
        b_dq += b_dqi * scale * exp(tl.where(m_ik, b_gq - b_gr[None, :], 0.))
    # later sub-chunks j > i (for dk) through the reference row before sub-chunk j
    for i_j in range(1, NC):
        o_j = i_c * BT + i_j * BC + o_c
        m_j = o_j < T
        o_r = bos + i_c * BT + i_j * BC - 1
        if (i_j > i_i) and (i_c * BT + i_j * BC < T):
            b_gr = tl.load(gc + (o_r * H + i_h) * K + o_k, mask=m_k, other=0.)
            m_jk = m_j[:, None] & m_k[None, :]
            p_j = ((bos + o_j) * H + i_h)[:, None] * K + o_k[None, :]
            b_qj = tl.load(q + p_j, mask=m_jk, other=0.).to(tl.float32)
            b_gqj = tl.load(gq + p_j, mask=m_jk, other=0.)
            m_dA = m_j[:, None]
            if EXCLUSIVE:
                m_dA = m_dA & ((o_c[:, None] + i_j * BC) > (o_c[None, :] + i_i * BC + 1))
            b_dA = tl.load(dA + ((bos + o_j) * H + i_h)[:, None] * BT + (i_i * BC + o_c)[None, :],
                           mask=m_dA, other=0.)
            b_qg = b_qj * exp(tl.where(m_jk, b_gqj - b_gr[None, :], 0.))
            b_dk += (dot_at(tl.trans(b_dA), b_qg, DOT_PRECISION)
                     * scale * exp(tl.where(m_ik, b_gr[None, :] - b_gk, 0.)))
    # the diagonal sub-chunk: factored through the midpoint of its gates when their span allows,
    # else one token j at a time (column j of dA for dq, row j for dk)
    b_span, b_ref = span_ref(b_gq, b_gk, m_ik)
    if b_span < SPAN:
        if EXCLUSIVE:
            m_d = (o_c[:, None] > o_c[None, :] + 1) & m_i[:, None]
        else:
            m_d = (o_c[:, None] > o_c[None, :]) & m_i[:, None]
        b_dA = tl.load(dA + ((bos + o_i) * H + i_h)[:, None] * BT + (i_i * BC + o_c)[None, :], mask=m_d,
                       other=0.) * scale
        b_fq = factor(1., b_gq, b_ref, m_ik, True)
        b_fk = factor(1., b_gk, b_ref, m_ik, False)
        b_dq += dot_at(b_dA, b_k * b_fk, DIAG_PRECISION) * b_fq
        b_dk += dot_at(tl.trans(b_dA), b_q * b_fq, DIAG_PRECISION) * b_fk
    else:
        for j in range(0, BC):  # a loop, not unrolled: the fallback keeps registers low
            r_j = i_c * BT + i_i * BC + j
            m_kj = m_k & (r_j < T)
            p_j = ((bos + r_j) * H + i_h) * K + o_k
            if EXCLUSIVE:
                m_t = (o_c > j + 1) & m_i
                m_s = (o_c + 1 < j) & m_i & (r_j < T)
            else:
                m_t = (o_c > j) & m_i
                m_s = (o_c < j) & m_i & (r_j < T)
            b_dAc = tl.load(dA + ((bos + o_i) * H + i_h) * BT + i_i * BC + j, mask=m_t, other=0.) * scale
            b_kj = tl.load(k + p_j, mask=m_kj, other=0.).to(tl.float32)
            b_gj = tl.load(gc + p_j, mask=m_kj, other=0.)
            b_dq += b_dAc[:, None] * b_kj[None, :] * exp(tl.where(m_t[:, None], b_gq - b_gj[None, :],
                                                                     float("-inf")))
            b_dAr = tl.load(dA + ((bos + r_j) * H + i_h) * BT + i_i * BC + o_c, mask=m_s, other=0.) * scale
            b_qj = tl.load(q + p_j, mask=m_kj, other=0.).to(tl.float32)
            b_gqj = tl.load(gq + p_j, mask=m_kj, other=0.)
            b_dk += b_dAr[:, None] * b_qj[None, :] * exp(tl.where(m_s[:, None], b_gqj[None, :] - b_gk,
                                                                     float("-inf")))
    # the gate gradient's per-token terms (decay.py): x = q dq' - k dk' (EXCLUSIVE: -k dk', with
    # a = q dq' apart, summed over t > u), y = k dki; exp(G) sum_v h dh on the chunk's last row
    b_x = tl.where((bos + o_i == last)[:, None], (exp(b_gl) * b_hdh)[None, :], 0.) - b_k * b_dk
    p_g = ((bos + o_i) * H + i_h)[:, None] * K + o_k[None, :]
    if EXCLUSIVE:
        tl.store(dga + p_g, b_q * b_dq, mask=m_ik)
    else:
        b_x += b_q * b_dq
    tl.store(dgx + p_g, b_x, mask=m_ik)
    tl.store(dgy + p_g, b_k * b_dki, mask=m_ik)
    # the pairs left out above, whose decay is exp(0) = 1: (t, t) inclusive, (t, t - 1) EXCLUSIVE
    o_a = i_i * BC + o_c
    if EXCLUSIVE:
        m_p = m_i & (o_a > 0)
        m_pk = m_p[:, None] & m_k[None, :]
        b_dp = tl.load(dA + ((bos + o_i) * H + i_h) * BT + o_a - 1, mask=m_p, other=0.) * scale
        b_kp = tl.load(k + p_i - H * K, mask=m_pk, other=0.).to(tl.float32)
        b_dq += b_dp[:, None] * b_kp
        m_n = m_i & (o_a < BT - 1) & (o_i + 1 < T)
        m_nk = m_n[:, None] & m_k[None, :]
        b_dn = tl.load(dA + ((bos + o_i + 1) * H + i_h) * BT + o_a, mask=m_n, other=0.) * scale
        b_qn = tl.load(q + p_i + H * K, mask=m_nk, other=0.).to(tl.float32)
        b_dk += b_dn[:, None] * b_qn
    else:
        b_dd = tl.load(dA + ((bos + o_i) * H + i_h) * BT + o_a, mask=m_i, other=0.) * scale
        b_dq += b_dd[:, None] * b_k
        b_dk += b_dd[:, None] * b_q
    b_dk += b_dki
    if USE_U:
        b_dd = tl.load(dA + ((bos + o_i) * H + i_h) * BT + o_a, mask=m_i, other=0.) * scale
        b_u = tl.load(u + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_dq += b_dd[:, None] * b_u[None, :] * b_k
        b_dk += b_dd[:, None] * b_u[None, :] * b_q
        tl.store(du + p_g, b_dd[:, None] * b_q * b_k, mask=m_ik)
    tl.store(dq + p_i, b_dq.to(dq.dtype.element_ty), mask=m_ik)
    tl.store(dk + p_i, b_dk.to(dk.dtype.element_ty), mask=m_ik)


def diagonal_spans(g: torch.Tensor, exclusive: bool, BK: int, BT: int = 64, BC: int = 16) -> torch.Tensor:
    """The span each diagonal sub-chunk's branch compares with ``SAFE_SPAN``, for one sequence of
    log gates g [T, H, K] (inclusive readout, or ``exclusive``: rows read one token earlier, as
    RWKV-6 and the DPLR a-rows). Returns [NT, BT // BC, H, cdiv(K, BK)] float64 (tests, benchmarks)."""
    T, H, K = g.shape
    NT, NK = triton.cdiv(T, BT), triton.cdiv(K, BK)
    x = torch.zeros(NT * BT, H, NK * BK, dtype=torch.float64, device=g.device)
    x[:T, :, :K] = g
    valid = torch.zeros(x.shape, dtype=torch.bool, device=g.device)
    valid[:T, :, :K] = True
    gc = x.view(NT, BT, H, -1).cumsum(1).view(x.shape)
    gr = gc - x if exclusive else gc

    def sub(y):
        return y.view(NT, BT // BC, BC, H, NK, BK)

    inf = float("inf")
    hi = torch.maximum(sub(gr.masked_fill(~valid, -inf)).amax(2), sub(gc.masked_fill(~valid, -inf)).amax(2))
    lo = torch.minimum(sub(gr.masked_fill(~valid, inf)).amin(2), sub(gc.masked_fill(~valid, inf)).amin(2))
    return torch.where(hi >= lo, hi - lo, 0.).amax(-1)


def intra_fwd(q, k, gq, gc, u, scale: float, chunks: Chunks, exclusive: bool, *,
              span: float = SAFE_SPAN) -> torch.Tensor:
    """A [1, T, H, BT] fp32 (row t holds A[t, chunk(t)]); only s <= t is written. A diagonal
    sub-chunk whose gates span less than ``span`` is factored (0: every one token at a time;
    1e30: every one factored)."""
    _, T, H, K = q.shape
    BT, BC = chunks.BT, 16
    BK = min(32, triton.next_power_of_2(K))
    A = torch.empty(1, T, H, BT, dtype=torch.float32, device=q.device)
    grid = (chunks.NC * (BT // BC), H)
    decay_intra_fwd_kernel[grid](q, k, gq, gc, u if u is not None else q, A, chunks.cu_seqlens,
                                 chunks.chunk_indices, scale, H=H, K=K, BT=BT, BC=BC, BK=BK, EXCLUSIVE=exclusive,
                                 USE_U=u is not None, DOT_PRECISION=dot_precision(q.dtype),
                                 DIAG_PRECISION=diag_precision(q.dtype), SPAN=span,
                                 num_stages=1)  # 1 stage: 0.27 ms off GLA's 37.7 fwd+bwd against 3 (H200 sweep)
    return A


def intra_bwd(q, k, v, gq, gc, u, h, dh, do, dA, scale: float, chunks: Chunks, exclusive: bool, *,
              span: float = SAFE_SPAN):
    """dq, dk (inputs' dtype), the gate gradient's per-token terms (fp32, [1, T, H, K]; reduced to
    dg by ``cumsum.gate_chunk_grad``): dgx (summed over t >= u), dga (EXCLUSIVE: over t > u;
    else None), dgy (over t < u); du per token (USE_U). ``span`` as in ``intra_fwd``."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    BT, BC = chunks.BT, 16
    BK = min(32, triton.next_power_of_2(K))
    BV = min(64, triton.next_power_of_2(V))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dgx = torch.empty(1, T, H, K, dtype=torch.float32, device=q.device)
    dgy = torch.empty_like(dgx)
    dga = torch.empty_like(dgx) if exclusive else None
    du = torch.empty_like(dgx) if u is not None else None
    grid = (triton.cdiv(K, BK), chunks.NC * (BT // BC), H)
    decay_intra_bwd_kernel[grid](q, k, v, gq, gc, u if u is not None else q, h, dh, do, dA, dq, dk, dgx,
                                 dga if dga is not None else dgx, dgy, du if du is not None else dgx,
                                 chunks.cu_seqlens, chunks.chunk_indices, scale, H=H, K=K, V=V, BT=BT, BC=BC,
                                 BK=BK, BV=BV, EXCLUSIVE=exclusive, USE_U=u is not None,
                                 DOT_PRECISION=dot_precision(q.dtype), DIAG_PRECISION=diag_precision(q.dtype),
                                 SPAN=span)
    return dq, dk, dgx, dga, dgy, du
