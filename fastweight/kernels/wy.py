"""The WY representation of a chunk's transitions, forward and backward.

Forward (per chunk; ``Ai = (I + A)^{-1}`` from ``kkt_solve.py``, ``gamma_i = exp(g_i)``):

    W = Ai Diag(beta * gamma) K        U = Ai Diag(beta) V

Backward, given dW, dU (derivation in docs/kernels.md):

    dAi   = dW (Diag(beta gamma) K)^T + dU (Diag(beta) V)^T
    dA    = strictLower(-Ai^T dAi Ai^T)        (A_ij = beta_i (k_i . k_j) exp(g_i - g_j))
    M     = dA * Gamma * beta_i                (the gradient of the raw k_i . k_j)
    dK   += Diag(beta gamma) Ai^T dW + M K + M^T K
    dV    = Diag(beta) Ai^T dU
    dbeta = rowsum(gamma K * Ai^T dW) + rowsum(V * Ai^T dU) + rowsum(dA * Gamma * K K^T)
    dg   += rowsum(beta gamma K * Ai^T dW) + rowsum(dA * A) - colsum(dA * A)

``dg`` here is the gradient with respect to the chunk-local cumsum; the caller reverses the cumsum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import MIN_DOT_BLOCK, Chunks, alloc, chunk_gate_last_k, exp, mm


@triton.jit
def _gate_tile(g, bos, T, i_t, i_k, H: tl.constexpr, i_h, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """exp(G) of a [BT, BK] tile of the per-channel cumsum (USE_GK)."""
    p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    return exp(tl.load(p_g, boundary_check=(0, 1)))


@triton.jit
def recompute_w_u_kernel(k, v, beta, g, Ai, w, u, q, qg, kd, cu_seqlens, chunk_indices, H: tl.constexpr,
                         HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, PRESCALE: tl.constexpr,
                         STORE_U: tl.constexpr):
    """W, U of one (chunk, head); PRESCALE (per-channel gate): also the state pass's gated rows,
    qg = q exp(G) and kd = k exp(G_C - G) (0 past the end), in k's dtype, per value head."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_beta = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    p_Ai = tl.make_block_ptr(Ai + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
    b_Ai = tl.load(p_Ai, boundary_check=(0, 1))
    b_kscale = b_beta
    if USE_G:
        b_kscale = b_beta * exp(tl.load(g + (bos + o_t) * H + i_h, mask=m_t, other=0.))
    for i_k in range(tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1), (i_t * BT, i_k * BK),
                                (BT, BK), (1, 0))
        p_w = tl.make_block_ptr(w + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_kb = b_k * b_kscale[:, None]
        if USE_GK:
            p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK),
                                    (1, 0))
            b_g = tl.load(p_g, boundary_check=(0, 1))
            b_kb *= exp(b_g)
            if PRESCALE:
                p_q = tl.make_block_ptr(q + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1),
                                        (i_t * BT, i_k * BK), (BT, BK), (1, 0))
                p_qg = tl.make_block_ptr(qg + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK),
                                         (BT, BK), (1, 0))
                p_kd = tl.make_block_ptr(kd + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK),
                                         (BT, BK), (1, 0))
                b_glast = chunk_gate_last_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
                b_ek = tl.where(m_t[:, None], exp(b_glast[None, :] - b_g), 0.)
                tl.store(p_qg, (tl.load(p_q, boundary_check=(0, 1)) * exp(b_g)).to(p_qg.dtype.element_ty),
                         boundary_check=(0, 1))
                tl.store(p_kd, (b_k * b_ek).to(p_kd.dtype.element_ty), boundary_check=(0, 1))
        b_w = mm(b_Ai.to(b_k.dtype), b_kb.to(b_k.dtype))
        tl.store(p_w, b_w.to(p_w.dtype.element_ty), boundary_check=(0, 1))
    if STORE_U:
        for i_v in range(tl.cdiv(V, BV)):
            p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                    (1, 0))
            p_u = tl.make_block_ptr(u + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                    (1, 0))
            b_v = tl.load(p_v, boundary_check=(0, 1))
            b_vb = (b_v * b_beta[:, None]).to(b_v.dtype)
            b_u = mm(b_Ai.to(b_v.dtype), b_vb)
            tl.store(p_u, b_u.to(p_u.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def wy_bwd_kernel(k, p, v, beta, g, gr, Ai, Akk, dw, du, dk, dk_out, dp, dv, dbeta, dg, dg_out, dAkk, cu_seqlens,
                  chunk_indices, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                  USE_P: tl.constexpr, REVERSE_DG: tl.constexpr):
    """dk and dg arrive holding the other stages' parts (dk float32 or the inputs' dtype, dg float32);
    dg is updated in place, dk is written complete to dk_out (which may be dk itself).
    REVERSE_DG (scalar gate): the chunk's complete dg is summed from the chunk's end here (the reverse
    cumsum, ``cumsum.chunk_cumsum(reverse=True)``'s scan) and stored to dg_out in its dtype instead.

    USE_GK (per-channel gate): the A part of dk and dg is left to intra.py; this kernel writes
    dAkk, the gradient of the raw (beta-free) Akk, for it.
    USE_P (Comba): W and the rows of A read with p and the gate gr (the exclusive cumsum); the
    kernel writes dp, and adds the gradient of gr into dg (gr_i = g_{i-1}: at row i - 1).
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_beta = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    p_Ai = tl.make_block_ptr(Ai + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
    b_Ai = tl.load(p_Ai, boundary_check=(0, 1))
    m_A = (o_t[:, None] > o_t[None, :]) & m_t[:, None]
    if USE_G:
        b_g = tl.load(g + (bos + o_t) * H + i_h, mask=m_t, other=0.)
        b_gr = b_g
        if USE_P:
            b_gr = tl.load(gr + (bos + o_t) * H + i_h, mask=m_t, other=0.)
        b_gamma = exp(b_gr)
        b_Gamma = exp(tl.where(m_A, b_gr[:, None] - b_g[None, :], float("-inf")))
    else:
        b_gamma = tl.where(m_t, 1., 0.)
        b_Gamma = tl.where(m_A, 1., 0.)
    b_kscale = b_beta * b_gamma

    b_dAi = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_dg = tl.zeros([BT], dtype=tl.float32)
    b_dgr = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1), (i_t * BT, i_k * BK),
                                (BT, BK), (1, 0))
        p_dw = tl.make_block_ptr(dw + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_p = b_k
        if USE_P:
            p_p = tl.make_block_ptr(p + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1),
                                    (i_t * BT, i_k * BK), (BT, BK), (1, 0))
            b_p = tl.load(p_p, boundary_check=(0, 1))
        b_dw = tl.load(p_dw, boundary_check=(0, 1)).to(b_k.dtype)
        b_kb = b_p * b_kscale[:, None]
        if USE_GK:
            b_kb *= _gate_tile(g, bos, T, i_t, i_k, H, i_h, K, BT, BK)
        else:
            b_kk += mm(b_p, tl.trans(b_k))
        b_dAi += mm(b_dw, tl.trans(b_kb.to(b_k.dtype)))
    for i_v in range(tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_du = tl.make_block_ptr(du + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1))
        b_du = tl.load(p_du, boundary_check=(0, 1)).to(b_v.dtype)
        b_vb = (b_v * b_beta[:, None]).to(b_v.dtype)
        b_dAi += mm(b_du, tl.trans(b_vb))
        b_dvb = mm(tl.trans(b_Ai.to(b_v.dtype)), b_du)
        b_dbeta += tl.sum(b_dvb * b_v, 1)
        tl.store(p_dv, (b_dvb * b_beta[:, None]).to(p_dv.dtype.element_ty), boundary_check=(0, 1))

    b_dAi = tl.where(o_t[:, None] >= o_t[None, :], b_dAi, 0.)
    b_Aic = b_Ai.to(k.dtype.element_ty)
    b_dA = -mm(tl.trans(b_Aic), mm(b_dAi.to(b_Aic.dtype), tl.trans(b_Aic)).to(b_Aic.dtype))
    b_dA = b_dA * b_Gamma
    if USE_GK:
        p_Akk = tl.make_block_ptr(Akk + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        p_dAkk = tl.make_block_ptr(dAkk + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        b_dbeta += tl.sum(b_dA * tl.load(p_Akk, boundary_check=(0, 1)), 1)
        tl.store(p_dAkk, b_dA * b_beta[:, None], boundary_check=(0, 1))
    else:
        b_dbeta += tl.sum(b_dA * b_kk, 1)
    b_M = b_dA * b_beta[:, None]
    b_t = b_M * b_kk
    if USE_P:
        # pairs i = j + 1 read exp(gr_i - g_j) = exp(0): their row and column terms land on the same
        # row of dg and cancel exactly, so they are left out (their O(1) rounding would swamp a
        # strongly decayed chunk's gate gradient)
        b_t = tl.where(o_t[:, None] > o_t[None, :] + 1, b_t, 0.)
    b_dgr += tl.sum(b_t, 1)
    b_dg -= tl.sum(b_t, 0)
    for i_k in range(tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1), (i_t * BT, i_k * BK),
                                (BT, BK), (1, 0))
        p_dw = tl.make_block_ptr(dw + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        p_dk = tl.make_block_ptr(dk + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        p_dko = tl.make_block_ptr(dk_out + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK),
                                  (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_p = b_k
        if USE_P:
            p_p = tl.make_block_ptr(p + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1),
                                    (i_t * BT, i_k * BK), (BT, BK), (1, 0))
            b_p = tl.load(p_p, boundary_check=(0, 1))
        b_dw = tl.load(p_dw, boundary_check=(0, 1)).to(b_k.dtype)
        b_dkb = mm(tl.trans(b_Ai.to(b_k.dtype)), b_dw)
        b_dk = tl.load(p_dk, boundary_check=(0, 1)).to(tl.float32)
        if USE_GK:
            b_e = _gate_tile(g, bos, T, i_t, i_k, H, i_h, K, BT, BK)
            b_dkbe = b_dkb * b_e
            b_dbeta += tl.sum(b_dkbe * b_k, 1)
            b_dk += b_dkbe * b_beta[:, None]
            p_dg = tl.make_block_ptr(dg + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK),
                                     (1, 0))
            b_dgk = tl.load(p_dg, boundary_check=(0, 1)) + b_dkbe * b_k * b_beta[:, None]
            tl.store(p_dg, b_dgk, boundary_check=(0, 1))
        else:
            # the row side (W and the rows of A) belongs to p, the column side of A to k
            b_dbeta += tl.sum(b_dkb * b_p * b_gamma[:, None], 1)
            b_dgr += tl.sum(b_dkb * b_p * b_kscale[:, None], 1)
            b_Mk = b_M.to(b_k.dtype)
            b_dp = b_dkb * b_kscale[:, None] + mm(b_Mk, b_k)
            b_dk += mm(tl.trans(b_Mk), b_p)
            if USE_P:
                p_dp = tl.make_block_ptr(dp + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK),
                                         (BT, BK), (1, 0))
                tl.store(p_dp, b_dp.to(p_dp.dtype.element_ty), boundary_check=(0, 1))
            else:
                b_dk += b_dp
        tl.store(p_dko, b_dk.to(p_dko.dtype.element_ty), boundary_check=(0, 1))
    tl.store(dbeta + (bos + o_t) * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    if USE_G:
        if USE_P:
            # gr_i = g_{i-1} (the exclusive cumsum; 0 at the chunk's first row, a constant): row i's
            # gradient belongs to row i - 1 of dg
            o_i = tl.arange(0, BT)
            b_dgr = tl.sum(tl.where(o_i[None, :] == o_i[:, None] + 1, b_dgr[None, :], 0.), 1)
        b_dg += b_dgr + tl.load(dg + (bos + o_t) * H + i_h, mask=m_t, other=0.)
        if REVERSE_DG:
            # rows past the end enter the scan as 0, as chunk_cumsum's masked load gives them
            b_dg = tl.cumsum(tl.where(m_t, b_dg, 0.), axis=0, reverse=True)
            tl.store(dg_out + (bos + o_t) * H + i_h, b_dg.to(dg_out.dtype.element_ty), mask=m_t)
        else:
            tl.store(dg + (bos + o_t) * H + i_h, b_dg, mask=m_t)


def _blocks(K, V):
    """(BK, BV): ``common.MIN_DOT_BLOCK`` each, a smaller K or V padded (masked): W/U and their
    backward at K = 64 with V = 16 or 32 came out wrong in bf16 and fp16 with narrower blocks."""
    return MIN_DOT_BLOCK, MIN_DOT_BLOCK


def recompute_w_u(k, v, beta, g_cum, Ai, chunks: Chunks, gk_cum=None, q=None, num_warps: int | None = None,
                  need_u: bool = True):
    """k: [1, T, HK, K]; v: [1, T, H, V]; beta, g_cum: [1, T, H]; Ai: [1, T, H, BT]; gk_cum: [1, T, H, K]
    (per-channel gate, instead of g_cum) -> (w [1, T, H, K], u [1, T, H, V]). With ``q`` [1, T, HK, K]
    and ``gk_cum``: (w, u, qg, kd), the state pass's gated rows qg = q exp(G), kd = k exp(G_C - G)
    [1, T, H, K] (state.py reads them instead of forming them chunk after chunk on its serial path).
    ``num_warps``: default 4, 8 with the gated rows (H200, KDA (4, 8192, 16, 128): 0.446 against 0.474 ms).
    ``need_u=False``: W alone (u is None), for a backward whose forward formed the read from Ai."""
    _, T, HK, K = k.shape
    H, V = v.shape[2], v.shape[-1]
    BK, BV = _blocks(K, V)
    w = alloc((1, T, H, K), dtype=k.dtype, device=k.device)
    u = alloc(v.shape, dtype=v.dtype, device=v.device) if need_u else None
    prescale = q is not None and gk_cum is not None
    num_warps = num_warps or (8 if prescale else 4)
    qg, kd = ((alloc((1, T, H, K), dtype=k.dtype, device=k.device) for _ in range(2)) if prescale else (None, None))
    recompute_w_u_kernel[(chunks.NC, H)](k, v, beta, g_cum if gk_cum is None else gk_cum, Ai, w, u, q, qg, kd,
                                         chunks.cu_seqlens, chunks.chunk_indices, H=H, HK=HK, K=K, V=V, BT=chunks.BT,
                                         BK=BK, BV=BV, USE_G=g_cum is not None, USE_GK=gk_cum is not None,
                                         PRESCALE=prescale, STORE_U=need_u, num_warps=num_warps)
    return (w, u, qg, kd) if prescale else (w, u)


def wy_bwd(k, v, beta, g_cum, Ai, dw, du, dk, dg, chunks: Chunks, gk_cum=None, Akk=None, dk_dtype=torch.float32,
           p=None, g_read=None, dg_dtype=None, dbeta_dtype=torch.float32):
    """Adds the W/U/A chain to dk (partial, fp32 or ``dk_dtype``) and dg (fp32: in place, or with ``dg_dtype``
    into a new tensor; None without a gate).

    Returns (dk in ``dk_dtype`` (dk itself when of that dtype), dv in v's dtype, dbeta in ``dbeta_dtype``,
    dAkk fp32 or None, dp fp32 or None, dg); with Comba's read key ``p`` and its gate ``g_read`` (exclusive
    cumsum) W and the rows of A read with them; with a per-channel gate ``gk_cum`` (and its raw ``Akk``)
    the A part goes to dAkk for ``intra.intra_bwd`` instead of into dk, dg. ``dg_dtype`` (scalar gate):
    dg comes back complete and reverse-summed over each chunk, the gradient of the raw gate, in that
    dtype (what ``cumsum.chunk_cumsum(dg, reverse=True, out_dtype=dg_dtype)`` after it gives)."""
    _, T, HK, K = k.shape
    H, V = v.shape[2], v.shape[-1]
    BK, BV = _blocks(K, V)
    dv = alloc(v.shape, device=v.device, dtype=v.dtype)
    dk_out = dk if dk.dtype == dk_dtype else alloc(dk.shape, device=dk.device, dtype=dk_dtype)
    dbeta = alloc(beta.shape, device=v.device, dtype=dbeta_dtype)
    reverse_dg = dg_dtype is not None and g_cum is not None and gk_cum is None
    dg_out = alloc(dg.shape, device=dg.device, dtype=dg_dtype) if reverse_dg else None
    dAkk = alloc(Ai.shape, device=v.device, dtype=torch.float32) if gk_cum is not None else None
    use_p = p is not None
    dp = alloc(dk.shape, device=v.device, dtype=torch.float32) if use_p else None
    gate = g_cum if gk_cum is None else gk_cum
    wy_bwd_kernel[(chunks.NC, H)](k, p if use_p else k, v, beta, gate, g_read if use_p else gate, Ai, Akk, dw, du,
                                  dk, dk_out, dp, dv, dbeta, dg, dg_out, dAkk, chunks.cu_seqlens,
                                  chunks.chunk_indices, H=H, HK=HK, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV,
                                  USE_G=g_cum is not None, USE_GK=gk_cum is not None, USE_P=use_p,
                                  REVERSE_DG=reverse_dg)
    return dk_out, dv, dbeta, dAkk, dp, dg_out if reverse_dg else dg
