"""The UT transform's matrix: T = (I + A)^{-1} with A = strictLower(Diag(beta) (Gamma * K K^T)).

Per chunk of BT = 64 tokens (local index i, j; ``g`` the chunk-local cumsum of the log gate):

    A_ij  = beta_i (k_i . k_j) exp(g_i - g_j)     i > j, else 0     (USE_G; Gamma = 1 without)
    Ai    = (I + A)^{-1}                           unit lower triangular

The solve: the chunk is cut into 4 blocks of 16; each diagonal block is inverted by forward
substitution (row i of the inverse from rows < i), then the blocks are merged,
block forward substitution on the 4 x 4 block matrix:

    Ai_rr = (I + A_rr)^{-1}       Ai_rc = -Ai_rr sum_{c <= m < r} A_rm Ai_mc      (r > c)

The substitution is exact fp32; the merge's dots are too for fp32 inputs, and run on the tensor
cores for 16-bit ones (``merge_precision``: 3 x TF32 for fp16, TF32 for bf16, whose Ai is stored
in bf16, 8 times coarser than one TF32 rounding).

Output: ``Ai`` [1, T, H, BT] (solved in float32, stored in k's dtype; row t holds its chunk's
row of the inverse; the columns
are the chunk's tokens). W = Ai Diag(beta gamma) K and U = Ai Diag(beta) V are formed here from the
inverse's blocks where ``delta.SOLVE_WU`` applies (``kkt_solve(v=...)``, ``solve(wu=...)``), else in ``wy.py``;
the backward of this stage (dA = -Ai^T dAi Ai^T and the chain to k, beta, g) is there too,
where dAi is formed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, alloc, exp, mm
from fastweight.kernels.decay_intra import diag_precision

BT_DELTA = 64
# 16 x 16 blocks: one warp keeps the substitution's row reductions inside the warp
# (H200, GDN (4, 8192, 16, 128): 0.244 ms with 1 warp, 0.309 with 2, 0.552 with 4)
SOLVE_WARPS = 1


@triton.jit
def _substitute_row(b_Y, i, o_i):
    """Row i of (I + A)^{-1} - I from the rows above it (b_Y holds -A below row i)."""
    b_a = tl.sum(tl.where(o_i[:, None] == i, b_Y, 0.), 0)
    b_a = b_a + tl.sum(b_a[:, None] * b_Y, 0)
    return tl.where(o_i[:, None] == i, b_a[None, :], b_Y)


@triton.jit
def _substitute_col(b_Z, b_N, i, o_i):
    """Column i of Z = ((I + A)^{-1} - I)^T from the columns before it (b_N = -A; Z starts as -A^T).
    Row i of (I + A)^{-1} - I is y_i + sum_{j < i} y_i[j] Y_j (y_i = row i of -A, Y_j the finished
    row j): held transposed, y_i indexes Z's columns and the sum comes out along its rows, so no
    vector changes layout."""
    b_y = tl.sum(tl.where(o_i[:, None] == i, b_N, 0.), 0)
    b_x = tl.sum(b_Z * b_y[None, :], 1)
    return tl.where(o_i[None, :] == i, b_Z + b_x[:, None], b_Z)


@triton.jit
def invert_unit_lower16x4(b_A1, b_A2, b_A3, b_A4, TRANSPOSED: tl.constexpr = False):
    """(I + A)^{-1} for four strictly lower [16, 16] blocks, by forward substitution, interleaved.
    TRANSPOSED: the inverse built by columns of its transpose (``_substitute_col``): a third fewer
    instructions a step (249 against 366 on sm_90), but two matrices a block held in registers."""
    o_i = tl.arange(0, 16)
    if TRANSPOSED:
        b_I = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
        b_N1, b_N2, b_N3, b_N4 = -b_A1, -b_A2, -b_A3, -b_A4
        b_Z1, b_Z2, b_Z3, b_Z4 = tl.trans(b_N1), tl.trans(b_N2), tl.trans(b_N3), tl.trans(b_N4)
        for i in range(1, 16):
            b_Z1 = _substitute_col(b_Z1, b_N1, i, o_i)
            b_Z2 = _substitute_col(b_Z2, b_N2, i, o_i)
            b_Z3 = _substitute_col(b_Z3, b_N3, i, o_i)
            b_Z4 = _substitute_col(b_Z4, b_N4, i, o_i)
        return tl.trans(b_Z1) + b_I, tl.trans(b_Z2) + b_I, tl.trans(b_Z3) + b_I, tl.trans(b_Z4) + b_I
    b_Y1, b_Y2, b_Y3, b_Y4 = -b_A1, -b_A2, -b_A3, -b_A4
    for i in range(1, 16):
        b_Y1 = _substitute_row(b_Y1, i, o_i)
        b_Y2 = _substitute_row(b_Y2, i, o_i)
        b_Y3 = _substitute_row(b_Y3, i, o_i)
        b_Y4 = _substitute_row(b_Y4, i, o_i)
    b_I = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
    return b_Y1 + b_I, b_Y2 + b_I, b_Y3 + b_I, b_Y4 + b_I


@triton.jit
def invert_unit_lower16_products(b_A, P: tl.constexpr):
    """(I + A)^{-1} for a strictly lower [16, 16] A as (I - A)(I + A^2)(I + A^4)(I + A^8) (A^16 = 0): six
    dependent dots at precision P instead of 15 dependent row reductions, for programs of several warps,
    where a reduction crosses warps."""
    o_i = tl.arange(0, 16)
    b_I = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
    b_A2 = tl.dot(b_A, b_A, input_precision=P)
    b_A4 = tl.dot(b_A2, b_A2, input_precision=P)
    b_A8 = tl.dot(b_A4, b_A4, input_precision=P)
    b_X = tl.dot(b_I - b_A, b_I + b_A2, input_precision=P)
    b_X = tl.dot(b_X, b_I + b_A4, input_precision=P)
    return tl.dot(b_X, b_I + b_A8, input_precision=P)


@triton.jit
def _gamma(g, gr, bos, T, H: tl.constexpr, i_h, r0, c0, USE_G: tl.constexpr, STRICT: tl.constexpr):
    """Mask (strict lower or full) times exp(gr_i - g_j) for rows r0.. and columns c0.. (16 each)."""
    o_r, o_c = r0 + tl.arange(0, 16), c0 + tl.arange(0, 16)
    m = (o_r[:, None] < T) & (o_c[None, :] < T)
    if STRICT:
        m = m & (o_r[:, None] > o_c[None, :])
    if USE_G:
        b_gr = tl.load(gr + (bos + o_r) * H + i_h, mask=o_r < T, other=0.)
        b_gc = tl.load(g + (bos + o_c) * H + i_h, mask=o_c < T, other=0.)
        return tl.exp(tl.where(m, b_gr[:, None] - b_gc[None, :], float("-inf")))
    return tl.where(m, 1., 0.)


@triton.jit
def kkt_solve_kernel(k, p, beta, g, gr, Ai, q, Aqk, v, w, u, cu_seqlens, chunk_indices, H: tl.constexpr,
                     HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     USE_G: tl.constexpr, USE_P: tl.constexpr, MERGE_PRECISION: tl.constexpr, FOLD_BETA: tl.constexpr,
                     QK: tl.constexpr, WU: tl.constexpr):
    """Rows read with p and the gate gr (USE_P: Comba's read key and its exclusive cumsum), columns
    with k and g; without USE_P both are k and g. FOLD_BETA: stores Ai Diag(beta). QK: also stores
    the output's scores, lower(Gamma * Q K^T) (``_store_qk``), first, so that nothing of theirs is
    live through the solve. WU: also W = Ai Diag(beta gamma) K and U = Ai Diag(beta) V (``wy.py``'s
    forward) from the inverse's blocks while they are in registers (``_store_wu``)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    t0 = i_t * BT
    k += (bos * HK + i_h // (H // HK)) * K
    p += (bos * HK + i_h // (H // HK)) * K
    if QK:
        q += (bos * HK + i_h // (H // HK)) * K
        _store_qk(q, k, g, Aqk + (bos * H + i_h) * BT, bos, T, t0, i_h, H, HK, K, BT, BK, USE_G)
    b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44 = _lower_blocks(p, k, T, t0, HK, K, BK,
                                                                                        not USE_P)
    b_b1 = load_beta16(beta, bos, T, t0, H, i_h)
    b_b2 = load_beta16(beta, bos, T, t0 + 16, H, i_h)
    b_b3 = load_beta16(beta, bos, T, t0 + 32, H, i_h)
    b_b4 = load_beta16(beta, bos, T, t0 + 48, H, i_h)
    b_A11 *= b_b1 * _gamma(g, gr, bos, T, H, i_h, t0, t0, USE_G, True)
    b_A21 *= b_b2 * _gamma(g, gr, bos, T, H, i_h, t0 + 16, t0, USE_G, False)
    b_A22 *= b_b2 * _gamma(g, gr, bos, T, H, i_h, t0 + 16, t0 + 16, USE_G, True)
    b_A31 *= b_b3 * _gamma(g, gr, bos, T, H, i_h, t0 + 32, t0, USE_G, False)
    b_A32 *= b_b3 * _gamma(g, gr, bos, T, H, i_h, t0 + 32, t0 + 16, USE_G, False)
    b_A33 *= b_b3 * _gamma(g, gr, bos, T, H, i_h, t0 + 32, t0 + 32, USE_G, True)
    b_A41 *= b_b4 * _gamma(g, gr, bos, T, H, i_h, t0 + 48, t0, USE_G, False)
    b_A42 *= b_b4 * _gamma(g, gr, bos, T, H, i_h, t0 + 48, t0 + 16, USE_G, False)
    b_A43 *= b_b4 * _gamma(g, gr, bos, T, H, i_h, t0 + 48, t0 + 32, USE_G, False)
    b_A44 *= b_b4 * _gamma(g, gr, bos, T, H, i_h, t0 + 48, t0 + 48, USE_G, True)
    if FOLD_BETA:
        store_solved(b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44,
                     Ai + (bos * H + i_h) * BT, T, t0, H, BT, MERGE_PRECISION, True,
                     tl.trans(b_b1), tl.trans(b_b2), tl.trans(b_b3), tl.trans(b_b4))
    elif WU:
        b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41, b_I42, b_I43, b_I44 = solved_blocks(
            b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44, MERGE_PRECISION)
        store_lower_blocks(Ai + (bos * H + i_h) * BT, T, t0, H, BT, b_I11, b_I21, b_I22, b_I31, b_I32, b_I33,
                           b_I41, b_I42, b_I43, b_I44)
        # the separate stage's operands: Ai as stored, rows scaled and rounded to k's dtype
        dt = k.dtype.element_ty
        b_s1 = b_b1 * _gamma_rows(g, bos, T, H, i_h, t0, USE_G)
        b_s2 = b_b2 * _gamma_rows(g, bos, T, H, i_h, t0 + 16, USE_G)
        b_s3 = b_b3 * _gamma_rows(g, bos, T, H, i_h, t0 + 32, USE_G)
        b_s4 = b_b4 * _gamma_rows(g, bos, T, H, i_h, t0 + 48, USE_G)
        _store_wu(k, w + (bos * H + i_h) * K, T, t0, HK * K, H * K, K, b_I11.to(dt), b_I21.to(dt), b_I22.to(dt),
                  b_I31.to(dt), b_I32.to(dt), b_I33.to(dt), b_I41.to(dt), b_I42.to(dt), b_I43.to(dt), b_I44.to(dt),
                  b_s1, b_s2, b_s3, b_s4)
        _store_wu(v + (bos * H + i_h) * V, u + (bos * H + i_h) * V, T, t0, H * V, H * V, V, b_I11.to(dt),
                  b_I21.to(dt), b_I22.to(dt), b_I31.to(dt), b_I32.to(dt), b_I33.to(dt), b_I41.to(dt), b_I42.to(dt),
                  b_I43.to(dt), b_I44.to(dt), b_b1, b_b2, b_b3, b_b4)
    else:
        store_solved(b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44,
                     Ai + (bos * H + i_h) * BT, T, t0, H, BT, MERGE_PRECISION)


@triton.jit
def _gamma_rows(g, bos, T, H: tl.constexpr, i_h, r0, USE_G: tl.constexpr):
    """exp(g) of rows r0 .. r0 + 15 as [16, 1] (1 without USE_G)."""
    if USE_G:
        o_t = r0 + tl.arange(0, 16)
        return exp(tl.load(g + (bos + o_t) * H + i_h, mask=o_t < T, other=0.))[:, None]
    return tl.full([16, 1], 1., dtype=tl.float32)


@triton.jit
def _rows_scaled(x, T, r0, c0, HD: tl.constexpr, D: tl.constexpr, b_s):
    """Rows r0 .. r0 + 15, columns c0 .. c0 + 31 of x (rows HD apart) times b_s [16, 1], in x's dtype."""
    p = tl.make_block_ptr(x, (T, D), (HD, 1), (r0, c0), (16, 32), (1, 0))
    b_x = tl.load(p, boundary_check=(0, 1))
    return (b_x * b_s).to(b_x.dtype)


@triton.jit
def _store_wu(x, y, T, t0, HX: tl.constexpr, HY: tl.constexpr, D: tl.constexpr, b_I11, b_I21, b_I22, b_I31, b_I32,
              b_I33, b_I41, b_I42, b_I43, b_I44, b_s1, b_s2, b_s3, b_s4):
    """y = Ai Diag(s) x over a chunk (rows of x HX apart, of y HY apart), 16 rows and 32 columns at a
    time: y_r = sum_{c <= r} Ai_rc (s_c x_c), as ``wy.recompute_w_u_kernel`` forms it in one [64, 64] dot."""
    for c0 in range(0, D, 32):
        b_x1 = _rows_scaled(x, T, t0, c0, HX, D, b_s1)
        p = tl.make_block_ptr(y, (T, D), (HY, 1), (t0, c0), (16, 32), (1, 0))
        tl.store(p, mm(b_I11, b_x1).to(p.dtype.element_ty), boundary_check=(0, 1))
        b_x2 = _rows_scaled(x, T, t0 + 16, c0, HX, D, b_s2)
        p = tl.make_block_ptr(y, (T, D), (HY, 1), (t0 + 16, c0), (16, 32), (1, 0))
        tl.store(p, (mm(b_I21, b_x1) + mm(b_I22, b_x2)).to(p.dtype.element_ty), boundary_check=(0, 1))
        b_x3 = _rows_scaled(x, T, t0 + 32, c0, HX, D, b_s3)
        p = tl.make_block_ptr(y, (T, D), (HY, 1), (t0 + 32, c0), (16, 32), (1, 0))
        tl.store(p, (mm(b_I31, b_x1) + mm(b_I32, b_x2) + mm(b_I33, b_x3)).to(p.dtype.element_ty),
                 boundary_check=(0, 1))
        b_x4 = _rows_scaled(x, T, t0 + 48, c0, HX, D, b_s4)
        p = tl.make_block_ptr(y, (T, D), (HY, 1), (t0 + 48, c0), (16, 32), (1, 0))
        tl.store(p, (mm(b_I41, b_x1) + mm(b_I42, b_x2) + mm(b_I43, b_x3) + mm(b_I44, b_x4)).to(p.dtype.element_ty),
                 boundary_check=(0, 1))


@triton.jit
def _lower_blocks(p, k, T, t0, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, SAME: tl.constexpr):
    """The ten [16, 16] blocks on and below the diagonal of P K^T over a chunk's rows t0.. (SAME: p is
    k, read once)."""
    b_A11 = tl.zeros([16, 16], dtype=tl.float32)
    b_A21, b_A22 = tl.zeros([16, 16], dtype=tl.float32), tl.zeros([16, 16], dtype=tl.float32)
    b_A31, b_A32, b_A33 = b_A11, b_A11, b_A11
    b_A41, b_A42, b_A43, b_A44 = b_A11, b_A11, b_A11, b_A11
    for i_k in range(tl.cdiv(K, BK)):
        b_k1, b_k2, b_k3, b_k4 = _rows16x4(k, T, t0, i_k, HK, K, BK)
        b_p1, b_p2, b_p3, b_p4 = b_k1, b_k2, b_k3, b_k4
        if not SAME:
            b_p1, b_p2, b_p3, b_p4 = _rows16x4(p, T, t0, i_k, HK, K, BK)
        b_A11 += mm(b_p1, tl.trans(b_k1))
        b_A21 += mm(b_p2, tl.trans(b_k1))
        b_A22 += mm(b_p2, tl.trans(b_k2))
        b_A31 += mm(b_p3, tl.trans(b_k1))
        b_A32 += mm(b_p3, tl.trans(b_k2))
        b_A33 += mm(b_p3, tl.trans(b_k3))
        b_A41 += mm(b_p4, tl.trans(b_k1))
        b_A42 += mm(b_p4, tl.trans(b_k2))
        b_A43 += mm(b_p4, tl.trans(b_k3))
        b_A44 += mm(b_p4, tl.trans(b_k4))
    return b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44


@triton.jit
def _rows16x4(x, T, t0, i_k, HK: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Key block i_k of a chunk's rows as four [16, BK] tiles."""
    p_1 = tl.make_block_ptr(x, (T, K), (HK * K, 1), (t0, i_k * BK), (16, BK), (1, 0))
    p_2 = tl.make_block_ptr(x, (T, K), (HK * K, 1), (t0 + 16, i_k * BK), (16, BK), (1, 0))
    p_3 = tl.make_block_ptr(x, (T, K), (HK * K, 1), (t0 + 32, i_k * BK), (16, BK), (1, 0))
    p_4 = tl.make_block_ptr(x, (T, K), (HK * K, 1), (t0 + 48, i_k * BK), (16, BK), (1, 0))
    return (tl.load(p_1, boundary_check=(0, 1)), tl.load(p_2, boundary_check=(0, 1)),
            tl.load(p_3, boundary_check=(0, 1)), tl.load(p_4, boundary_check=(0, 1)))


@triton.jit
def _store_qk(q, k, g, Aqk, bos, T, t0, i_h, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr):
    """Stores the chunk's output scores lower(Gamma * Q K^T) [BT, BT] (Gamma_ij = exp(g_i - g_j),
    i >= j; 1 without USE_G) in Aqk's dtype, zeros above the diagonal, 16 rows at a time: a [16, W]
    accumulator, W the columns the rows reach (the first half's rows need half of them). Ten
    [16, 16] blocks, as the solve's, spilled in the one-warp kernel (sm_90: 280-536 B of stack).
    The inference state pass reads the scores instead of forming them on its serial path
    (``state._fwd_step``, QK_GIVEN)."""
    for r in range(0, BT // 32):
        _store_qk_rows(q, k, g, Aqk, bos, T, t0, t0 + r * 16, i_h, H, HK, K, BT, BK, BT // 2, USE_G)
    for r in range(BT // 32, BT // 16):
        _store_qk_rows(q, k, g, Aqk, bos, T, t0, t0 + r * 16, i_h, H, HK, K, BT, BK, BT, USE_G)


@triton.jit
def _store_qk_rows(q, k, g, Aqk, bos, T, t0, r0, i_h, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, W: tl.constexpr, USE_G: tl.constexpr):
    """Rows r0 .. r0 + 15 of ``_store_qk``'s scores over the chunk's first W columns (zeros in the rest)."""
    o_r, o_c = r0 + tl.arange(0, 16), t0 + tl.arange(0, W)
    b_s = tl.zeros([16, W], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_q = tl.make_block_ptr(q, (T, K), (HK * K, 1), (r0, i_k * BK), (16, BK), (1, 0))
        p_kt = tl.make_block_ptr(k, (K, T), (1, HK * K), (i_k * BK, t0), (BK, W), (0, 1))
        b_s += mm(tl.load(p_q, boundary_check=(0, 1)), tl.load(p_kt, boundary_check=(0, 1)))
    m = (o_r[:, None] >= o_c[None, :]) & (o_c < T)[None, :]
    if USE_G:
        b_gr = tl.load(g + (bos + o_r) * H + i_h, mask=o_r < T, other=0.)
        b_gc = tl.load(g + (bos + o_c) * H + i_h, mask=o_c < T, other=0.)
        b_s = b_s * exp(tl.where(m, b_gr[:, None] - b_gc[None, :], float("-inf")))
    else:
        b_s = tl.where(m, b_s, 0.)
    p_A = tl.make_block_ptr(Aqk, (T, BT), (H * BT, 1), (r0, 0), (16, W), (1, 0))
    tl.store(p_A, b_s.to(p_A.dtype.element_ty), boundary_check=(0, 1))
    if W < BT:
        p_0 = tl.make_block_ptr(Aqk, (T, BT), (H * BT, 1), (r0, W), (16, BT - W), (1, 0))
        tl.store(p_0, tl.zeros([16, BT - W], dtype=tl.float32).to(p_0.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def solve_kernel(Akk, beta, Ai, k, v, gk, q, w, u, qg, kd, cu_seqlens, chunk_indices, H: tl.constexpr,
                 HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, MERGE_PRECISION: tl.constexpr,
                 WU: tl.constexpr):
    """Ai = (I + Diag(beta) Akk)^{-1} for an Akk already formed (strictly lower, [T, H, BT], e.g. by intra.py).
    WU (KDA's per-channel gate gk, the chunk-local cumsum [T, H, K]): also W = Ai Diag(beta) (K * exp(G)),
    U = Ai Diag(beta) V and the state pass's gated rows qg = q exp(G), kd = k exp(G_C - G)
    (``wy.recompute_w_u``'s), from the inverse's blocks in registers (``_store_w_gated``, ``_store_wu``)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    t0 = i_t * BT
    Akk += (bos * H + i_h) * BT
    b_b1 = load_beta16(beta, bos, T, t0, H, i_h)
    b_b2 = load_beta16(beta, bos, T, t0 + 16, H, i_h)
    b_b3 = load_beta16(beta, bos, T, t0 + 32, H, i_h)
    b_b4 = load_beta16(beta, bos, T, t0 + 48, H, i_h)
    o_i = tl.arange(0, 16)
    m_strict = o_i[:, None] > o_i[None, :]
    b_A11 = tl.where(m_strict, _load16(Akk, T, t0, 0, H, BT), 0.) * b_b1
    b_A21 = _load16(Akk, T, t0 + 16, 0, H, BT) * b_b2
    b_A22 = tl.where(m_strict, _load16(Akk, T, t0 + 16, 16, H, BT), 0.) * b_b2
    b_A31 = _load16(Akk, T, t0 + 32, 0, H, BT) * b_b3
    b_A32 = _load16(Akk, T, t0 + 32, 16, H, BT) * b_b3
    b_A33 = tl.where(m_strict, _load16(Akk, T, t0 + 32, 32, H, BT), 0.) * b_b3
    b_A41 = _load16(Akk, T, t0 + 48, 0, H, BT) * b_b4
    b_A42 = _load16(Akk, T, t0 + 48, 16, H, BT) * b_b4
    b_A43 = _load16(Akk, T, t0 + 48, 32, H, BT) * b_b4
    b_A44 = tl.where(m_strict, _load16(Akk, T, t0 + 48, 48, H, BT), 0.) * b_b4
    if WU:
        b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41, b_I42, b_I43, b_I44 = solved_blocks(
            b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44, MERGE_PRECISION)
        store_lower_blocks(Ai + (bos * H + i_h) * BT, T, t0, H, BT, b_I11, b_I21, b_I22, b_I31, b_I32, b_I33,
                           b_I41, b_I42, b_I43, b_I44)
        dt = k.dtype.element_ty
        b_I11, b_I21, b_I22, b_I31, b_I32 = b_I11.to(dt), b_I21.to(dt), b_I22.to(dt), b_I31.to(dt), b_I32.to(dt)
        b_I33, b_I41, b_I42, b_I43, b_I44 = b_I33.to(dt), b_I41.to(dt), b_I42.to(dt), b_I43.to(dt), b_I44.to(dt)
        kh = (bos * HK + i_h // (H // HK)) * K
        vh = (bos * H + i_h)
        _store_w_gated(k + kh, q + kh, gk + vh * K, w + vh * K, qg + vh * K, kd + vh * K, T, t0, HK * K, H * K, K,
                       b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41, b_I42, b_I43, b_I44, b_b1, b_b2, b_b3, b_b4)
        _store_wu(v + vh * V, u + vh * V, T, t0, H * V, H * V, V, b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41,
                  b_I42, b_I43, b_I44, b_b1, b_b2, b_b3, b_b4)
    else:
        store_solved(b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44,
                     Ai + (bos * H + i_h) * BT, T, t0, H, BT, MERGE_PRECISION)


@triton.jit
def _gated_rows(k, q, gk, qg, kd, T, r0, c0, b_glast, HX: tl.constexpr, HY: tl.constexpr, D: tl.constexpr, b_s):
    """Rows r0 .. r0 + 15, columns c0 .. c0 + 31: stores qg = q exp(G) and kd = k exp(G_C - G) (0 past
    the end) and returns k Diag-scaled for W, (b_s k exp(G)) in k's dtype (``wy.recompute_w_u_kernel``'s
    operands, rounded as it rounds them)."""
    p_k = tl.make_block_ptr(k, (T, D), (HX, 1), (r0, c0), (16, 32), (1, 0))
    p_q = tl.make_block_ptr(q, (T, D), (HX, 1), (r0, c0), (16, 32), (1, 0))
    p_g = tl.make_block_ptr(gk, (T, D), (HY, 1), (r0, c0), (16, 32), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    b_g = tl.load(p_g, boundary_check=(0, 1))
    m_t = (r0 + tl.arange(0, 16)) < T
    p_qg = tl.make_block_ptr(qg, (T, D), (HY, 1), (r0, c0), (16, 32), (1, 0))
    p_kd = tl.make_block_ptr(kd, (T, D), (HY, 1), (r0, c0), (16, 32), (1, 0))
    tl.store(p_qg, (tl.load(p_q, boundary_check=(0, 1)) * exp(b_g)).to(p_qg.dtype.element_ty), boundary_check=(0, 1))
    b_ek = tl.where(m_t[:, None], exp(b_glast[None, :] - b_g), 0.)
    tl.store(p_kd, (b_k * b_ek).to(p_kd.dtype.element_ty), boundary_check=(0, 1))
    return (b_k * b_s * exp(b_g)).to(b_k.dtype)


@triton.jit
def _store_w_gated(k, q, gk, w, qg, kd, T, t0, HX: tl.constexpr, HY: tl.constexpr, D: tl.constexpr, b_I11, b_I21,
                   b_I22, b_I31, b_I32, b_I33, b_I41, b_I42, b_I43, b_I44, b_s1, b_s2, b_s3, b_s4):
    """W = Ai Diag(s) (K * exp(G)) over a chunk with the gated rows (``_gated_rows``), 16 rows and 32
    columns at a time, as ``_store_wu``."""
    o_last = tl.minimum(t0 + 64, T) - 1
    for c0 in range(0, D, 32):
        o_c = c0 + tl.arange(0, 32)
        b_glast = tl.load(gk + o_last * HY + o_c, mask=o_c < D, other=0.)
        b_x1 = _gated_rows(k, q, gk, qg, kd, T, t0, c0, b_glast, HX, HY, D, b_s1)
        p = tl.make_block_ptr(w, (T, D), (HY, 1), (t0, c0), (16, 32), (1, 0))
        tl.store(p, mm(b_I11, b_x1).to(p.dtype.element_ty), boundary_check=(0, 1))
        b_x2 = _gated_rows(k, q, gk, qg, kd, T, t0 + 16, c0, b_glast, HX, HY, D, b_s2)
        p = tl.make_block_ptr(w, (T, D), (HY, 1), (t0 + 16, c0), (16, 32), (1, 0))
        tl.store(p, (mm(b_I21, b_x1) + mm(b_I22, b_x2)).to(p.dtype.element_ty), boundary_check=(0, 1))
        b_x3 = _gated_rows(k, q, gk, qg, kd, T, t0 + 32, c0, b_glast, HX, HY, D, b_s3)
        p = tl.make_block_ptr(w, (T, D), (HY, 1), (t0 + 32, c0), (16, 32), (1, 0))
        tl.store(p, (mm(b_I31, b_x1) + mm(b_I32, b_x2) + mm(b_I33, b_x3)).to(p.dtype.element_ty),
                 boundary_check=(0, 1))
        b_x4 = _gated_rows(k, q, gk, qg, kd, T, t0 + 48, c0, b_glast, HX, HY, D, b_s4)
        p = tl.make_block_ptr(w, (T, D), (HY, 1), (t0 + 48, c0), (16, 32), (1, 0))
        tl.store(p, (mm(b_I41, b_x1) + mm(b_I42, b_x2) + mm(b_I43, b_x3) + mm(b_I44, b_x4)).to(p.dtype.element_ty),
                 boundary_check=(0, 1))


@triton.jit
def load_beta16(beta, bos, T, r0, H: tl.constexpr, i_h):
    """beta at rows r0 .. r0 + 15 of head i_h as a [16, 1] fp32 column (0 past T): the row scale of one
    16-row block of the solve, shared by this file's solves and the fused one in intra.py."""
    o_t = r0 + tl.arange(0, 16)
    return tl.load(beta + (bos + o_t) * H + i_h, mask=o_t < T, other=0.).to(tl.float32)[:, None]


@triton.jit
def _load16(A, T, r0, c0, H: tl.constexpr, BT: tl.constexpr):
    p = tl.make_block_ptr(A, (T, BT), (H * BT, 1), (r0, c0), (16, 16), (1, 0))
    return tl.load(p, boundary_check=(0, 1))


@triton.jit
def _mm(a, b, P: tl.constexpr):
    return tl.dot(a, b, input_precision=P)


@triton.jit
def solved_blocks(b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44, P: tl.constexpr,
                  TRANSPOSED: tl.constexpr = False, PRODUCTS: tl.constexpr = None):
    """The 10 lower [16, 16] blocks of (I + A)^{-1}, A given as its own (the diagonal blocks strictly
    lower): the diagonal blocks by substitution (TRANSPOSED: ``invert_unit_lower16x4``'s column form;
    PRODUCTS, a precision: ``invert_unit_lower16_products``' dots), the rest by the block merge, its dots
    at precision P."""
    if PRODUCTS is not None:
        b_I11 = invert_unit_lower16_products(b_A11, PRODUCTS)
        b_I22 = invert_unit_lower16_products(b_A22, PRODUCTS)
        b_I33 = invert_unit_lower16_products(b_A33, PRODUCTS)
        b_I44 = invert_unit_lower16_products(b_A44, PRODUCTS)
    else:
        b_I11, b_I22, b_I33, b_I44 = invert_unit_lower16x4(b_A11, b_A22, b_A33, b_A44, TRANSPOSED)
    b_I21 = -_mm(b_I22, _mm(b_A21, b_I11, P), P)
    b_I32 = -_mm(b_I33, _mm(b_A32, b_I22, P), P)
    b_I43 = -_mm(b_I44, _mm(b_A43, b_I33, P), P)
    b_I31 = -_mm(b_I33, _mm(b_A31, b_I11, P) + _mm(b_A32, b_I21, P), P)
    b_I42 = -_mm(b_I44, _mm(b_A42, b_I22, P) + _mm(b_A43, b_I32, P), P)
    b_I41 = -_mm(b_I44, _mm(b_A41, b_I11, P) + _mm(b_A42, b_I21, P) + _mm(b_A43, b_I31, P), P)
    return b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41, b_I42, b_I43, b_I44


@triton.jit
def store_solved(b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44,
                 Ai, T, t0, H: tl.constexpr, BT: tl.constexpr, P: tl.constexpr, SCALE_COLUMNS: tl.constexpr = False,
                 b_c1=None, b_c2=None, b_c3=None, b_c4=None, PRODUCTS: tl.constexpr = None):
    """Invert I + A (A given as its 10 lower 16 x 16 blocks) and store the 64 x 64 inverse rows;
    SCALE_COLUMNS: each column block c times b_cc ([1, 16]: the inverse times a diagonal). The
    diagonal blocks are substituted transposed where the columns are scaled (GDN's inference
    forward, H100 (4, 8192, 16, 128) bf16: 0.579 -> 0.557 ms); in the unscaled kernels the row form
    measured faster (GDN fwd+bwd 2.877 against 2.924 ms), docs/bench/delta.md.

    Ai points at the sequence's first row for this head; rows are ``H * BT`` apart.
    """
    b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41, b_I42, b_I43, b_I44 = solved_blocks(
        b_A11, b_A21, b_A22, b_A31, b_A32, b_A33, b_A41, b_A42, b_A43, b_A44, P, SCALE_COLUMNS, PRODUCTS)
    if SCALE_COLUMNS:
        b_I11, b_I21, b_I31, b_I41 = b_I11 * b_c1, b_I21 * b_c1, b_I31 * b_c1, b_I41 * b_c1
        b_I22, b_I32, b_I42 = b_I22 * b_c2, b_I32 * b_c2, b_I42 * b_c2
        b_I33, b_I43, b_I44 = b_I33 * b_c3, b_I43 * b_c3, b_I44 * b_c4
    store_lower_blocks(Ai, T, t0, H, BT, b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41, b_I42, b_I43, b_I44)


@triton.jit
def store_lower_blocks(Ai, T, t0, H: tl.constexpr, BT: tl.constexpr, b_I11, b_I21, b_I22, b_I31, b_I32, b_I33, b_I41,
                       b_I42, b_I43, b_I44):
    """A chunk's 64 x 64 block lower triangular matrix from its ten [16, 16] blocks, zeros above."""
    b_0 = tl.zeros([16, 16], dtype=tl.float32)
    store_row_blocks(Ai, T, t0, H, BT, b_I11, b_0, b_0, b_0)
    store_row_blocks(Ai, T, t0 + 16, H, BT, b_I21, b_I22, b_0, b_0)
    store_row_blocks(Ai, T, t0 + 32, H, BT, b_I31, b_I32, b_I33, b_0)
    store_row_blocks(Ai, T, t0 + 48, H, BT, b_I41, b_I42, b_I43, b_I44)


@triton.jit
def store_row_blocks(Ai, T, r0, H: tl.constexpr, BT: tl.constexpr, b_1, b_2, b_3, b_4):
    """16 rows (r0 ..) of a per-chunk [T, BT] matrix from its four [16, 16] column blocks."""
    p_1 = tl.make_block_ptr(Ai, (T, BT), (H * BT, 1), (r0, 0), (16, 16), (1, 0))
    p_2 = tl.make_block_ptr(Ai, (T, BT), (H * BT, 1), (r0, 16), (16, 16), (1, 0))
    p_3 = tl.make_block_ptr(Ai, (T, BT), (H * BT, 1), (r0, 32), (16, 16), (1, 0))
    p_4 = tl.make_block_ptr(Ai, (T, BT), (H * BT, 1), (r0, 48), (16, 16), (1, 0))
    tl.store(p_1, b_1.to(p_1.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_2, b_2.to(p_2.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_3, b_3.to(p_3.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_4, b_4.to(p_4.dtype.element_ty), boundary_check=(0, 1))


def merge_precision(dtype: torch.dtype) -> str:
    """The merge's [16, 16] dots by the op's input dtype: exact fp32 (ieee) for fp32 inputs, else on
    the tensor cores, as the diagonal sub-chunks (``decay_intra.diag_precision``): 3 x TF32 for fp16,
    TF32 for bf16. The FMA (ieee) form held 255 registers a thread and spilled ~0.8 KB."""
    return diag_precision(dtype)


def kkt_solve(k: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor | None, chunks: Chunks,
              num_warps: int = SOLVE_WARPS, p: torch.Tensor | None = None,
              g_read: torch.Tensor | None = None, fold_beta: bool = False, q: torch.Tensor | None = None,
              v: torch.Tensor | None = None):
    """k: [1, T, HK, K]; beta: [1, T, H] (H a multiple of HK); g_cum: [1, T, H] chunk-local cumsum or None.

    Returns Ai [1, T, H, 64], solved in fp32 and stored in k's dtype (its consumers multiply in that dtype).
    Comba: the rows of A read with ``p`` [1, T, HK, K] and the gate ``g_read`` (the exclusive cumsum):
    A_ij = beta_i (p_i . k_j) exp(g_read_i - g_j). ``fold_beta``: returns Ai Diag(beta) (the inference
    state pass's read, ``state.state_fwd(Ai=..., beta=None)``). ``q`` [1, T, HK, K]: also returns the
    output's scores A_qk [1, T, H, BT] = lower(Gamma * Q K^T) in k's dtype (unscaled; the state
    pass's ``A``), as (Ai, A_qk). ``v`` [1, T, H, V]: also W = Ai Diag(beta gamma) K [1, T, H, K] and
    U = Ai Diag(beta) V [1, T, H, V] in k's dtype (``wy.recompute_w_u``'s, formed from the inverse's
    blocks in the solve's program), as (Ai, W, U); no ``p``, ``q`` or ``fold_beta`` with it."""
    _, T, HK, K = k.shape
    H = beta.shape[2]
    BT = chunks.BT
    assert BT == BT_DELTA
    Ai = alloc((1, T, H, BT), device=k.device, dtype=k.dtype)
    BK = min(64, triton.next_power_of_2(K))
    use_p = p is not None
    if q is not None and (use_p or q.shape != k.shape):
        raise ValueError(f"`q` (the output's scores) needs no `p` and k's shape {tuple(k.shape)}, "
                         f"got {tuple(q.shape)}")
    Aqk = alloc((1, T, H, BT), device=k.device, dtype=k.dtype) if q is not None else None
    wu = v is not None
    if wu and (use_p or q is not None or fold_beta):
        raise ValueError("`v` (W and U in the solve) takes no `p`, `q` or `fold_beta`")
    if wu and (v.dim() != 4 or tuple(v.shape[:3]) != (1, T, H)):
        raise ValueError(f"`v` must be [1, T, H, V] = [1, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[-1] if wu else 0
    w = alloc((1, T, H, K), device=k.device, dtype=k.dtype) if wu else None
    u = alloc((1, T, H, V), device=k.device, dtype=k.dtype) if wu else None
    kkt_solve_kernel[(chunks.NC, H)](k, p if use_p else k, beta, g_cum, g_read if use_p else g_cum, Ai, q, Aqk, v, w,
                                     u, chunks.cu_seqlens, chunks.chunk_indices, H=H, HK=HK, K=K, V=V, BT=BT, BK=BK,
                                     USE_G=g_cum is not None, USE_P=use_p,
                                     MERGE_PRECISION=merge_precision(k.dtype), FOLD_BETA=fold_beta,
                                     QK=q is not None, WU=wu, num_warps=num_warps)
    if wu:
        return Ai, w, u
    return Ai if q is None else (Ai, Aqk)


def solve(Akk: torch.Tensor, beta: torch.Tensor, chunks: Chunks, dtype=torch.float32,
          num_warps: int = SOLVE_WARPS, precision_of: torch.dtype = torch.float32, wu=None):
    """Akk: [1, T, H, 64] strictly lower per chunk (fp32); beta: [1, T, H] -> Ai [1, T, H, 64] in ``dtype``.
    ``wu`` = (k [1, T, HK, K], v [1, T, H, V], gk_cum [1, T, H, K], q [1, T, HK, K]): also W, U and the
    gated rows qg, kd in k's dtype (``wy.recompute_w_u(..., gk_cum=, q=)``'s), as (Ai, W, U, qg, kd)."""
    _, T, H, BT = Akk.shape
    Ai = alloc((1, T, H, BT), device=Akk.device, dtype=dtype)
    if wu is None:
        solve_kernel[(chunks.NC, H)](Akk, beta, Ai, None, None, None, None, None, None, None, None,
                                     chunks.cu_seqlens, chunks.chunk_indices, H=H, HK=H, K=0, V=0, BT=BT,
                                     MERGE_PRECISION=merge_precision(precision_of), WU=False, num_warps=num_warps)
        return Ai
    k, v, gk, q = wu
    HK, K, V = k.shape[2], k.shape[3], v.shape[3]
    if (k.shape[:2] != (1, T) or q.shape != k.shape or tuple(v.shape[:3]) != (1, T, H)
            or tuple(gk.shape) != (1, T, H, K) or H % HK):
        raise ValueError(f"`wu` = (k, v, gk_cum, q) must be [1, T, HK, K], [1, T, H, V], [1, T, H, K], [1, T, HK, K] "
                         f"with T = {T}, H = {H} a multiple of HK; got {[tuple(x.shape) for x in wu]}")
    w, qg, kd = (alloc((1, T, H, K), device=k.device, dtype=k.dtype) for _ in range(3))
    u = alloc((1, T, H, V), device=k.device, dtype=k.dtype)
    solve_kernel[(chunks.NC, H)](Akk, beta, Ai, k, v, gk, q, w, u, qg, kd, chunks.cu_seqlens, chunks.chunk_indices,
                                 H=H, HK=HK, K=K, V=V, BT=BT, MERGE_PRECISION=merge_precision(precision_of), WU=True,
                                 num_warps=num_warps)
    return Ai, w, u, qg, kd
