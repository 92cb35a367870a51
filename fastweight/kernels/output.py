"""The output stage's backward, per chunk: dq, the first parts of dk and dg, and dW.

From the chunk's start state S (``h``), the end-state gradient dS (``dh``), v_tilde and
dv_tilde (``state.py``), with ``gamma_i = exp(g_i)``, Gamma_ij = exp(g_i - g_j), M: i >= j:

    dQ  = scale (Diag(gamma) dO S^T + dP K)           dP = scale (dO v_tilde^T) * Gamma * M
    dK  = Diag(exp(g_C - g)) v_tilde dS^T + dP^T Q     (the W and A parts come in wy.py)
    dW  = -dv_tilde S^T
    dg  = rowsum(dQ_inter * Q) + rowsum(dP * QK^T) - colsum(dP * QK^T) - rowsum(dK_state * K)
          + [last row] (sum_rows rowsum(dK_state * K) + gamma_C <S, dS>)

(dQ_inter the first term of dQ, dK_state the first of dK; dg is with respect to the
chunk-local cumsum.) One program holds a chunk's whole key dimension and loops over V.

The terms whose exponent is 0 (the diagonal i = j of the scores, the last row's own dK_state)
enter dg with + and - at the same row and cancel exactly: they are left out. The caller's reverse
cumsum turns dg into the gradient of the raw gate, which a strong decay makes O(exp(g)) small; those
terms are O(1), and their rounding alone (1e-7 in fp32) would be 1e-2 of it at g = -6 per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, alloc, chunk_gates, chunk_gates_k, dot_block, exp, mm


@triton.jit
def _load_qk(q, k, bos, T, i_t, i_h, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr):
    """The chunk's [BT, BK] tiles of q and k (key head i_h // (H // HK))."""
    p_q = tl.make_block_ptr(q + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * HK + i_h // (H // HK)) * K, (T, K), (HK * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    return tl.load(p_q, boundary_check=(0, 1)), tl.load(p_k, boundary_check=(0, 1))


@triton.jit
def output_bwd_kernel(q, k, g, h, dh, v_new, do, dv, dq, dk, dw, dg, dAqk, cu_seqlens, chunk_indices, scale,
                      H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr,
                      BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, QK_FIRST: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t = tl.load(chunk_indices + i_c * 2).to(tl.int64), tl.load(chunk_indices + i_c * 2 + 1)
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_causal = o_t[:, None] >= o_t[None, :]
    m_strict = o_t[:, None] > o_t[None, :]
    m_last = o_t == tl.minimum(i_t * BT + BT, T) - 1

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    if QK_FIRST:
        b_q, b_k = _load_qk(q, k, bos, T, i_t, i_h, H, HK, K, BT, BK)
    h += (i_c * H + i_h).to(tl.int64) * K * V
    dh += (i_c * H + i_h).to(tl.int64) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        p_h = tl.make_block_ptr(h, (V, K), (1, V), (i_v * BV, 0), (BV, BK), (0, 1))
        p_dh = tl.make_block_ptr(dh, (V, K), (1, V), (i_v * BV, 0), (BV, BK), (0, 1))
        p_vn = tl.make_block_ptr(v_new + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                 (1, 0))
        p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_h = tl.load(p_h, boundary_check=(0, 1))  # [BV, BK]: S^T
        b_dh = tl.load(p_dh, boundary_check=(0, 1))
        b_vn = tl.load(p_vn, boundary_check=(0, 1))
        b_do = tl.load(p_do, boundary_check=(0, 1)).to(b_vn.dtype)
        b_dv = tl.load(p_dv, boundary_check=(0, 1)).to(b_vn.dtype)
        b_dq += mm(b_do, b_h.to(b_vn.dtype))
        b_dk += mm(b_vn, b_dh.to(b_vn.dtype))
        b_dw += mm(b_dv, b_h.to(b_vn.dtype))
        b_ds += mm(b_do, tl.trans(b_vn))
        if USE_G or USE_GK:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 0)
    if not QK_FIRST:
        b_q, b_k = _load_qk(q, k, bos, T, i_t, i_h, H, HK, K, BT, BK)
    if USE_GK:
        # per-channel gate: the intra-chunk part goes through dAqk to intra.py
        b_gk, b_gklast = chunk_gates_k(g, bos, T, i_t, H, i_h, 0, K, BT, BK)
        b_dq = b_dq * exp(b_gk) * scale
        b_dgk = b_dq * b_q.to(tl.float32)
        b_dk = b_dk * tl.where(m_t[:, None], exp(b_gklast[None, :] - b_gk), 0.)
        b_dkk = tl.where(m_last[:, None], 0., b_dk * b_k.to(tl.float32))
        b_dglast = tl.sum(b_dkk, 0) + exp(b_gklast) * b_hdh
        b_dgk += tl.where(m_last[:, None], b_dglast[None, :], 0.) - b_dkk
        p_dg = tl.make_block_ptr(dg + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
        tl.store(p_dg, b_dgk, boundary_check=(0, 1))
        p_dA = tl.make_block_ptr(dAqk + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        tl.store(p_dA, tl.where(m_causal, b_ds, 0.) * scale, boundary_check=(0, 1))
    elif USE_G:
        b_g, b_glast = chunk_gates(g, bos, T, i_t, H, i_h, BT)
        b_dq = b_dq * (exp(b_g) * scale)[:, None]
        b_dg = tl.sum(b_dq * b_q.to(tl.float32), 1)
        b_dk = b_dk * tl.where(m_t, exp(b_glast - b_g), 0.)[:, None]
        b_dkk = tl.where(m_last, 0., tl.sum(b_dk * b_k.to(tl.float32), 1))
        b_dg -= b_dkk
        b_dglast = tl.sum(b_dkk, 0) + exp(b_glast) * tl.sum(b_hdh, 0)
        b_ds = b_ds * exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf"))) * scale
        b_A = mm(b_q, tl.trans(b_k))
        b_t = tl.where(m_strict, b_ds * b_A, 0.)
        b_dg += tl.sum(b_t, 1) - tl.sum(b_t, 0)
        b_dg += tl.where(m_last, b_dglast, 0.)
        tl.store(dg + (bos + o_t) * H + i_h, b_dg, mask=m_t)
    else:
        b_dq = b_dq * scale
        b_ds = tl.where(m_causal, b_ds, 0.) * scale
    if not USE_GK:
        b_dsc = b_ds.to(b_q.dtype)
        b_dq += mm(b_dsc, b_k)
        b_dk += mm(tl.trans(b_dsc), b_q)
    p_dq = tl.make_block_ptr(dq + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_dk = tl.make_block_ptr(dk + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_dw = tl.make_block_ptr(dw + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_dw, (-b_dw).to(p_dw.dtype.element_ty), boundary_check=(0, 1))


# shared memory the prefetching of the loop over V may take (the H200 has 227 KiB a block)
SHARED_BUDGET = 200 * 1024
# q and k loaded before the loop over V, their reads in flight with the loop's instead of after it: only where
# the program runs alone on its SM (8 warps at K = 128) and stores a 16-bit partial dk (delta.PARTIAL_DK_DTYPES),
# the one configuration where it was faster; with an fp32 partial or at K = 64 it was slower (docs/bench/delta.md)
QK_FIRST = True


def reads_qk_first(K: int, warps: int, dk_dtype: torch.dtype, k_dtype: torch.dtype, per_channel: bool) -> bool:
    """Whether the output backward loads q and k before its loop over V (``QK_FIRST``'s rule: the timed
    configuration only, K = 128 at 8 warps, a 16-bit partial dk, a scalar or no gate)."""
    return (QK_FIRST and K == 128 and warps == 8 and dk_dtype == k_dtype and k_dtype.itemsize == 2
            and not per_channel)


def launch_config(K, V, itemsize, BT=64):
    """(BV, num_warps, num_stages) of the output backward.

    8 warps past K = 64, but 4 whenever BV < 32 (Triton 3.6 miscompiles bf16 kernels with 16-wide
    V blocks at 8 warps on the H200, an illegal memory access: docs/kernels.md, narrow blocks).
    Each stage of the loop over V holds the [BV, K] tiles of h and dh and the [BT, BV] tiles of
    v_tilde, dO, dv_tilde; as many stages (up to 3) as fit SHARED_BUDGET: 3 for 16-bit K <= 128,
    2 at K = 256 (3 would take 264 KiB there), 1 for fp32 from K = 128 (sm_90 compiles:
    docs/bench/delta.md)."""
    BV = min(64, triton.next_power_of_2(V))
    warps = 4 if K <= 64 or BV < 32 else 8
    per_stage = (2 * BV * triton.next_power_of_2(K) + 3 * BT * BV) * itemsize
    return BV, warps, max(1, min(3, SHARED_BUDGET // per_stage))


def output_bwd(q, k, g_cum, h, dh, v_new, do, dv, scale: float, chunks: Chunks, gk_cum=None,
               dq_dtype=torch.float32, dk_dtype=torch.float32):
    """Returns (dq in ``dq_dtype``, dk in ``dk_dtype``, dw in k's dtype, dg fp32, dAqk fp32), per value head;
    dk and dg are partial (``delta.PARTIAL_DK_DTYPES``: dk in the inputs' 16-bit dtype).

    dg: None without a gate, [1, T, H, K] with a per-channel gate ``gk_cum``, whose intra-chunk
    part of dq, dk, dg is left to ``intra.intra_bwd`` through dAqk (None otherwise)."""
    _, T, HK, K = k.shape
    H, V = do.shape[2], do.shape[-1]
    # K under 64 padded (masked): a 16-wide key block (K = 16, V = 64) gave wrong bf16 dq, dk
    BK = dot_block(K)
    BV, warps, stages = launch_config(K, V, k.element_size())
    f32 = dict(device=q.device, dtype=torch.float32)
    dev = q.device
    dq, dk = alloc((1, T, H, K), dtype=dq_dtype, device=dev), alloc((1, T, H, K), dtype=dk_dtype, device=dev)
    dw = alloc((1, T, H, K), dtype=k.dtype, device=dev)
    gate = g_cum if gk_cum is None else gk_cum
    dg = alloc(gate.shape, **f32) if gate is not None else None
    dAqk = alloc((1, T, H, chunks.BT), **f32) if gk_cum is not None else None
    qk_first = reads_qk_first(K, warps, dk_dtype, k.dtype, gk_cum is not None)
    output_bwd_kernel[(chunks.NC, H)](q, k, gate, h, dh, v_new, do, dv, dq, dk, dw, dg, dAqk, chunks.cu_seqlens,
                                      chunks.chunk_indices, scale, H=H, HK=HK, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV,
                                      USE_G=g_cum is not None, USE_GK=gk_cum is not None, QK_FIRST=qk_first,
                                      num_warps=warps, num_stages=stages)
    return dq, dk, dw, dg, dAqk
