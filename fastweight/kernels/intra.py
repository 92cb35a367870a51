"""Per-channel decayed products inside a chunk (KDA), forward and backward, overflow-safe.

For a chunk (local rows i, j; ``G`` the chunk-local cumsum of the per-channel log gate, [BT, K]):

    Aqk_ij = sum_d q_id k_jd exp(G_id - G_jd)      i >= j
    Akk_ij = sum_d k_id k_jd exp(G_id - G_jd)      i >  j

exp(G_i) * exp(-G_j) over a whole chunk overflows for strong decays, so the chunk is cut into
4 blocks of 16 rows. Off-diagonal blocks (rows r > columns c) factor through the first row of
block r, ``R_r``: both ``exp(G_i - R_r)`` (i >= ref) and ``exp(R_r - G_j)`` (j < ref) are
<= 1, and the block is one matrix product: in the input dtype, but on fp32 decayed rows and dA
at TF32 in the bf16 backward (``_off_precision``). A diagonal block is factored the
same way, with fp32 operands, when its decay over 16 rows stays under e^SAFE_SPAN, and otherwise
takes the pairwise differences directly (16 channels at a time). The factored diagonal's fp32
operands go to the tensor cores as TF32, which truncates them to 10 mantissa bits; for fp16 they
are rounded to nearest first (``common.round_tf32``), as fine as the off-diagonal blocks' fp16
operands, since truncation's bias doubled the output's error (``testing.emulate_tf32``;
docs/bench/delta.md).

One program per (chunk, head) holds a whole row block's channels ([16, K]) and walks the four
blocks in turn, so that each product is stored (forward) or folded into its gradient (backward)
as soon as it is formed: no [16, 16] accumulator lives across a loop over channels, and the
registers go to the [16, K] rows. With ``beta`` the forward instead keeps Akk's ten blocks in
registers and forms the solve's Ai = (I + Diag(beta) Akk)^{-1} from them (``_fwd_solve``), so Akk is
written only where a backward reads it.

Backward, given dAqk, dAkk (gradients of the raw sums above):

    dq_i += sum_j dAqk_ij k_j e_ij            dk_j += sum_i (dAqk_ij q_i + dAkk_ij k_i) e_ij
    dk_i += sum_j dAkk_ij k_j e_ij            dG_i += q_i * dq_i + k_i * dk_i (row parts) - k_j * dk_j (column parts)

with ``e_ij = exp(G_i - G_j)`` per channel; the dG terms are with respect to the chunk-local cumsum.
The diagonal of Aqk (i = j, e_ii = 1) enters dG_i as a row part and a column part that cancel
exactly: it is left out of dG (a strong decay makes the gate's gradient O(e_ij) small, and the
rounding of those O(1) terms alone would swamp it) and added to dq and dk only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import SAFE_SPAN, Chunks, alloc, dot_at, exp, mm
from fastweight.kernels.kkt_solve import load_beta16, merge_precision, store_solved

# SPAN (``common.SAFE_SPAN``): a diagonal block whose decay over its 16 rows stays under exp(SPAN) in
# every channel is factored through its first row like the off-diagonal ones, with its operands (up
# to e^40) in fp32, not in the input dtype as the forward's off-diagonal blocks: bf16 operands put KDA's bf16
# dg at 4.3x its rounding floor on the H200, fp32 ones at 2.2x (docs/bench/delta.md, KDA bf16 dg).
# The forward multiplies them as TF32 for 16-bit inputs (exactly for fp32 inputs): exact fp32 (FMA)
# products over all of K cost the forward 2x on the H200, and TF32 leaves the bf16 dg where it was
# (docs/bench/delta.md, KDA's intra kernels). Beyond SPAN the exact pairwise form runs.

def _diag_precision(dtype: torch.dtype) -> str:
    """The factored diagonal's dots: exact for fp32; for fp16 one TF32 pass on operands rounded to
    nearest (``common.round_tf32``: fp16's o and gradients 1.1-1.25x those of exact products, where
    the tensor cores' truncation alone gives 1.9-2.1x, and 3 x TF32 spills at K = 128); one plain
    TF32 pass for bf16, whose own rounding is 8 times coarser."""
    if dtype == torch.float32:
        return "ieee"
    return "tf32rn" if dtype == torch.float16 else "tf32"


def _off_precision(dtype: torch.dtype) -> str:
    """The backward's off-diagonal dots: for bf16, a TF32 pass on the fp32 decayed rows and dA
    (rounded to bf16, they gave dg 1.27x fla's error: 4.48e-3 against 3.54e-3 on the H100); for the
    other dtypes, "" (operands in the input dtype: fp16's 11 significant bits are TF32's)."""
    return "tf32" if dtype == torch.bfloat16 else ""


# (forward, backward) warps: the backward holds three [16, K] column sums across its row blocks and
# spills at 4 warps from K = 64 on (H200, K = 128: 2.41 ms at 8 warps against 3.62 at 4; the
# forward 0.65 at 4 against 1.09 at 8)
def _warps(K: int) -> tuple[int, int]:
    return (4 if K <= 128 else 8), (4 if K < 64 else 8)


@triton.jit
def _rows16(x, T, r0, STRIDE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Rows r0 .. r0 + 16 of a [T, K] slab (rows STRIDE apart), all K channels (padded to BK)."""
    return tl.load(tl.make_block_ptr(x, (T, K), (STRIDE, 1), (r0, 0), (16, BK), (1, 0)), boundary_check=(0, 1))


@triton.jit
def _block_rows(q, k, g, T, r0, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """A row block: q, k (input dtype), G, its first row R (the reference), e = exp(G - R) <= 1 and
    f = exp(R - G) >= 1 (both 0 on rows past T), and the block's span max(R - G)."""
    b_q, b_k = _rows16(q, T, r0, HK * K, K, BK), _rows16(k, T, r0, HK * K, K, BK)
    b_g = _rows16(g, T, r0, H * K, K, BK)
    o_k = tl.arange(0, BK)
    b_ref = tl.load(g + tl.minimum(r0, T - 1) * H * K + o_k, mask=o_k < K, other=0.)
    m_v = (r0 + tl.arange(0, 16) < T)[:, None]
    b_d = b_ref[None, :] - b_g
    b_e = exp(tl.where(m_v, -b_d, float("-inf")))
    b_f = exp(tl.where(m_v, b_d, float("-inf")))
    return b_q, b_k, b_ref, b_e, b_f, tl.max(tl.max(tl.where(m_v, b_d, 0.), 1), 0)


@triton.jit
def _columns(k, g, T, c0, b_ref, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Column block c0 .. c0 + 16 against a later row block's reference R: k_c and exp(R - G_c) <= 1."""
    b_k, b_g = _rows16(k, T, c0, HK * K, K, BK), _rows16(g, T, c0, H * K, K, BK)
    m_v = (c0 + tl.arange(0, 16) < T)[:, None]
    return b_k, exp(tl.where(m_v, b_ref[None, :] - b_g, float("-inf")))


@triton.jit
def _diag_exact(q, k, g, T, r0, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr):
    """A diagonal block's raw sums, pairwise (every exponent <= 0), 16 channels at a time."""
    o_i = tl.arange(0, 16)
    m_v = r0 + o_i < T
    m_d = (o_i[:, None] >= o_i[None, :]) & m_v[:, None]
    b_qk = tl.zeros([16, 16], dtype=tl.float32)
    b_kk = tl.zeros([16, 16], dtype=tl.float32)
    for s in range(tl.cdiv(K, 16)):
        o_k = 16 * s + tl.arange(0, 16)
        m = m_v[:, None] & (o_k < K)[None, :]
        rows = (r0 + o_i).to(tl.int64)[:, None]
        b_g = tl.load(g + rows * (H * K) + o_k[None, :], mask=m, other=0.)
        b_k = tl.load(k + rows * (HK * K) + o_k[None, :], mask=m, other=0.).to(tl.float32)
        b_q = tl.load(q + rows * (HK * K) + o_k[None, :], mask=m, other=0.).to(tl.float32)
        b_ke = b_k[None, :, :] * exp(tl.where(m_d[:, :, None], b_g[:, None, :] - b_g[None, :, :], float("-inf")))
        b_qk += tl.sum(b_q[:, None, :] * b_ke, 2)
        b_kk += tl.sum(b_k[:, None, :] * b_ke, 2)
    return b_qk, b_kk


@triton.jit
def _diag(b_q, b_k, b_e, b_f, span, q, k, g, T, r0, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
          SPAN: tl.constexpr, P: tl.constexpr):
    """A diagonal block's (Aqk masked i >= j, Akk masked i > j): factored through its first row with
    fp32 operands when its span allows, their dots at precision P (``_diag_precision``), else
    pairwise."""
    if span < SPAN:
        b_kf = tl.trans(b_k.to(tl.float32) * b_f)
        b_qk = dot_at(b_q.to(tl.float32) * b_e, b_kf, P)
        b_kk = dot_at(b_k.to(tl.float32) * b_e, b_kf, P)
    else:
        b_qk, b_kk = _diag_exact(q, k, g, T, r0, HK, H, K)
    o_i = tl.arange(0, 16)
    return tl.where(o_i[:, None] >= o_i[None, :], b_qk, 0.), tl.where(o_i[:, None] > o_i[None, :], b_kk, 0.)


@triton.jit
def _store16(A, T, r0, c0, H: tl.constexpr, BT: tl.constexpr, b_x):
    p = tl.make_block_ptr(A, (T, BT), (H * BT, 1), (r0, c0), (16, 16), (1, 0))
    tl.store(p, b_x.to(p.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _fwd_row(q, k, g, Aqk, Akk, T, t0, R: tl.constexpr, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
             BK: tl.constexpr, BT: tl.constexpr, SPAN: tl.constexpr, P: tl.constexpr):
    """Row block R of a chunk: its blocks against column blocks c < R, its diagonal block, zeros above."""
    r0 = t0 + 16 * R
    b_q, b_k, b_ref, b_e, b_f, span = _block_rows(q, k, g, T, r0, HK, H, K, BK)
    dt = b_q.dtype
    b_qe, b_ke = (b_q * b_e).to(dt), (b_k * b_e).to(dt)
    for c in tl.static_range(R):
        b_kc, b_w = _columns(k, g, T, t0 + 16 * c, b_ref, HK, H, K, BK)
        b_y = tl.trans((b_kc * b_w).to(dt))
        _store16(Aqk, T, r0, 16 * c, H, BT, mm(b_qe, b_y))
        _store16(Akk, T, r0, 16 * c, H, BT, mm(b_ke, b_y))
    b_qk, b_kk = _diag(b_q, b_k, b_e, b_f, span, q, k, g, T, r0, HK, H, K, SPAN, P)
    _store16(Aqk, T, r0, 16 * R, H, BT, b_qk)
    _store16(Akk, T, r0, 16 * R, H, BT, b_kk)
    z = tl.zeros([16, 16], dtype=tl.float32)
    for c in tl.static_range(R + 1, 4):
        _store16(Aqk, T, r0, 16 * c, H, BT, z)
        _store16(Akk, T, r0, 16 * c, H, BT, z)


@triton.jit
def _kk_off(k, g, Aqk, Akk, T, t0, r0, C: tl.constexpr, b_qe, b_ke, b_ref, HK: tl.constexpr, H: tl.constexpr,
            K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, STORE_KK: tl.constexpr):
    """``_fwd_row``'s block against column block C, Aqk's stored, Akk's returned (and stored if STORE_KK)."""
    b_kc, b_w = _columns(k, g, T, t0 + 16 * C, b_ref, HK, H, K, BK)
    b_y = tl.trans((b_kc * b_w).to(b_qe.dtype))
    _store16(Aqk, T, r0, 16 * C, H, BT, mm(b_qe, b_y))
    b_kk = mm(b_ke, b_y)
    if STORE_KK:
        _store16(Akk, T, r0, 16 * C, H, BT, b_kk)
    return b_kk


@triton.jit
def _kk_diag(q, k, g, Aqk, Akk, T, r0, R: tl.constexpr, b_q, b_k, b_e, b_f, span, HK: tl.constexpr,
             H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, SPAN: tl.constexpr, P: tl.constexpr,
             STORE_KK: tl.constexpr):
    """``_fwd_row``'s diagonal block and the zeros above it; Akk's diagonal block returned."""
    b_qk, b_kk = _diag(b_q, b_k, b_e, b_f, span, q, k, g, T, r0, HK, H, K, SPAN, P)
    _store16(Aqk, T, r0, 16 * R, H, BT, b_qk)
    z = tl.zeros([16, 16], dtype=tl.float32)
    for c in tl.static_range(R + 1, 4):
        _store16(Aqk, T, r0, 16 * c, H, BT, z)
    if STORE_KK:
        _store16(Akk, T, r0, 16 * R, H, BT, b_kk)
        for c in tl.static_range(R + 1, 4):
            _store16(Akk, T, r0, 16 * c, H, BT, z)
    return b_kk


@triton.jit
def _row_data(q, k, g, T, r0, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """``_block_rows``' row block r0 .. r0 + 16, with q and k scaled by e = exp(G - R) in q's dtype (the
    operands of its off-diagonal blocks against the later rows)."""
    b_q, b_k, b_ref, b_e, b_f, span = _block_rows(q, k, g, T, r0, HK, H, K, BK)
    return b_q, b_k, b_ref, b_e, b_f, span, (b_q * b_e).to(b_q.dtype), (b_k * b_e).to(b_q.dtype)


@triton.jit
def _fwd_solve(q, k, g, beta, Aqk, Akk, Ai, T, t0, bos, i_h, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
               BK: tl.constexpr, BT: tl.constexpr, SPAN: tl.constexpr, P: tl.constexpr, MERGE_PRECISION: tl.constexpr,
               STORE_KK: tl.constexpr, PRODUCTS: tl.constexpr):
    """The four row blocks with Akk's ten blocks kept in registers, then Ai = (I + Diag(beta) Akk)^{-1}
    from them (``kkt_solve.solve_kernel``'s, without Akk's round trip through memory)."""
    b_q, b_k, b_ref, b_e, b_f, span, b_qe, b_ke = _row_data(q, k, g, T, t0, HK, H, K, BK)
    b_A11 = _kk_diag(q, k, g, Aqk, Akk, T, t0, 0, b_q, b_k, b_e, b_f, span, HK, H, K, BT, SPAN, P, STORE_KK)
    r0 = t0 + 16
    b_q, b_k, b_ref, b_e, b_f, span, b_qe, b_ke = _row_data(q, k, g, T, r0, HK, H, K, BK)
    b_A21 = _kk_off(k, g, Aqk, Akk, T, t0, r0, 0, b_qe, b_ke, b_ref, HK, H, K, BK, BT, STORE_KK)
    b_A22 = _kk_diag(q, k, g, Aqk, Akk, T, r0, 1, b_q, b_k, b_e, b_f, span, HK, H, K, BT, SPAN, P, STORE_KK)
    r0 = t0 + 32
    b_q, b_k, b_ref, b_e, b_f, span, b_qe, b_ke = _row_data(q, k, g, T, r0, HK, H, K, BK)
    b_A31 = _kk_off(k, g, Aqk, Akk, T, t0, r0, 0, b_qe, b_ke, b_ref, HK, H, K, BK, BT, STORE_KK)
    b_A32 = _kk_off(k, g, Aqk, Akk, T, t0, r0, 1, b_qe, b_ke, b_ref, HK, H, K, BK, BT, STORE_KK)
    b_A33 = _kk_diag(q, k, g, Aqk, Akk, T, r0, 2, b_q, b_k, b_e, b_f, span, HK, H, K, BT, SPAN, P, STORE_KK)
    r0 = t0 + 48
    b_q, b_k, b_ref, b_e, b_f, span, b_qe, b_ke = _row_data(q, k, g, T, r0, HK, H, K, BK)
    b_A41 = _kk_off(k, g, Aqk, Akk, T, t0, r0, 0, b_qe, b_ke, b_ref, HK, H, K, BK, BT, STORE_KK)
    b_A42 = _kk_off(k, g, Aqk, Akk, T, t0, r0, 1, b_qe, b_ke, b_ref, HK, H, K, BK, BT, STORE_KK)
    b_A43 = _kk_off(k, g, Aqk, Akk, T, t0, r0, 2, b_qe, b_ke, b_ref, HK, H, K, BK, BT, STORE_KK)
    b_A44 = _kk_diag(q, k, g, Aqk, Akk, T, r0, 3, b_q, b_k, b_e, b_f, span, HK, H, K, BT, SPAN, P, STORE_KK)
    b_b1, b_b2 = load_beta16(beta, bos, T, t0, H, i_h), load_beta16(beta, bos, T, t0 + 16, H, i_h)
    b_b3, b_b4 = load_beta16(beta, bos, T, t0 + 32, H, i_h), load_beta16(beta, bos, T, t0 + 48, H, i_h)
    store_solved(b_A11 * b_b1, b_A21 * b_b2, b_A22 * b_b2, b_A31 * b_b3, b_A32 * b_b3, b_A33 * b_b3, b_A41 * b_b4,
                 b_A42 * b_b4, b_A43 * b_b4, b_A44 * b_b4, Ai, T, t0, H, BT, MERGE_PRECISION, PRODUCTS=PRODUCTS)


@triton.jit
def intra_fwd_kernel(q, k, g, g_raw, Aqk, Akk, beta, Ai, cu_seqlens, chunk_indices, H: tl.constexpr,
                     HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
                     DIAG_PRECISION: tl.constexpr, GATE_SUMS: tl.constexpr, SOLVE: tl.constexpr,
                     STORE_KK: tl.constexpr, MERGE_PRECISION: tl.constexpr, PRODUCTS: tl.constexpr):
    """One program per (chunk, head). GATE_SUMS: the chunk's gate sums are formed here from the raw log
    gate g_raw and stored to g (``chunk_cumsum``'s), then read back by the row blocks: the barrier makes
    one thread's stores visible to the others (they hit L2). SOLVE: also Ai from Akk's blocks in
    registers (``_fwd_solve``); Akk is then stored only if STORE_KK (a backward reads it)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    t0 = i_t * BT
    q += (bos * HK + i_h // (H // HK)) * K
    k += (bos * HK + i_h // (H // HK)) * K
    g += (bos * H + i_h) * K
    Aqk += (bos * H + i_h) * BT
    if STORE_KK:
        Akk += (bos * H + i_h) * BT
    if GATE_SUMS:
        g_raw += (bos * H + i_h) * K
        p_raw = tl.make_block_ptr(g_raw, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        p_g = tl.make_block_ptr(g, (T, K), (H * K, 1), (t0, 0), (BT, BK), (1, 0))
        b_g = tl.cumsum(tl.load(p_raw, boundary_check=(0, 1)).to(tl.float32), axis=0)
        tl.store(p_g, b_g, boundary_check=(0, 1))
        tl.debug_barrier()
    if SOLVE:
        _fwd_solve(q, k, g, beta, Aqk, Akk, Ai + (bos * H + i_h) * BT, T, t0, bos, i_h, HK, H, K, BK, BT, SPAN,
                   DIAG_PRECISION, MERGE_PRECISION, STORE_KK, PRODUCTS)
    else:
        for R in tl.static_range(4):
            _fwd_row(q, k, g, Aqk, Akk, T, t0, R, HK, H, K, BK, BT, SPAN, DIAG_PRECISION)


@triton.jit
def _blk(A, T, r0, c0, H: tl.constexpr, BT: tl.constexpr):
    return tl.load(tl.make_block_ptr(A, (T, BT), (H * BT, 1), (r0, c0), (16, 16), (1, 0)), boundary_check=(0, 1))


@triton.jit
def _diag_exact_bwd(q, k, g, dq, dk, dg, b_dqk, b_dkk, T, r0, HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr):
    """A diagonal block's gradient parts, pairwise (every exponent <= 0), added in memory, 16
    channels at a time; b_dqk, b_dkk: its strictly lower dA blocks (fp32)."""
    o_i = tl.arange(0, 16)
    m_v = r0 + o_i < T
    m_d = (o_i[:, None] > o_i[None, :]) & m_v[:, None]
    for s in range(tl.cdiv(K, 16)):
        o_k = 16 * s + tl.arange(0, 16)
        m = m_v[:, None] & (o_k < K)[None, :]
        rows = (r0 + o_i).to(tl.int64)[:, None]
        b_g = tl.load(g + rows * (H * K) + o_k[None, :], mask=m, other=0.)
        b_k = tl.load(k + rows * (HK * K) + o_k[None, :], mask=m, other=0.).to(tl.float32)
        b_q = tl.load(q + rows * (HK * K) + o_k[None, :], mask=m, other=0.).to(tl.float32)
        b_e = exp(tl.where(m_d[:, :, None], b_g[:, None, :] - b_g[None, :, :], float("-inf")))
        b_dq = tl.sum(b_dqk[:, :, None] * b_e * b_k[None, :, :], 1)
        b_dkr = tl.sum(b_dkk[:, :, None] * b_e * b_k[None, :, :], 1)
        b_dkc = tl.sum((b_dqk[:, :, None] * b_q[:, None, :] + b_dkk[:, :, None] * b_k[:, None, :]) * b_e, 0)
        p = rows * (H * K) + o_k[None, :]
        tl.store(dq + p, tl.load(dq + p, mask=m, other=0.) + b_dq, mask=m)
        tl.store(dk + p, tl.load(dk + p, mask=m, other=0.) + b_dkr + b_dkc, mask=m)
        tl.store(dg + p, tl.load(dg + p, mask=m, other=0.) + b_q * b_dq + b_k * (b_dkr - b_dkc), mask=m)


@triton.jit
def _bwd_row(q, k, g, dAqk, dAkk, dq, dk, dg, dq16, dk16, b_x0, b_x1, b_x2, T, t0, R: tl.constexpr,
             HK: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
             SPAN: tl.constexpr, OFF_P: tl.constexpr, OUT16: tl.constexpr):
    """Row block R's gradients, its column part b_xR complete (every row block below it is done);
    adds its own column contributions to b_x0 .. b_x(R-1) and returns them. OFF_P: the off-diagonal
    blocks' dots on fp32 decayed rows and dA at that precision ("" : both in the input dtype).
    OUT16: the rows' final dq, dk also go to dq16, dk16 in their dtype (only there where nothing
    adds to them after: the factored diagonal)."""
    r0 = t0 + 16 * R
    b_q, b_k, b_ref, b_e, b_f, span = _block_rows(q, k, g, T, r0, HK, H, K, BK)
    dt = b_q.dtype
    b_qf, b_kf = b_q.to(tl.float32), b_k.to(tl.float32)
    if OFF_P == "":
        b_qe, b_ke = (b_qf * b_e).to(dt), (b_kf * b_e).to(dt)
    else:
        b_qe, b_ke = b_qf * b_e, b_kf * b_e
    b_dq = tl.zeros([16, BK], dtype=tl.float32)
    b_dkr = tl.zeros([16, BK], dtype=tl.float32)
    for c in tl.static_range(R):
        b_kc, b_w = _columns(k, g, T, t0 + 16 * c, b_ref, HK, H, K, BK)
        if OFF_P == "":
            b_y = (b_kc * b_w).to(dt)
            b_p = _blk(dAqk, T, r0, 16 * c, H, BT).to(dt)
            b_s = _blk(dAkk, T, r0, 16 * c, H, BT).to(dt)
            b_dq += mm(b_p, b_y)
            b_dkr += mm(b_s, b_y)
            b_xc = (mm(tl.trans(b_p), b_qe) + mm(tl.trans(b_s), b_ke)) * b_w
        else:
            b_y = b_kc.to(tl.float32) * b_w
            b_p = _blk(dAqk, T, r0, 16 * c, H, BT).to(tl.float32)
            b_s = _blk(dAkk, T, r0, 16 * c, H, BT).to(tl.float32)
            b_dq += dot_at(b_p, b_y, OFF_P)
            b_dkr += dot_at(b_s, b_y, OFF_P)
            b_xc = (dot_at(tl.trans(b_p), b_qe, OFF_P) + dot_at(tl.trans(b_s), b_ke, OFF_P)) * b_w
        if c == 0:
            b_x0 += b_xc
        elif c == 1:
            b_x1 += b_xc
        else:
            b_x2 += b_xc
    if R == 0:
        b_dkc = b_x0
    elif R == 1:
        b_dkc = b_x1
    elif R == 2:
        b_dkc = b_x2
    else:
        b_dkc = tl.zeros([16, BK], dtype=tl.float32)
    b_dq, b_dkr = b_dq * b_e, b_dkr * b_e
    # the diagonal block: Aqk's strictly lower part and its diagonal (a vector, kept out of dG), Akk's
    o_i = tl.arange(0, 16)
    m_v = (r0 + o_i < T)[:, None]
    m_s = o_i[:, None] > o_i[None, :]
    b_a = _blk(dAqk, T, r0, 16 * R, H, BT).to(tl.float32)
    b_ii = tl.sum(tl.where((o_i[:, None] == o_i[None, :]) & m_v, b_a, 0.), 1)
    b_dqk = tl.where(m_s & m_v, b_a, 0.)
    b_dkk = tl.where(m_s, _blk(dAkk, T, r0, 16 * R, H, BT).to(tl.float32), 0.)
    fast = span < SPAN
    if fast:
        b_kec = b_kf * b_f
        b_dq += mm(b_dqk, b_kec) * b_e
        b_dkr += mm(b_dkk, b_kec) * b_e
        b_dkc += (mm(tl.trans(b_dqk), b_qf * b_e) + mm(tl.trans(b_dkk), b_kf * b_e)) * b_f
    b_dg = b_qf * b_dq + b_kf * (b_dkr - b_dkc)
    b_dq += b_ii[:, None] * b_kf
    b_dk = b_dkr + b_dkc + b_ii[:, None] * b_qf
    p_dq = tl.make_block_ptr(dq, (T, K), (H * K, 1), (r0, 0), (16, BK), (1, 0))
    p_dk = tl.make_block_ptr(dk, (T, K), (H * K, 1), (r0, 0), (16, BK), (1, 0))
    p_dg = tl.make_block_ptr(dg, (T, K), (H * K, 1), (r0, 0), (16, BK), (1, 0))
    b_dq += tl.load(p_dq, boundary_check=(0, 1))
    b_dk += tl.load(p_dk, boundary_check=(0, 1))
    tl.store(p_dg, tl.load(p_dg, boundary_check=(0, 1)) + b_dg, boundary_check=(0, 1))
    if OUT16:
        p_dq16 = tl.make_block_ptr(dq16, (T, K), (H * K, 1), (r0, 0), (16, BK), (1, 0))
        p_dk16 = tl.make_block_ptr(dk16, (T, K), (H * K, 1), (r0, 0), (16, BK), (1, 0))
        if fast:
            tl.store(p_dq16, b_dq.to(p_dq16.dtype.element_ty), boundary_check=(0, 1))
            tl.store(p_dk16, b_dk.to(p_dk16.dtype.element_ty), boundary_check=(0, 1))
        else:
            tl.store(p_dq, b_dq, boundary_check=(0, 1))
            tl.store(p_dk, b_dk, boundary_check=(0, 1))
    else:
        tl.store(p_dq, b_dq, boundary_check=(0, 1))
        tl.store(p_dk, b_dk, boundary_check=(0, 1))
    if not fast:
        # the pairwise part reads back the rows of dq, dk, dg that other threads have just stored
        tl.debug_barrier()
        _diag_exact_bwd(q, k, g, dq, dk, dg, b_dqk, b_dkk, T, r0, HK, H, K)
        if OUT16:
            tl.debug_barrier()
            tl.store(p_dq16, tl.load(p_dq, boundary_check=(0, 1)).to(p_dq16.dtype.element_ty), boundary_check=(0, 1))
            tl.store(p_dk16, tl.load(p_dk, boundary_check=(0, 1)).to(p_dk16.dtype.element_ty), boundary_check=(0, 1))
    return b_x0, b_x1, b_x2


@triton.jit
def intra_bwd_kernel(q, k, g, dAqk, dAkk, dq, dk, dg, dq16, dk16, cu_seqlens, chunk_indices, H: tl.constexpr,
                     HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr,
                     OFF_P: tl.constexpr = "", OUT16: tl.constexpr = False):
    """dq, dk, dg (float32, per value head [T, H, K]) arrive with the other stages' parts and are updated.

    Row blocks from the last to the first: block r's rows take sum_c dA_rc C_rc (C_rc = k_c exp(R_r - G_c))
    times exp(G_r - R_r); its (dA_rc^T q_r e_r + ...) exp(R_r - G_c) go to column block c's running sum,
    complete by the time block c's own rows come.
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    t0 = i_t * BT
    q += (bos * HK + i_h // (H // HK)) * K
    k += (bos * HK + i_h // (H // HK)) * K
    g += (bos * H + i_h) * K
    dAqk += (bos * H + i_h) * BT
    dAkk += (bos * H + i_h) * BT
    dq += (bos * H + i_h) * K
    dk += (bos * H + i_h) * K
    dg += (bos * H + i_h) * K
    if OUT16:
        dq16 += (bos * H + i_h) * K
        dk16 += (bos * H + i_h) * K
    b_x0 = tl.zeros([16, BK], dtype=tl.float32)
    b_x1, b_x2 = b_x0, b_x0
    for i in tl.static_range(4):
        b_x0, b_x1, b_x2 = _bwd_row(q, k, g, dAqk, dAkk, dq, dk, dg, dq16, dk16, b_x0, b_x1, b_x2, T, t0, 3 - i,
                                    HK, H, K, BK, BT, SPAN, OFF_P, OUT16)


# the fused solve's diagonal blocks as products of powers (``kkt_solve.invert_unit_lower16_products``) at this
# precision, not by substitution, whose row reductions cross the program's 4 warps ("": substitution), for Ai
# stored in these dtypes only. The products cancel where A is large: their fp32 error in a diagonal block (relative
# to its largest entry, 16 x 16, float64 truth) is <= 1.3e-5 at beta <= 1, but 1.5e-3 at beta <= 2
# (allow_neg_eigval) with near-parallel keys and no decay, where substitution keeps 4e-7. Under bf16's rounding of
# the stored Ai (3.9e-3) that is tolerable; fp16 (4.9e-4) and fp32 substitute.
SOLVE_PRODUCTS = "ieee"
SOLVE_PRODUCTS_DTYPES = (torch.bfloat16,)


def intra_fwd(q, k, g_cum, chunks: Chunks, *, num_warps: int | None = None, g=None, beta=None, store_akk=True):
    """q, k: [1, T, HK, K]; g_cum: [1, T, H, K] -> (Aqk in q's dtype, Akk float32), [1, T, H, BT]
    (no scale, no beta). With the raw log gate ``g`` [1, T, H, K] instead (``g_cum`` None), the kernel
    forms the chunk sums itself (no ``chunk_cumsum`` pass before it) and returns (Aqk, Akk, g_cum), g_cum
    fp32 as ``chunk_cumsum(g)``. With ``beta`` [1, T, H]: also the solve's Ai = (I + Diag(beta)
    Akk)^{-1} [1, T, H, BT] in k's dtype (``kkt_solve.solve``'s), appended to the tuple, from Akk's
    blocks in registers; Akk is then None unless ``store_akk`` (the backward reads it)."""
    if (g_cum is None) == (g is None):
        raise ValueError("intra_fwd: give the gate sums `g_cum` or the raw log gate `g`, not both")
    _, T, HK, K = k.shape
    H = (g_cum if g is None else g).shape[2]
    f32 = dict(dtype=torch.float32, device=k.device)
    sums = g is not None
    if sums:
        g = g.contiguous()
        g_cum = alloc(g.shape, **f32)
    solve = beta is not None
    if solve and tuple(beta.shape) != (1, T, H):
        raise ValueError(f"intra_fwd: `beta` must be [1, T, H] = [1, {T}, {H}], got {tuple(beta.shape)}")
    if solve:
        beta = beta.contiguous()  # the kernel reads it with strides (H, 1)
    products = (SOLVE_PRODUCTS or None) if solve and k.dtype in SOLVE_PRODUCTS_DTYPES else None
    store_akk = store_akk or not solve
    Aqk = alloc((1, T, H, chunks.BT), dtype=q.dtype, device=k.device)
    Akk = alloc((1, T, H, chunks.BT), **f32) if store_akk else None
    Ai = alloc((1, T, H, chunks.BT), dtype=k.dtype, device=k.device) if solve else None
    intra_fwd_kernel[(chunks.NC, H)](q, k, g_cum, g if sums else g_cum, Aqk, Akk, beta, Ai, chunks.cu_seqlens,
                                     chunks.chunk_indices, H=H, HK=HK, K=K, BT=chunks.BT,
                                     BK=max(16, triton.next_power_of_2(K)), SPAN=SAFE_SPAN,
                                     DIAG_PRECISION=_diag_precision(q.dtype), GATE_SUMS=sums, SOLVE=solve,
                                     STORE_KK=store_akk, MERGE_PRECISION=merge_precision(k.dtype),
                                     PRODUCTS=products,
                                     num_warps=num_warps or _warps(K)[0])
    return (Aqk, Akk) + ((g_cum,) if sums else ()) + ((Ai,) if solve else ())


def intra_bwd(q, k, g_cum, dAqk, dAkk, dq, dk, dg, chunks: Chunks, *, num_warps: int | None = None,
              num_stages: int = 2, out_dtype: torch.dtype | None = None):
    """Adds the intra-chunk parts into dq, dk, dg (float32 [1, T, H, K], in place). dAqk, dAkk:
    [1, T, H, BT], read on and below the diagonal (i >= j, i > j). num_warps (None: ``_warps``) and
    num_stages: the launch, for benchmark variants. ``out_dtype``: returns the final dq, dk in it (new
    tensors, each rounded once from the fp32 sums: what a cast after would give, without reading the
    fp32 buffers back from memory; dq, dk are then left partial where the diagonal block was factored)."""
    _, T, HK, K = k.shape
    H = g_cum.shape[2]
    out = out_dtype is not None
    dq16 = torch.empty(dq.shape, dtype=out_dtype, device=dq.device) if out else None
    dk16 = torch.empty(dk.shape, dtype=out_dtype, device=dk.device) if out else None
    intra_bwd_kernel[(chunks.NC, H)](q, k, g_cum, dAqk, dAkk, dq, dk, dg, dq16 if out else dq, dk16 if out else dk,
                                     chunks.cu_seqlens, chunks.chunk_indices,
                                     H=H, HK=HK, K=K, BT=chunks.BT, BK=max(16, triton.next_power_of_2(K)),
                                     SPAN=SAFE_SPAN, OFF_P=_off_precision(q.dtype), OUT16=out,
                                     num_warps=num_warps or _warps(K)[1], num_stages=num_stages)
    return (dq16, dk16) if out else None
