"""Per-channel decayed products inside a chunk (KDA), forward and backward, overflow-safe.

For a chunk (local rows i, j; ``G`` the chunk-local cumsum of the per-channel log gate, [BT, K]):

    Aqk_ij = sum_d q_id k_jd exp(G_id - G_jd)      i >= j
    Akk_ij = sum_d k_id k_jd exp(G_id - G_jd)      i >  j

exp(G_i) * exp(-G_j) over a whole chunk overflows for strong decays, so the chunk is cut into
4 blocks of 16 rows. Off-diagonal blocks (rows r > columns c) factor through the first row of
block r, ``G_ref``: both ``exp(G_i - G_ref)`` (i >= ref) and ``exp(G_ref - G_j)`` (j < ref) are
<= 1, and the block is one matrix product. A diagonal block is factored the same way, with
fp32 operands, when its decay over 16 rows stays under e^SAFE_SPAN, and otherwise takes the
pairwise differences directly ([16, 16, BK] at a time).

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

from fastweight.kernels.common import SAFE_SPAN, Chunks, alloc, mm

# SPAN (``common.SAFE_SPAN``): a diagonal block whose decay over its 16 rows stays under exp(SPAN) in
# every channel is factored through its first row like the off-diagonal ones (operands up to
# e^40, in fp32 for every input dtype: with bf16 operands KDA's bf16 dg is 4.3x its rounding
# floor on the H200, against 2.2x with the exact form; fp16 interpreter proxy: 6.5x with fp16
# operands, 2.7x with fp32: docs/bench/delta.md, KDA bf16 dg); beyond it the exact pairwise form runs.


@triton.jit
def _span(b_g, b_gref, m_rows):
    """The largest decay (G_ref - G) over a block's valid rows and channels."""
    return tl.max(tl.max(tl.where(m_rows[:, None], b_gref[None, :] - b_g, 0.), 1), 0)


@triton.jit
def _rows(x, T, r0, i_k, HK_STRIDE: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    p = tl.make_block_ptr(x, (T, K), (HK_STRIDE, 1), (r0, i_k * BK), (16, BK), (1, 0))
    return tl.load(p, boundary_check=(0, 1))


@triton.jit
def _ref_row(g, T, r0, i_k, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    o_k = i_k * BK + tl.arange(0, BK)
    return tl.load(g + tl.minimum(r0, T - 1) * H * K + o_k, mask=o_k < K, other=0.)


@triton.jit
def intra_fwd_kernel(q, k, g, Aqk, Akk, cu_seqlens, chunk_indices, H: tl.constexpr, HK: tl.constexpr,
                     K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    t0 = i_t * BT
    q += (bos * HK + i_h // (H // HK)) * K
    k += (bos * HK + i_h // (H // HK)) * K
    g += (bos * H + i_h) * K
    o_i = tl.arange(0, 16)
    for r in tl.static_range(4):
        r0 = t0 + 16 * r
        for c in tl.static_range(4):
            b_qk = tl.zeros([16, 16], dtype=tl.float32)
            b_kk = tl.zeros([16, 16], dtype=tl.float32)
            if c < r:
                for i_k in range(tl.cdiv(K, BK)):
                    b_gref = _ref_row(g, T, r0, i_k, H, K, BK)
                    b_er = tl.exp(tl.where((r0 + o_i < T)[:, None],
                                           _rows(g, T, r0, i_k, H * K, K, BK) - b_gref[None, :], float("-inf")))
                    b_kc = _rows(k, T, t0 + 16 * c, i_k, HK * K, K, BK)
                    b_kc = (b_kc * tl.exp(b_gref[None, :] - _rows(g, T, t0 + 16 * c, i_k, H * K, K, BK))).to(b_kc.dtype)
                    b_qr = (_rows(q, T, r0, i_k, HK * K, K, BK) * b_er).to(b_kc.dtype)
                    b_kr = (_rows(k, T, r0, i_k, HK * K, K, BK) * b_er).to(b_kc.dtype)
                    b_qk += mm(b_qr, tl.trans(b_kc))
                    b_kk += mm(b_kr, tl.trans(b_kc))
            if c == r:
                m_v = r0 + o_i < T
                m_d = (o_i[:, None] >= o_i[None, :]) & m_v[:, None]
                for i_k in range(tl.cdiv(K, BK)):
                    b_g = _rows(g, T, r0, i_k, H * K, K, BK)
                    b_kr = _rows(k, T, r0, i_k, HK * K, K, BK)
                    b_qr = _rows(q, T, r0, i_k, HK * K, K, BK)
                    b_gref = _ref_row(g, T, r0, i_k, H, K, BK)
                    if _span(b_g, b_gref, m_v) < SPAN:
                        # the block's decay fits the factored form: one matrix product
                        b_er = tl.exp(tl.where(m_v[:, None], b_g - b_gref[None, :], float("-inf")))
                        # fp32 operands (products of the input and the exponentials, not rounded back)
                        b_kc = b_kr * tl.exp(tl.where(m_v[:, None], b_gref[None, :] - b_g, float("-inf")))
                        b_qk += mm(b_qr * b_er, tl.trans(b_kc))
                        b_kk += mm(b_kr * b_er, tl.trans(b_kc))
                    else:
                        b_d = tl.where(m_d[:, :, None], b_g[:, None, :] - b_g[None, :, :], float("-inf"))
                        b_ke = b_kr.to(tl.float32)[None, :, :] * tl.exp(b_d)
                        b_qk += tl.sum(b_qr.to(tl.float32)[:, None, :] * b_ke, 2)
                        b_kk += tl.sum(b_kr.to(tl.float32)[:, None, :] * b_ke, 2)
                b_qk = tl.where(m_d, b_qk, 0.)
                b_kk = tl.where(o_i[:, None] > o_i[None, :], b_kk, 0.)
            p_qk = tl.make_block_ptr(Aqk + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (r0, 16 * c), (16, 16), (1, 0))
            p_kk = tl.make_block_ptr(Akk + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (r0, 16 * c), (16, 16), (1, 0))
            tl.store(p_qk, b_qk.to(p_qk.dtype.element_ty), boundary_check=(0, 1))
            tl.store(p_kk, b_kk, boundary_check=(0, 1))


@triton.jit
def intra_bwd_kernel(q, k, g, dAqk, dAkk, dq, dk, dg, cu_seqlens, chunk_indices, H: tl.constexpr,
                     HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPAN: tl.constexpr):
    """dq, dk, dg (float32, per value head [T, H, K]) arrive with the other stages' parts and are updated."""
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
    o_i = tl.arange(0, 16)
    for i_k in range(tl.cdiv(K, BK)):
        for b in tl.static_range(4):
            b0 = t0 + 16 * b
            b_gb = _rows(g, T, b0, i_k, H * K, K, BK)
            b_qb = _rows(q, T, b0, i_k, HK * K, K, BK)
            b_kb = _rows(k, T, b0, i_k, HK * K, K, BK)
            b_dq = tl.zeros([16, BK], dtype=tl.float32)
            b_dkr = tl.zeros([16, BK], dtype=tl.float32)
            b_dkc = tl.zeros([16, BK], dtype=tl.float32)
            # block b as rows, against column blocks c < b (reference: b's first row)
            b_gref = _ref_row(g, T, b0, i_k, H, K, BK)
            for c in tl.static_range(4):
                if c < b:
                    b_kc = _rows(k, T, t0 + 16 * c, i_k, HK * K, K, BK)
                    b_kc = (b_kc * tl.exp(b_gref[None, :] - _rows(g, T, t0 + 16 * c, i_k, H * K, K, BK))).to(b_kc.dtype)
                    b_dqk = _rows(dAqk, T, b0, c, H * BT, BT, 16).to(b_kc.dtype)
                    b_dkk = _rows(dAkk, T, b0, c, H * BT, BT, 16).to(b_kc.dtype)
                    b_dq += mm(b_dqk, b_kc)
                    b_dkr += mm(b_dkk, b_kc)
            m_b = (b0 + o_i) < T
            b_er = tl.exp(tl.where(m_b[:, None], b_gb - b_gref[None, :], float("-inf")))
            b_dq *= b_er
            b_dkr *= b_er
            # block b as columns, against row blocks r > b (reference: r's first row)
            for r in tl.static_range(4):
                if r > b:
                    b_gr_ref = _ref_row(g, T, t0 + 16 * r, i_k, H, K, BK)
                    b_er2 = tl.exp(tl.where((t0 + 16 * r + o_i < T)[:, None],
                                            _rows(g, T, t0 + 16 * r, i_k, H * K, K, BK) - b_gr_ref[None, :],
                                            float("-inf")))
                    b_qr = (_rows(q, T, t0 + 16 * r, i_k, HK * K, K, BK) * b_er2).to(b_qb.dtype)
                    b_kr = (_rows(k, T, t0 + 16 * r, i_k, HK * K, K, BK) * b_er2).to(b_qb.dtype)
                    b_dqk = _rows(dAqk, T, t0 + 16 * r, b, H * BT, BT, 16).to(b_qb.dtype)
                    b_dkk = _rows(dAkk, T, t0 + 16 * r, b, H * BT, BT, 16).to(b_qb.dtype)
                    b_dkc += (mm(tl.trans(b_dqk), b_qr) + mm(tl.trans(b_dkk), b_kr)) * \
                        tl.exp(b_gr_ref[None, :] - b_gb)
            # the diagonal block: factored through its first row when its decay allows, else pairwise;
            # Aqk's own diagonal (i = j, exponent 0) apart, added to dq, dk after dg (see the docstring)
            m_d = (o_i[:, None] > o_i[None, :]) & m_b[:, None]
            b_dAqk = _rows(dAqk, T, b0, b, H * BT, BT, 16)
            b_dqk = tl.where(m_d, b_dAqk, 0.)
            b_dqk_ii = tl.sum(tl.where((o_i[:, None] == o_i[None, :]) & m_b[:, None], b_dAqk, 0.), 1)
            b_dkk = tl.where(o_i[:, None] > o_i[None, :], _rows(dAkk, T, b0, b, H * BT, BT, 16), 0.)
            b_kf, b_qf = b_kb.to(tl.float32), b_qb.to(tl.float32)
            if _span(b_gb, b_gref, m_b) < SPAN:
                b_ec = tl.exp(tl.where(m_b[:, None], b_gref[None, :] - b_gb, float("-inf")))
                b_kec = b_kf * b_ec
                b_dq += mm(b_dqk, b_kec) * b_er
                b_dkr += mm(b_dkk, b_kec) * b_er
                b_dkc += (mm(tl.trans(b_dqk), b_qf * b_er) + mm(tl.trans(b_dkk), b_kf * b_er)) * b_ec
            else:
                b_e = tl.exp(tl.where(m_d[:, :, None], b_gb[:, None, :] - b_gb[None, :, :], float("-inf")))
                b_dq += tl.sum(b_dqk[:, :, None] * b_e * b_kf[None, :, :], 1)
                b_dkr += tl.sum(b_dkk[:, :, None] * b_e * b_kf[None, :, :], 1)
                b_dkc += tl.sum((b_dqk[:, :, None] * b_qf[:, None, :] + b_dkk[:, :, None] * b_kf[:, None, :]) * b_e, 0)

            p_dq = tl.make_block_ptr(dq, (T, K), (H * K, 1), (b0, i_k * BK), (16, BK), (1, 0))
            p_dk = tl.make_block_ptr(dk, (T, K), (H * K, 1), (b0, i_k * BK), (16, BK), (1, 0))
            p_dg = tl.make_block_ptr(dg, (T, K), (H * K, 1), (b0, i_k * BK), (16, BK), (1, 0))
            b_dg = b_qf * b_dq + b_kf * (b_dkr - b_dkc)
            b_dq += b_dqk_ii[:, None] * b_kf
            b_dkc += b_dqk_ii[:, None] * b_qf
            tl.store(p_dq, tl.load(p_dq, boundary_check=(0, 1)) + b_dq, boundary_check=(0, 1))
            tl.store(p_dk, tl.load(p_dk, boundary_check=(0, 1)) + b_dkr + b_dkc, boundary_check=(0, 1))
            tl.store(p_dg, tl.load(p_dg, boundary_check=(0, 1)) + b_dg, boundary_check=(0, 1))


def intra_fwd(q, k, g_cum, chunks: Chunks):
    """q, k: [1, T, HK, K]; g_cum: [1, T, H, K] -> (Aqk in q's dtype, Akk float32), [1, T, H, BT]
    (no scale, no beta)."""
    _, T, HK, K = k.shape
    H = g_cum.shape[2]
    f32 = dict(dtype=torch.float32, device=k.device)
    Aqk, Akk = alloc((1, T, H, chunks.BT), dtype=q.dtype, device=k.device), alloc((1, T, H, chunks.BT), **f32)
    intra_fwd_kernel[(chunks.NC, H)](q, k, g_cum, Aqk, Akk, chunks.cu_seqlens, chunks.chunk_indices, H=H, HK=HK,
                                     K=K, BT=chunks.BT, BK=min(32, triton.next_power_of_2(K)), SPAN=SAFE_SPAN)
    return Aqk, Akk


def intra_bwd(q, k, g_cum, dAqk, dAkk, dq, dk, dg, chunks: Chunks):
    """Adds the intra-chunk parts into dq, dk, dg (float32 [1, T, H, K], in place)."""
    _, T, HK, K = k.shape
    H = g_cum.shape[2]
    # 2 stages: 2.4 ms off KDA's 12.2 fwd+bwd at (4, 8192, 16, 128) against 3 on the H200
    # (`python -m fastweight.bench.gpu_sweep`)
    intra_bwd_kernel[(chunks.NC, H)](q, k, g_cum, dAqk, dAkk, dq, dk, dg, chunks.cu_seqlens, chunks.chunk_indices,
                                     H=H, HK=HK, K=K, BT=chunks.BT, BK=min(32, triton.next_power_of_2(K)),
                                     SPAN=SAFE_SPAN, num_warps=4, num_stages=2)
