"""The generic DPLR chunk's four intra-chunk matrices, forward and backward.

fla's names (``a`` read, ``b`` write). With G the chunk-local cumulative log decay and G^- the
same one token earlier, the forward forms, in one pass over q, a (rows) and k, b (columns),

    A_qk = lower(scale q k^T * exp(G_t - G_s))      A_qb = lower(scale q b^T * exp(G_t - G_s))
    A_ak = strictLower(a k^T * exp(G^-_t - G_s))    A_ab = strictLower(a b^T * exp(G^-_t - G_s))

Given their gradients (``dplr_wy.local_grads``), the row side gets dq_t = sum_s dA_qk[t, s]
dA_qk/dq_t + (same with dA_qb), da_t likewise from dA_ak, dA_ab, and the column side dk_s, db_s
from the transposes (the backward's kernel is ``dplr_bwd.py``; its pieces are here).

exp(G_t - G_s) is never split as exp(G_t) exp(-G_s) over the sequence. One program per chunk:
when the chunk's gates span less than ``common.SAFE_SPAN`` (largest minus smallest over
its rows' G^-, G and every channel; every RWKV-7 chunk, 64 x 0.607 = 38.8), each decay factors
through the per-channel midpoint m of the chunk's gates, exp(G_t - m) exp(m - G_s), every factor
within exp(+-SAFE_SPAN / 2): four [BT, BT] dots per K block. A wider chunk goes sub-chunk by
sub-chunk (16 tokens), as ``decay_intra.py``: pairs of different sub-chunks through a reference
row (both factors <= 1), a diagonal sub-chunk through the midpoint of its own gates when they
span less than SAFE_SPAN, else pairwise, one token at a time. Both branches are taken at run
time; no gate is clamped.

The gate gradient: q and a read exp(G_t) and exp(G^-_t), k and b exp(-G_s); the per-token terms
``bwd_finish`` stores and their chunk-local sums are in ``dplr_bwd.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels import decay_intra
from fastweight.kernels.common import Chunks, SAFE_SPAN, alloc, chunk_bounds, dot_at, dot_precision, exp
from fastweight.kernels.decay_intra import diag_precision, factor, span_ref


def fwd_launch_config(K: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, tuple[int, int]]:
    """(BK, (num_warps, num_stages)) of dplr_intra_fwd_kernel at key size K: K blocks of 32 (16 at
    K <= 16), all of K = 64 in one block for bf16 inputs; 4 warps, 2 stages; one program per (chunk,
    head) for both the q and the a rows. On the H200 (bf16): at K = 64 one block of 64 beats two of 32
    (8.14 against 9.88 ms at (8, 16384, 64, 64)); at K = 128 blocks of 32 were the fastest timed; 4
    warps beat 8; one program per chunk beat two, and one pass over K for the four matrices beat a
    pass per row side (docs/bench/decay_dplr.md). fp16 and fp32 keep 32: their 3xTF32 / FMA dots
    spill more at 64 (sm_90 compile: fp32 6 KB -> 23 KB a thread; fp16 not timed)."""
    if dtype == torch.bfloat16 and K == 64:
        return 64, (4, 2)
    return min(32, max(16, triton.next_power_of_2(K))), (4, 2)


def ag_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the intra kernel stores a exp(G^-) in for the WY stage: bf16 for bf16 inputs (fla's
    choice: the WY dot truncates its fp32 operand to TF32's 10 bits anyway, and this saves the WY
    stage reading a, gc and gk: 640 -> 128 bytes a token-head at K = 64), fp32
    otherwise (fp16 would flush the decayed rows of strongly gated chunks, below 6e-8, to zero)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


@triton.jit
def load_rows(x, bos, o, m, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    return tl.load(x + ((bos + o) * H + i_h)[:, None] * K + o_k[None, :], mask=m[:, None] & m_k[None, :],
                   other=0.).to(tl.float32)


@triton.jit
def load_gp(gc, gk, bos, o, m, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr):
    """G^- = G - g, the gate sum one token earlier, formed from G and the raw log gate as every
    gate-sum pass forms it (bit for bit): no [T, H, K] fp32 buffer of its own (2 GiB at B 8, T
    16384, H 64, K 64)."""
    return load_rows(gc, bos, o, m, i_h, o_k, m_k, H, K) - load_rows(gk, bos, o, m, i_h, o_k, m_k, H, K)


@triton.jit
def _load_dA(dA, bos, o_r, m_r, c0, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    return tl.load(dA + ((bos + o_r) * H + i_h)[:, None] * BT + (c0 + tl.arange(0, BC))[None, :], mask=m_r[:, None],
                   other=0.)


@triton.jit
def chunk_span(gk, gc, a, ag, bos, o_t, m_t, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """The chunk's gate sums from the raw log gates, gc = cumsum(gk) over its rows
    (``cumsum.chunk_cumsum``'s sums, stored for the later stages), the read rows decayed to the
    chunk's start, ag = a exp(G^-) (the WY stage's operand, ``dplr_wy``), and the widest span of
    the chunk (rows' G^- = gc - gk and G, every channel): max - min."""
    b_span = tl.max(tl.zeros([BK], dtype=tl.float32), 0)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_s, _, _, _ = block_sums(gk, gc, a, ag, bos, o_t, m_t, i_h, o_k, H, K, True)
        b_span = tl.maximum(b_span, b_s)
    return b_span


@triton.jit
def block_sums(gk, gc, a, ag, bos, o_t, m_t, i_h, o_k, H: tl.constexpr, K: tl.constexpr, STORE_G: tl.constexpr):
    """Key block o_k of ``chunk_span``: stores a exp(G^-) to ag and (STORE_G) its gate sums to gc,
    returns (span, midpoint, G, G^-)."""
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    p_g = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    b_gk = tl.load(gk + p_g, mask=m_tk, other=0.).to(tl.float32)
    b_g = tl.cumsum(b_gk, axis=0)
    b_gp = b_g - b_gk
    if STORE_G:
        tl.store(gc + p_g, b_g, mask=m_tk)
    b_a = tl.load(a + p_g, mask=m_tk, other=0.).to(tl.float32)
    tl.store(ag + p_g, (b_a * exp(b_gp)).to(ag.dtype.element_ty), mask=m_tk)
    b_span, b_ref = span_ref(b_gp, b_g, m_tk)
    return b_span, b_ref, b_g, b_gp


@triton.jit
def _fwd_sub(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, scale, i_c, i_i, bos, T, i_h, H: tl.constexpr, K: tl.constexpr,
             BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
             DIAG_PRECISION: tl.constexpr, SPAN: tl.constexpr):
    """Sub-chunk i_i's rows of the four matrices (the path for chunks whose gates span SPAN or more)."""
    NC: tl.constexpr = BT // BC
    o_c = tl.arange(0, BC)
    o_i = i_c * BT + i_i * BC + o_c
    m_i = o_i < T
    p_A = ((bos + o_i) * H + i_h)[:, None] * BT
    # earlier sub-chunks j < i, through the reference row before sub-chunk i
    o_r = bos + i_c * BT + i_i * BC - 1
    for i_j in range(0, NC - 1):
        if i_j < i_i:
            o_j = i_c * BT + i_j * BC + o_c
            b_qk = tl.zeros([BC, BC], dtype=tl.float32)
            b_qb = tl.zeros([BC, BC], dtype=tl.float32)
            b_ak = tl.zeros([BC, BC], dtype=tl.float32)
            b_ab = tl.zeros([BC, BC], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_ik = m_i[:, None] & m_k[None, :]
                b_gr = tl.load(gc + (o_r * H + i_h) * K + o_k, mask=m_k, other=0.)
                b_qg = load_rows(q, bos, o_i, m_i, i_h, o_k, m_k, H, K) * exp(
                    tl.where(m_ik, load_rows(gc, bos, o_i, m_i, i_h, o_k, m_k, H, K) - b_gr[None, :], 0.))
                b_ag = load_rows(a, bos, o_i, m_i, i_h, o_k, m_k, H, K) * exp(
                    tl.where(m_ik, load_gp(gc, gk, bos, o_i, m_i, i_h, o_k, m_k, H, K) - b_gr[None, :], 0.))
                b_e = exp(b_gr[None, :] - load_rows(gc, bos, o_j, o_j < T, i_h, o_k, m_k, H, K))
                b_kg = tl.trans(load_rows(k, bos, o_j, o_j < T, i_h, o_k, m_k, H, K) * b_e)
                b_bg = tl.trans(load_rows(b, bos, o_j, o_j < T, i_h, o_k, m_k, H, K) * b_e)
                b_qk += dot_at(b_qg, b_kg, DOT_PRECISION)
                b_qb += dot_at(b_qg, b_bg, DOT_PRECISION)
                b_ak += dot_at(b_ag, b_kg, DOT_PRECISION)
                b_ab += dot_at(b_ag, b_bg, DOT_PRECISION)
            p_j = p_A + (i_j * BC + o_c)[None, :]
            tl.store(Aqk + p_j, b_qk * scale, mask=m_i[:, None])
            tl.store(Aqb + p_j, b_qb * scale, mask=m_i[:, None])
            tl.store(Aak + p_j, b_ak, mask=m_i[:, None])
            tl.store(Aab + p_j, b_ab, mask=m_i[:, None])
    # the diagonal sub-chunk: factored through the midpoint of its gates when their span allows,
    # else one column j at a time with the pairwise differences
    b_qk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qb = tl.zeros([BC, BC], dtype=tl.float32)
    b_ak = tl.zeros([BC, BC], dtype=tl.float32)
    b_ab = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        b_q = load_rows(q, bos, o_i, m_i, i_h, o_k, m_k, H, K)
        b_a = load_rows(a, bos, o_i, m_i, i_h, o_k, m_k, H, K)
        b_g = load_rows(gc, bos, o_i, m_i, i_h, o_k, m_k, H, K)
        b_gp = load_gp(gc, gk, bos, o_i, m_i, i_h, o_k, m_k, H, K)
        b_span, b_ref = span_ref(b_gp, b_g, m_ik)
        if b_span < SPAN:
            b_fc = factor(1., b_g, b_ref, m_ik, False)
            b_kg = tl.trans(load_rows(k, bos, o_i, m_i, i_h, o_k, m_k, H, K) * b_fc)
            b_bg = tl.trans(load_rows(b, bos, o_i, m_i, i_h, o_k, m_k, H, K) * b_fc)
            b_qg = factor(b_q, b_g, b_ref, m_ik, True)
            b_ag = factor(b_a, b_gp, b_ref, m_ik, True)
            b_qk += dot_at(b_qg, b_kg, DIAG_PRECISION)
            b_qb += dot_at(b_qg, b_bg, DIAG_PRECISION)
            b_ak += dot_at(b_ag, b_kg, DIAG_PRECISION)
            b_ab += dot_at(b_ag, b_bg, DIAG_PRECISION)
        else:
            for j in range(0, BC):  # a loop, not unrolled: the fallback keeps registers low
                m_kj = m_k & (i_c * BT + i_i * BC + j < T)
                p_j = ((bos + i_c * BT + i_i * BC + j) * H + i_h) * K + o_k
                b_kj = tl.load(k + p_j, mask=m_kj, other=0.).to(tl.float32)
                b_bj = tl.load(b + p_j, mask=m_kj, other=0.).to(tl.float32)
                b_gj = tl.load(gc + p_j, mask=m_kj, other=0.)
                b_e = exp(tl.where(((o_c >= j) & m_i)[:, None], b_g - b_gj[None, :], float("-inf")))
                b_qk += tl.where(o_c[None, :] == j, tl.sum(b_q * b_kj[None, :] * b_e, axis=1)[:, None], 0.)
                b_qb += tl.where(o_c[None, :] == j, tl.sum(b_q * b_bj[None, :] * b_e, axis=1)[:, None], 0.)
                b_e = exp(tl.where(((o_c > j) & m_i)[:, None], b_gp - b_gj[None, :], float("-inf")))
                b_ak += tl.where(o_c[None, :] == j, tl.sum(b_a * b_kj[None, :] * b_e, axis=1)[:, None], 0.)
                b_ab += tl.where(o_c[None, :] == j, tl.sum(b_a * b_bj[None, :] * b_e, axis=1)[:, None], 0.)
    m_incl = o_c[:, None] >= o_c[None, :]
    m_strict = o_c[:, None] > o_c[None, :]
    b_qk, b_qb = tl.where(m_incl, b_qk, 0.), tl.where(m_incl, b_qb, 0.)
    b_ak, b_ab = tl.where(m_strict, b_ak, 0.), tl.where(m_strict, b_ab, 0.)
    p_j = p_A + (i_i * BC + o_c)[None, :]
    tl.store(Aqk + p_j, b_qk * scale, mask=m_i[:, None])
    tl.store(Aqb + p_j, b_qb * scale, mask=m_i[:, None])
    tl.store(Aak + p_j, b_ak, mask=m_i[:, None])
    tl.store(Aab + p_j, b_ab, mask=m_i[:, None])


@triton.jit
def _fwd_subs(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, scale, i_c, bos, T, i_h, H: tl.constexpr, K: tl.constexpr,
              BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
              DIAG_PRECISION: tl.constexpr, SPAN: tl.constexpr):
    """A wide chunk's rows, sub-chunk after sub-chunk (``_fwd_sub``)."""
    for i_i in range(0, BT // BC):
        if i_c * BT + i_i * BC < T:
            _fwd_sub(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, scale, i_c, i_i, bos, T, i_h, H, K, BT, BC, BK,
                     DOT_PRECISION, DIAG_PRECISION, SPAN)


@triton.jit
def dplr_intra_fwd_kernel(q, k, a, b, gk, gc, ag, Aqk, Aqb, Aak, Aab, wide, cu_seqlens, chunk_indices, scale,
                          H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, DIAG_PRECISION: tl.constexpr, SPAN: tl.constexpr,
                          FLAG: tl.constexpr, WIDE_SUMS_ONLY: tl.constexpr):
    """One program per (chunk, head). A chunk whose gates span less than SPAN is factored whole
    through the per-channel midpoint of its gates (four [BT, BT] dots per K block). A wider one
    takes the sub-chunk path (``_fwd_sub``): here, or (FLAG) in ``dplr_intra_wide_kernel``, which
    reads the flag stored in wide[chunk, head] (the sub-chunk path's registers then stay out of
    this kernel). The flag is stored either way: the backward branches on it. The chunk's gate
    sums are formed here from gk and written to gc (``chunk_span``), then read back: the
    barrier makes one thread's stores visible to the others (they hit L2). WIDE_SUMS_ONLY (one key
    block): gc is written for the wide chunks alone, the sub-chunk path's one reader (the forward
    state pass then forms its own sums, ``state_fwd(raw_gate=True)``)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_c, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    if K <= BK:
        # one key block: the gate sums stay in registers, and each matrix is stored as soon as it is
        # formed, so at most three factored [BT, BK] tiles and one product are live at a time
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_span, b_ref, b_g, b_gp = block_sums(gk, gc, a, ag, bos, o_t, m_t, i_h, o_k, H, K, not WIDE_SUMS_ONLY)
        is_wide = b_span >= SPAN
        tl.store(wide + i_t * H + i_h, is_wide.to(tl.int8))
        if WIDE_SUMS_ONLY:
            if is_wide:
                tl.store(gc + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :], b_g, mask=m_tk)
        if not is_wide:
            o_r = tl.arange(0, BT)
            m_incl = o_r[:, None] >= o_r[None, :]
            m_strict = o_r[:, None] > o_r[None, :]
            p_A = ((bos + o_t) * H + i_h)[:, None] * BT + o_r[None, :]
            b_fc = factor(1., b_g, b_ref, m_tk, False)
            b_qg = factor(load_rows(q, bos, o_t, m_t, i_h, o_k, m_k, H, K), b_g, b_ref, m_tk, True)
            b_kg = tl.trans(load_rows(k, bos, o_t, m_t, i_h, o_k, m_k, H, K) * b_fc)
            b_A = dot_at(b_qg, b_kg, DIAG_PRECISION)
            tl.store(Aqk + p_A, tl.where(m_incl, b_A * scale, 0.), mask=m_t[:, None])
            b_bg = tl.trans(load_rows(b, bos, o_t, m_t, i_h, o_k, m_k, H, K) * b_fc)
            b_A = dot_at(b_qg, b_bg, DIAG_PRECISION)
            tl.store(Aqb + p_A, tl.where(m_incl, b_A * scale, 0.), mask=m_t[:, None])
            b_ag = factor(load_rows(a, bos, o_t, m_t, i_h, o_k, m_k, H, K), b_gp, b_ref, m_tk, True)
            b_A = dot_at(b_ag, b_bg, DIAG_PRECISION)
            tl.store(Aab + p_A, tl.where(m_strict, b_A, 0.), mask=m_t[:, None])
            b_A = dot_at(b_ag, b_kg, DIAG_PRECISION)
            tl.store(Aak + p_A, tl.where(m_strict, b_A, 0.), mask=m_t[:, None])
        elif not FLAG:
            tl.debug_barrier()  # the sub-chunk path reads the sums back
            _fwd_subs(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, scale, i_c, bos, T, i_h, H, K, BT, BC, BK,
                      DOT_PRECISION, DIAG_PRECISION, SPAN)
    else:
        is_wide = chunk_span(gk, gc, a, ag, bos, o_t, m_t, i_h, H, K, BK) >= SPAN
        tl.debug_barrier()
        tl.store(wide + i_t * H + i_h, is_wide.to(tl.int8))
        if not is_wide:
            b_qk = tl.zeros([BT, BT], dtype=tl.float32)
            b_qb = tl.zeros([BT, BT], dtype=tl.float32)
            b_ak = tl.zeros([BT, BT], dtype=tl.float32)
            b_ab = tl.zeros([BT, BT], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_tk = m_t[:, None] & m_k[None, :]
                b_g = load_rows(gc, bos, o_t, m_t, i_h, o_k, m_k, H, K)
                b_gp = load_gp(gc, gk, bos, o_t, m_t, i_h, o_k, m_k, H, K)
                _, b_ref = span_ref(b_gp, b_g, m_tk)
                b_fc = factor(1., b_g, b_ref, m_tk, False)
                b_kg = tl.trans(load_rows(k, bos, o_t, m_t, i_h, o_k, m_k, H, K) * b_fc)
                b_bg = tl.trans(load_rows(b, bos, o_t, m_t, i_h, o_k, m_k, H, K) * b_fc)
                b_qg = factor(load_rows(q, bos, o_t, m_t, i_h, o_k, m_k, H, K), b_g, b_ref, m_tk, True)
                b_ag = factor(load_rows(a, bos, o_t, m_t, i_h, o_k, m_k, H, K), b_gp, b_ref, m_tk, True)
                b_qk += dot_at(b_qg, b_kg, DIAG_PRECISION)
                b_qb += dot_at(b_qg, b_bg, DIAG_PRECISION)
                b_ak += dot_at(b_ag, b_kg, DIAG_PRECISION)
                b_ab += dot_at(b_ag, b_bg, DIAG_PRECISION)
            o_r = tl.arange(0, BT)
            m_incl = o_r[:, None] >= o_r[None, :]
            m_strict = o_r[:, None] > o_r[None, :]
            p_A = ((bos + o_t) * H + i_h)[:, None] * BT + o_r[None, :]
            tl.store(Aqk + p_A, tl.where(m_incl, b_qk * scale, 0.), mask=m_t[:, None])
            tl.store(Aqb + p_A, tl.where(m_incl, b_qb * scale, 0.), mask=m_t[:, None])
            tl.store(Aak + p_A, tl.where(m_strict, b_ak, 0.), mask=m_t[:, None])
            tl.store(Aab + p_A, tl.where(m_strict, b_ab, 0.), mask=m_t[:, None])
        elif not FLAG:
            _fwd_subs(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, scale, i_c, bos, T, i_h, H, K, BT, BC, BK,
                      DOT_PRECISION, DIAG_PRECISION, SPAN)


@triton.jit
def dplr_intra_wide_kernel(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, wide, cu_seqlens, chunk_indices, scale,
                           H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, DIAG_PRECISION: tl.constexpr, SPAN: tl.constexpr,
                           PER_CHUNK: tl.constexpr):
    """The chunks flagged wide; the others return at once. One program per (sub-chunk, head), or
    (PER_CHUNK) per (chunk, head) taking its sub-chunks in turn: a quarter of the programs, which
    is what a call with no wide chunk pays for (each only reads its flag)."""
    i_tc, i_h = tl.program_id(0), tl.program_id(1)
    if PER_CHUNK:
        i_t = i_tc
    else:
        i_t = i_tc // (BT // BC)
    if tl.load(wide + i_t * H + i_h) != 0:
        i_c, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
        if PER_CHUNK:
            _fwd_subs(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, scale, i_c, bos, T, i_h, H, K, BT, BC, BK,
                      DOT_PRECISION, DIAG_PRECISION, SPAN)
        else:
            i_i = i_tc % (BT // BC)
            if i_c * BT + i_i * BC < T:
                _fwd_sub(q, k, a, b, gc, gk, Aqk, Aqb, Aak, Aab, scale, i_c, i_i, bos, T, i_h, H, K, BT, BC, BK,
                         DOT_PRECISION, DIAG_PRECISION, SPAN)


@triton.jit
def bwd_finish(b_q, b_k, b_a, b_b, b_dq, b_dk, b_da, b_db, k, a, b, pairs, bos, o_i, m_i, lo, hi, i_h, o_k, m_k,
                scale, H: tl.constexpr, K: tl.constexpr, dq_s, dk_s, da_s, db_s, dq, dk, da, db, dgk, dga, dgs):
    """Rows o_i (valid where m_i) of a chunk holding rows [lo, hi): given the intra-chunk parts of
    dq (before scale), dk, da, db from the dA's without their gate-free pairs, add the parts
    through the states and the pairs' own terms (``pairs``, from ``dplr_wy.local_grads``), store
    the gradients and the gate gradient's three per-token terms (``dplr_bwd.py``, fp32):
    dgk = q dq - k dk - b db (every part read at G but the pairs and the chunk-end state terms),
    dga = a da (read at G^-, pairs excluded), dgs = k dk + b db (the chunk-end state terms)."""
    p_i = ((bos + o_i) * H + i_h)[:, None] * K + o_k[None, :]
    m_ik = m_i[:, None] & m_k[None, :]
    b_dq = b_dq * scale + tl.load(dq_s + p_i, mask=m_ik, other=0.)
    b_da += tl.load(da_s + p_i, mask=m_ik, other=0.)
    b_dks = tl.load(dk_s + p_i, mask=m_ik, other=0.)
    b_dbs = tl.load(db_s + p_i, mask=m_ik, other=0.)
    # dgk, dgs, dga may be the scratch itself (``dplr_bwd``): every thread's loads (a layout can hold
    # an element in several threads) are done before any store
    tl.debug_barrier()
    tl.store(dgk + p_i, b_q * b_dq - b_k * b_dk - b_b * b_db, mask=m_ik)
    tl.store(dga + p_i, b_a * b_da, mask=m_ik)
    tl.store(dgs + p_i, b_k * b_dks + b_b * b_dbs, mask=m_ik)
    # the pairs: dA_qk[t, t], dA_qb[t, t] (rows t), dA_ak[t, t-1], dA_ab[t, t-1] (rows t, against
    # k, b of row t - 1) and dA_ak[t+1, t], dA_ab[t+1, t] (columns t, against a of row t + 1)
    p_p = ((bos + o_i) * H + i_h) * 4
    m_prev, m_next = m_i & (o_i > lo), o_i + 1 < hi
    b_pqk = tl.load(pairs + p_p, mask=m_i, other=0.)[:, None] * scale
    b_pqb = tl.load(pairs + p_p + 1, mask=m_i, other=0.)[:, None] * scale
    b_da += (tl.load(pairs + p_p + 2, mask=m_i, other=0.)[:, None] * load_rows(k, bos, o_i - 1, m_prev, i_h, o_k,
                                                                                m_k, H, K)
             + tl.load(pairs + p_p + 3, mask=m_i, other=0.)[:, None] * load_rows(b, bos, o_i - 1, m_prev, i_h, o_k,
                                                                                  m_k, H, K))
    b_an = load_rows(a, bos, o_i + 1, m_next, i_h, o_k, m_k, H, K)
    b_dk += b_dks + b_pqk * b_q + tl.load(pairs + p_p + 4 * H + 2, mask=m_next, other=0.)[:, None] * b_an
    b_db += b_dbs + b_pqb * b_q + tl.load(pairs + p_p + 4 * H + 3, mask=m_next, other=0.)[:, None] * b_an
    b_dq += b_pqk * b_k + b_pqb * b_b
    tl.store(dq + p_i, b_dq.to(dq.dtype.element_ty), mask=m_ik)
    tl.store(dk + p_i, b_dk.to(dk.dtype.element_ty), mask=m_ik)
    tl.store(da + p_i, b_da.to(da.dtype.element_ty), mask=m_ik)
    tl.store(db + p_i, b_db.to(db.dtype.element_ty), mask=m_ik)


@triton.jit
def bwd_sub(q, k, a, b, gc, gk, dAqk, dAqb, dAak, dAab, pairs, dq_s, dk_s, da_s, db_s, dq, dk, da, db, dgk, dga,
             dgs, scale, i_k, i_c, i_i, bos, T, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
             BC: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr, DIAG_PRECISION: tl.constexpr,
             SPAN: tl.constexpr):
    """Sub-chunk i_i's rows of dq, dk, da, db in K block i_k (chunks whose gates span SPAN or more)."""
    NC: tl.constexpr = BT // BC
    o_c = tl.arange(0, BC)
    o_i = i_c * BT + i_i * BC + o_c
    m_i = o_i < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ik = m_i[:, None] & m_k[None, :]
    b_q = load_rows(q, bos, o_i, m_i, i_h, o_k, m_k, H, K)
    b_k = load_rows(k, bos, o_i, m_i, i_h, o_k, m_k, H, K)
    b_a = load_rows(a, bos, o_i, m_i, i_h, o_k, m_k, H, K)
    b_b = load_rows(b, bos, o_i, m_i, i_h, o_k, m_k, H, K)
    b_g = load_rows(gc, bos, o_i, m_i, i_h, o_k, m_k, H, K)
    b_gp = load_gp(gc, gk, bos, o_i, m_i, i_h, o_k, m_k, H, K)
    # row side (dq, da) from earlier sub-chunks, through the reference row before sub-chunk i
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_da = tl.zeros([BC, BK], dtype=tl.float32)
    if i_i > 0:
        b_gr = tl.load(gc + ((bos + i_c * BT + i_i * BC - 1) * H + i_h) * K + o_k, mask=m_k, other=0.)
        for i_j in range(0, NC - 1):
            if i_j < i_i:
                o_j = i_c * BT + i_j * BC + o_c
                b_e = exp(b_gr[None, :] - load_rows(gc, bos, o_j, o_j < T, i_h, o_k, m_k, H, K))
                b_kj = load_rows(k, bos, o_j, o_j < T, i_h, o_k, m_k, H, K) * b_e
                b_bj = load_rows(b, bos, o_j, o_j < T, i_h, o_k, m_k, H, K) * b_e
                b_dq += dot_at(_load_dA(dAqk, bos, o_i, m_i, i_j * BC, i_h, H, BT, BC), b_kj, DOT_PRECISION)
                b_dq += dot_at(_load_dA(dAqb, bos, o_i, m_i, i_j * BC, i_h, H, BT, BC), b_bj, DOT_PRECISION)
                b_da += dot_at(_load_dA(dAak, bos, o_i, m_i, i_j * BC, i_h, H, BT, BC), b_kj, DOT_PRECISION)
                b_da += dot_at(_load_dA(dAab, bos, o_i, m_i, i_j * BC, i_h, H, BT, BC), b_bj, DOT_PRECISION)
        b_dq *= exp(tl.where(m_ik, b_g - b_gr[None, :], 0.))
        b_da *= exp(tl.where(m_ik, b_gp - b_gr[None, :], 0.))
    # column side (dk, db) from later sub-chunks, through the reference row before each of them
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    b_db = tl.zeros([BC, BK], dtype=tl.float32)
    for i_j in range(1, NC):
        if (i_j > i_i) and (i_c * BT + i_j * BC < T):
            o_j = i_c * BT + i_j * BC + o_c
            m_j = o_j < T
            m_jk = m_j[:, None] & m_k[None, :]
            b_gr = tl.load(gc + ((bos + i_c * BT + i_j * BC - 1) * H + i_h) * K + o_k, mask=m_k, other=0.)
            b_qj = load_rows(q, bos, o_j, m_j, i_h, o_k, m_k, H, K) * scale * exp(
                tl.where(m_jk, load_rows(gc, bos, o_j, m_j, i_h, o_k, m_k, H, K) - b_gr[None, :], 0.))
            b_aj = load_rows(a, bos, o_j, m_j, i_h, o_k, m_k, H, K) * exp(
                tl.where(m_jk, load_gp(gc, gk, bos, o_j, m_j, i_h, o_k, m_k, H, K) - b_gr[None, :], 0.))
            b_e = exp(tl.where(m_ik, b_gr[None, :] - b_g, 0.))
            b_dkj = dot_at(tl.trans(_load_dA(dAqk, bos, o_j, m_j, i_i * BC, i_h, H, BT, BC)), b_qj, DOT_PRECISION)
            b_dkj += dot_at(tl.trans(_load_dA(dAak, bos, o_j, m_j, i_i * BC, i_h, H, BT, BC)), b_aj, DOT_PRECISION)
            b_dbj = dot_at(tl.trans(_load_dA(dAqb, bos, o_j, m_j, i_i * BC, i_h, H, BT, BC)), b_qj, DOT_PRECISION)
            b_dbj += dot_at(tl.trans(_load_dA(dAab, bos, o_j, m_j, i_i * BC, i_h, H, BT, BC)), b_aj, DOT_PRECISION)
            b_dk += b_dkj * b_e
            b_db += b_dbj * b_e
    # the diagonal sub-chunk: factored through the midpoint of its gates when their span allows,
    # else one token j at a time: column j of each dA for dq, da (rows t >= j, t > j for the
    # a-rows), row j for dk, db (columns s <= j, s < j)
    b_span, b_ref = span_ref(b_gp, b_g, m_ik)
    if b_span < SPAN:
        p_d = ((bos + o_i) * H + i_h)[:, None] * BT + (i_i * BC + o_c)[None, :]
        m_di = (o_c[:, None] >= o_c[None, :]) & m_i[:, None]
        m_ds = (o_c[:, None] > o_c[None, :]) & m_i[:, None]
        b_dq, b_dk, b_da, b_db = factored_bwd(
            b_q, b_k, b_a, b_b, b_g, b_gp, b_ref, b_dq, b_dk, b_da, b_db, tl.load(dAqk + p_d, mask=m_di, other=0.),
            tl.load(dAqb + p_d, mask=m_di, other=0.), tl.load(dAak + p_d, mask=m_ds, other=0.),
            tl.load(dAab + p_d, mask=m_ds, other=0.), m_ik, scale, DIAG_PRECISION)
    else:
        for j in range(0, BC):  # a loop, not unrolled: the fallback keeps registers low
            r_j = i_c * BT + i_i * BC + j
            m_kj = m_k & (r_j < T)
            p_j = ((bos + r_j) * H + i_h) * K + o_k
            m_ti, m_ts = (o_c >= j) & m_i, (o_c > j) & m_i
            m_si, m_ss = (o_c <= j) & m_i & (r_j < T), (o_c < j) & m_i & (r_j < T)
            p_c = ((bos + o_i) * H + i_h) * BT + i_i * BC + j
            p_r = ((bos + r_j) * H + i_h) * BT + i_i * BC + o_c
            b_kj = tl.load(k + p_j, mask=m_kj, other=0.).to(tl.float32)
            b_bj = tl.load(b + p_j, mask=m_kj, other=0.).to(tl.float32)
            b_qj = tl.load(q + p_j, mask=m_kj, other=0.).to(tl.float32) * scale
            b_aj = tl.load(a + p_j, mask=m_kj, other=0.).to(tl.float32)
            b_gj = tl.load(gc + p_j, mask=m_kj, other=0.)
            b_gpj = b_gj - tl.load(gk + p_j, mask=m_kj, other=0.).to(tl.float32)
            b_e = exp(tl.where(m_ti[:, None], b_g - b_gj[None, :], float("-inf")))
            b_dq += (tl.load(dAqk + p_c, mask=m_ti, other=0.)[:, None] * b_kj[None, :]
                     + tl.load(dAqb + p_c, mask=m_ti, other=0.)[:, None] * b_bj[None, :]) * b_e
            b_e = exp(tl.where(m_ts[:, None], b_gp - b_gj[None, :], float("-inf")))
            b_da += (tl.load(dAak + p_c, mask=m_ts, other=0.)[:, None] * b_kj[None, :]
                     + tl.load(dAab + p_c, mask=m_ts, other=0.)[:, None] * b_bj[None, :]) * b_e
            b_e = exp(tl.where(m_si[:, None], b_gj[None, :] - b_g, float("-inf")))
            b_dk += tl.load(dAqk + p_r, mask=m_si, other=0.)[:, None] * b_qj[None, :] * b_e
            b_db += tl.load(dAqb + p_r, mask=m_si, other=0.)[:, None] * b_qj[None, :] * b_e
            b_e = exp(tl.where(m_ss[:, None], b_gpj[None, :] - b_g, float("-inf")))
            b_dk += tl.load(dAak + p_r, mask=m_ss, other=0.)[:, None] * b_aj[None, :] * b_e
            b_db += tl.load(dAab + p_r, mask=m_ss, other=0.)[:, None] * b_aj[None, :] * b_e
    bwd_finish(b_q, b_k, b_a, b_b, b_dq, b_dk, b_da, b_db, k, a, b, pairs, bos, o_i, m_i, i_c * BT,
                tl.minimum(T, i_c * BT + BT), i_h, o_k, m_k, scale, H, K, dq_s, dk_s, da_s, db_s, dq, dk, da, db, dgk,
                dga, dgs)


@triton.jit
def factored_bwd(b_q, b_k, b_a, b_b, b_g, b_gp, b_ref, b_dq, b_dk, b_da, b_db, b_dqk, b_dqb, b_dak, b_dab, m_rk, scale,
                  DIAG_PRECISION: tl.constexpr):
    """A block of rows against itself (the dA tiles masked to it), every decay factored through
    b_ref: adds to (dq, dk, da, db) and returns them."""
    b_fc = factor(1., b_g, b_ref, m_rk, False)
    b_fq = factor(1., b_g, b_ref, m_rk, True)
    b_fa = factor(1., b_gp, b_ref, m_rk, True)
    b_kg, b_bg = b_k * b_fc, b_b * b_fc
    b_qg, b_ag = b_q * b_fq * scale, b_a * b_fa
    b_dq += (dot_at(b_dqk, b_kg, DIAG_PRECISION)
             + dot_at(b_dqb, b_bg, DIAG_PRECISION)) * b_fq
    b_da += (dot_at(b_dak, b_kg, DIAG_PRECISION)
             + dot_at(b_dab, b_bg, DIAG_PRECISION)) * b_fa
    b_dk += (dot_at(tl.trans(b_dqk), b_qg, DIAG_PRECISION)
             + dot_at(tl.trans(b_dak), b_ag, DIAG_PRECISION)) * b_fc
    b_db += (dot_at(tl.trans(b_dqb), b_qg, DIAG_PRECISION)
             + dot_at(tl.trans(b_dab), b_ag, DIAG_PRECISION)) * b_fc
    return b_dq, b_dk, b_da, b_db


def chunk_spans(g: torch.Tensor, BK: int, BT: int = 64) -> torch.Tensor:
    """The span each chunk's branch compares with ``span`` (default ``SAFE_SPAN``), for one sequence
    of log gates g [T, H, K] (rows G^- and G, columns G). Returns [NT, H, cdiv(K, BK)] float64, per
    K block (the backward's branch); the forward branches on the largest over K blocks (tests,
    benchmarks)."""
    spans = decay_intra.diagonal_spans(g, exclusive=True, BK=BK, BT=BT, BC=BT)
    return spans[:, 0]


def dplr_intra_fwd(q, k, a, b, gk, scale: float, chunks: Chunks, *, span: float = SAFE_SPAN,
                   wide_kernel: bool = True, config: tuple[int, tuple[int, int]] | None = None,
                   wide_grid: str = "sub_chunk", ak_dtype: torch.dtype = torch.float32, gate_sums: bool = True):
    """A_qk, A_qb (scale folded in) [1, T, H, BT] in q's dtype, A_ak (in ``ak_dtype``), A_ab fp32 (the solve and the
    reads need them exact; the output multiplies A_qk, A_qb in the input dtype anyway, dV = A_qk^T
    dO now sees A_qk rounded to it, as fla's, and these two are half of what the forward writes per
    token), row t holding its chunk's row; only the (strict) lower triangle is written. A chunk
    whose gates span less than ``span`` is factored whole; a wider one goes sub-chunk by sub-chunk,
    in ``dplr_intra_wide_kernel`` (``wide_kernel``; one program per sub-chunk, or per chunk with
    ``wide_grid`` "chunk") or inside the main kernel (its registers then count there too).
    ``config``: (BK, (num_warps, num_stages)) of the main kernel instead of ``fwd_launch_config(K,
    q.dtype)``'s. The chunk-local gate sums are formed in the kernel from the log gates ``gk`` [1,
    T, H, K] (no cumsum pass of their own). Returns (gc, A_qk, A_qb, A_ak, A_ab, wide, ag): gc [1, T,
    H, K] fp32 as ``chunk_cumsum(gk)`` (G^- = gc - gk is formed by each reader, ``load_gp``); ``wide``
    [NC, H] int8, 1 where the chunk's gates span ``span`` or more for that head (the sub-chunk path;
    ``dplr_bwd`` takes the same branch from it); ag [1, T, H, K] = a exp(G^-) in ``ag_dtype``.
    ``gate_sums`` False: gc is None, the sums kept only where the sub-chunk path reads them (a reader
    forms its own, ``state.state_fwd(raw_gate=True)``): one [T, H, K] fp32 store less where K fits one
    key block (a wider K re-reads the sums across its blocks and stores them all)."""
    _, T, H, K = q.shape
    BT, BC = chunks.BT, 16
    BK, (warps, stages) = config or fwd_launch_config(K, q.dtype)
    BK = min(BK, max(16, triton.next_power_of_2(K)))
    As = [torch.empty(1, T, H, BT, dtype=dtype, device=q.device) for dtype in (q.dtype, q.dtype, ak_dtype,
                                                                              torch.float32)]
    wide = torch.empty(chunks.NC, H, dtype=torch.int8, device=q.device)
    gk = gk.contiguous()
    gc = alloc(gk.shape, dtype=torch.float32, device=q.device)
    ag = alloc(a.shape, dtype=ag_dtype(a.dtype), device=q.device)
    meta = dict(H=H, K=K, BT=BT, BC=BC, BK=BK, DOT_PRECISION=dot_precision(q.dtype),
                DIAG_PRECISION=diag_precision(q.dtype), SPAN=span)
    args = (q, k, a, b, gc, gk, *As, wide, chunks.cu_seqlens, chunks.chunk_indices, scale)
    dplr_intra_fwd_kernel[(chunks.NC, H)](q, k, a, b, gk, gc, ag, *args[6:], **meta, FLAG=wide_kernel,
                                          WIDE_SUMS_ONLY=not gate_sums and K <= BK, num_warps=warps,
                                          num_stages=stages)
    if wide_kernel:
        # the sub-chunk path keeps K blocks of 32 (its [16, 16] tiles gain nothing from a wider K block)
        if wide_grid not in ("sub_chunk", "chunk"):
            raise ValueError(f"`wide_grid` must be 'sub_chunk' or 'chunk', got {wide_grid!r}")
        per_chunk = wide_grid == "chunk"
        grid = (chunks.NC if per_chunk else chunks.NC * (BT // BC), H)
        dplr_intra_wide_kernel[grid](*args, **{**meta, "BK": min(BK, 32)}, PER_CHUNK=per_chunk, num_warps=4)
    return (gc if gate_sums else None, *As, wide, ag)
