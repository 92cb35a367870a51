"""The inter-chunk state pass, fused with the output, and its backward (the dh pass).

Forward, per sequence, head and block of BV value columns, chunk after chunk (S the state at
the chunk's start, ``g`` the chunk-local cumsum, ``gamma_i = exp(g_i)``, C the chunk's last row):

    v_tilde = U - W S                                               (the pseudo value)
    O       = scale (Diag(gamma) Q S + ((Q K^T) * Gamma * M) v_tilde)    M: i >= j
    S      <- gamma_C S + (Diag(exp(g_C - g)) K)^T v_tilde

The state stays in registers ([K, BV] float32; the whole key dimension, up to 256, in one
program, because ``W S`` contracts it). Nothing per chunk is written unless STORE_H: then the
chunk-start states ``h`` [NC, H, K, V] and ``v_tilde`` are kept for the backward.

Backward (reverse over chunks; dS the gradient of the state at the chunk's end):

    dv_tilde = scale ((Q K^T) * Gamma * M)^T dO + Diag(exp(g_C - g)) K dS
    dS      <- gamma_C dS + scale (Diag(gamma) Q)^T dO - W^T dv_tilde

It writes ``dh`` [NC, H, K, V] (dS at each chunk's end), ``dv_tilde`` and d initial_state.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, alloc, mm


@triton.jit
def _chunk_gates(g, bos, T, i_t, H: tl.constexpr, i_h, BT: tl.constexpr):
    """(g of the chunk's rows [BT], g at the chunk's last row C).

    Rows past the end (a partial last chunk) repeat g_C: every exponent a padded lane then forms
    (g_i - g_j, g_C - g_i, g_i) equals one a valid lane forms, so none can overflow. With 0 there,
    exp(0 - g_j) would pass e^88 once the chunk decays that much, and inf times the lane's zero
    operand would put NaN into the valid rows' sums."""
    o_t = i_t * BT + tl.arange(0, BT)
    b_glast = tl.load(g + (bos + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h)
    b_g = tl.load(g + (bos + o_t) * H + i_h, mask=o_t < T, other=b_glast)
    return b_g, b_glast


@triton.jit
def _chunk_gates_k(g, bos, T, i_t, H: tl.constexpr, i_h, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """(per-channel G of the chunk's rows [BT, BK], G at the chunk's last row [BK]); rows past the
    end repeat the last row, as in ``_chunk_gates``."""
    p_g = tl.make_block_ptr(g + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    o_k = tl.arange(0, BK)
    m_t = i_t * BT + tl.arange(0, BT) < T
    b_glast = tl.load(g + ((bos + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h) * K + o_k, mask=o_k < K, other=0.)
    return tl.where(m_t[:, None], tl.load(p_g, boundary_check=(0, 1)), b_glast[None, :]), b_glast


@triton.jit
def _fwd_step(i_t, b_h, q, k, w, u, g, Aqk, o, h, v_new, bos, T, boh, i_h, i_v, scale, H: tl.constexpr,
              HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr, STORE_H: tl.constexpr):
    """One chunk of the forward pass; returns the state at the chunk's end."""
    o_i = tl.arange(0, BT)
    m_causal = o_i[:, None] >= o_i[None, :]
    m_row = i_t * BT + o_i < T
    i_hk = i_h // (H // HK)
    p_q = tl.make_block_ptr(q + (bos * HK + i_hk) * K, (T, K), (HK * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * HK + i_hk) * K, (T, K), (HK * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_w = tl.make_block_ptr(w + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_u = tl.make_block_ptr(u + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
    p_o = tl.make_block_ptr(o + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    b_w = tl.load(p_w, boundary_check=(0, 1))
    b_hc = b_h.to(b_q.dtype)
    if STORE_H:
        p_h = tl.make_block_ptr(h + ((boh + i_t) * H + i_h).to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV),
                                (BK, BV), (1, 0))
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), boundary_check=(0, 1))
    b_v = tl.load(p_u, boundary_check=(0, 1)).to(tl.float32) - mm(b_w, b_hc)
    if STORE_H:
        p_vn = tl.make_block_ptr(v_new + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                 (1, 0))
        tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), boundary_check=(0, 1))
    b_kd = b_k
    b_vk = b_v
    if USE_GK:
        # per-channel decay: the intra-chunk scores come precomputed (intra.py)
        b_gk, b_gklast = _chunk_gates_k(g, bos, T, i_t, H, i_h, K, BT, BK)
        b_o = mm((b_q * tl.exp(b_gk)).to(b_q.dtype), b_hc)
        p_A = tl.make_block_ptr(Aqk + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        b_A = tl.load(p_A, boundary_check=(0, 1))
        b_kd = (b_k * tl.where(m_row[:, None], tl.exp(b_gklast[None, :] - b_gk), 0.)).to(b_k.dtype)
        b_h = b_h * tl.exp(b_gklast)[:, None]
    else:
        b_o = mm(b_q, b_hc)
        b_A = mm(b_q, tl.trans(b_k))
        if USE_G:
            b_g, b_glast = _chunk_gates(g, bos, T, i_t, H, i_h, BT)
            b_o = b_o * tl.exp(b_g)[:, None]
            b_A = b_A * tl.exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
            b_vk = b_v * tl.exp(b_glast - b_g)[:, None]
            b_h = b_h * tl.exp(b_glast)
        else:
            b_A = tl.where(m_causal, b_A, 0.)
    b_o = (b_o + mm(b_A.to(b_q.dtype), b_v.to(b_q.dtype))) * scale
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
    return b_h + mm(tl.trans(b_kd), b_vk.to(b_q.dtype))


@triton.jit
def state_output_fwd_kernel(q, k, w, u, g, Aqk, h0, o, ht, h, v_new, cu_seqlens, chunk_offsets, scale, NT_ALL,
                            H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                            USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                            STORE_H: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    boh = tl.load(chunk_offsets + i_n)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = tl.make_block_ptr(h0 + i_nh.to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        b_h = tl.load(p_h0, boundary_check=(0, 1)).to(tl.float32)
    if IS_VARLEN:
        # a while loop: the interpreter cannot range() over a value loaded through program_id
        NT = tl.cdiv(T, BT).to(tl.int32)
        i_t = 0
        while i_t < NT:
            b_h = _fwd_step(i_t, b_h, q, k, w, u, g, Aqk, o, h, v_new, bos, T, boh, i_h, i_v, scale, H, HK, K, V,
                            BT, BK, BV, USE_G, USE_GK, STORE_H)
            i_t += 1
    else:
        # a for loop with a host bound: the compiler prefetches the next chunk's tiles
        for i_t in range(NT_ALL):
            b_h = _fwd_step(i_t, b_h, q, k, w, u, g, Aqk, o, h, v_new, bos, T, boh, i_h, i_v, scale, H, HK, K, V,
                            BT, BK, BV, USE_G, USE_GK, STORE_H)
    if STORE_FINAL_STATE:
        p_ht = tl.make_block_ptr(ht + i_nh.to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _bwd_step(i_t, b_dh, q, k, w, g, Aqk, do, dh, dv, bos, T, boh, i_h, i_v, scale, H: tl.constexpr,
              HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr):
    """One chunk of the dh pass, last chunk first; returns dS at the chunk's start."""
    o_i = tl.arange(0, BT)
    m_anticausal = o_i[:, None] <= o_i[None, :]
    i_hk = i_h // (H // HK)
    p_dh = tl.make_block_ptr(dh + ((boh + i_t) * H + i_h).to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV),
                             (BK, BV), (1, 0))
    tl.store(p_dh, b_dh.to(p_dh.dtype.element_ty), boundary_check=(0, 1))
    p_q = tl.make_block_ptr(q + (bos * HK + i_hk) * K, (T, K), (HK * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * HK + i_hk) * K, (T, K), (HK * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_w = tl.make_block_ptr(w + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_do = tl.make_block_ptr(do + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
    p_dv = tl.make_block_ptr(dv + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    b_w = tl.load(p_w, boundary_check=(0, 1))
    b_do = tl.load(p_do, boundary_check=(0, 1)).to(b_q.dtype)
    if USE_GK:
        b_gk, b_gklast = _chunk_gates_k(g, bos, T, i_t, H, i_h, K, BT, BK)
        p_A = tl.make_block_ptr(Aqk + (bos * H + i_h) * BT, (BT, T), (1, H * BT), (0, i_t * BT), (BT, BT), (0, 1))
        b_At = tl.load(p_A, boundary_check=(0, 1)).to(tl.float32)
        m_row = i_t * BT + o_i < T
        b_kd = (b_k * tl.where(m_row[:, None], tl.exp(b_gklast[None, :] - b_gk), 0.)).to(b_q.dtype)
        b_qd = (b_q * tl.exp(b_gk) * scale).to(b_q.dtype)
    elif USE_G:
        # [BT, BT]: entry (j, i) = k_j . q_i, the transpose of the output's Q K^T
        b_g, b_glast = _chunk_gates(g, bos, T, i_t, H, i_h, BT)
        b_At = mm(b_k, tl.trans(b_q)) * tl.exp(tl.where(m_anticausal, b_g[None, :] - b_g[:, None], float("-inf")))
        b_kd = (b_k * tl.exp(b_glast - b_g)[:, None]).to(b_q.dtype)
        b_qd = (b_q * (tl.exp(b_g) * scale)[:, None]).to(b_q.dtype)
    else:
        b_At = tl.where(m_anticausal, mm(b_k, tl.trans(b_q)), 0.)
        b_kd = b_k
        b_qd = (b_q * scale).to(b_q.dtype)
    b_dv = mm((b_At * scale).to(b_q.dtype), b_do) + mm(b_kd, b_dh.to(b_q.dtype))
    tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), boundary_check=(0, 1))
    if USE_GK:
        b_dh = b_dh * tl.exp(b_gklast)[:, None]
    if USE_G:
        b_dh = b_dh * tl.exp(b_glast)
    return b_dh + mm(tl.trans(b_qd), b_do) - mm(tl.trans(b_w), b_dv.to(b_q.dtype))


@triton.jit
def state_bwd_kernel(q, k, w, g, Aqk, do, dht, dh, dh0, dv, cu_seqlens, chunk_offsets, scale, NT_ALL,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr,
                     USE_FINAL_STATE_GRADIENT: tl.constexpr, STORE_INITIAL_STATE_GRADIENT: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    T = eos - bos
    boh = tl.load(chunk_offsets + i_n)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        p_dht = tl.make_block_ptr(dht + i_nh.to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        b_dh = tl.load(p_dht, boundary_check=(0, 1)).to(tl.float32)
    if IS_VARLEN:
        i_t = tl.cdiv(T, BT).to(tl.int32) - 1
        while i_t >= 0:
            b_dh = _bwd_step(i_t, b_dh, q, k, w, g, Aqk, do, dh, dv, bos, T, boh, i_h, i_v, scale, H, HK, K, V,
                             BT, BK, BV, USE_G, USE_GK)
            i_t -= 1
    else:
        for i_r in range(NT_ALL):
            b_dh = _bwd_step(NT_ALL - 1 - i_r, b_dh, q, k, w, g, Aqk, do, dh, dv, bos, T, boh, i_h, i_v, scale, H,
                             HK, K, V, BT, BK, BV, USE_G, USE_GK)
    if STORE_INITIAL_STATE_GRADIENT:
        p_dh0 = tl.make_block_ptr(dh0 + i_nh.to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_dh0, b_dh.to(p_dh0.dtype.element_ty), boundary_check=(0, 1))


def _while_loop(chunks: Chunks) -> bool:
    """Varlen sequences loop with while; so does the interpreter, whose range() needs a constexpr bound."""
    return chunks.NT is None or os.environ.get("TRITON_INTERPRET") == "1"


def _bv(block_v=None):
    """The value block: 64 (a smaller V is padded, masked), on every path. Triton 3.6 on the H200
    addresses shared memory out of range in 16-bit dots over blocks narrower than 64
    (compute-sanitizer): at BV = 32 the state passes fault or return wrong states and gradients,
    on the varlen and the uniform loop, at K = 128 and 256 (docs/bench/delta.md)."""
    return block_v or 64


def launch_config(K, BV, itemsize, per_channel_bwd=False):
    """(num_warps, num_stages) of a state pass with value block BV and inputs of ``itemsize`` bytes.

    Warps: 8 for K = 256 (the [K, BV] fp32 state in registers) and for the per-channel (KDA) dh
    pass at K = 128 (0.26 ms faster of KDA's 9.6 at (4, 8192, 16, 128), docs/bench/delta.md),
    else 4. Stages: the pipelined for loop keeps two copies of a chunk's q, k, w tiles ([64, K]
    each) in shared memory; past 256 bytes a row (K = 256 in 16 bits, K >= 128 in fp32) that
    exceeds the H200's 227 KiB (K = 256 bf16 with 2 stages takes 248 KiB), so those run one stage
    (sm_90 compiles of every shape: docs/bench/delta.md)."""
    warps = 8 if K > 128 or (per_channel_bwd and K == 128) else 4
    stages = 2 if triton.next_power_of_2(K) * itemsize <= 256 else 1
    return warps, stages


def state_output_fwd(q, k, w, u, g_cum, initial_state, output_final_state: bool, store_h: bool,
                     scale: float, chunks: Chunks, gk_cum=None, Aqk=None, block_v=None):
    """Returns (o, final state or None, h or None, v_new or None); o in v's dtype.

    Per-channel gate: ``gk_cum`` [1, T, H, K] with ``Aqk`` from ``intra.intra_fwd`` (g_cum None)."""
    _, T, HK, K = k.shape
    H, V = u.shape[2], u.shape[-1]
    BK, BV = triton.next_power_of_2(K), _bv(block_v)
    warps, stages = launch_config(K, BV, k.element_size())
    dev = u.device
    o = alloc(u.shape, dtype=u.dtype, device=dev)
    ht = alloc((chunks.N, H, K, V), dtype=torch.float32, device=dev) if output_final_state else None
    h = alloc((chunks.NC, H, K, V), dtype=k.dtype, device=dev) if store_h else None
    v_new = alloc(u.shape, dtype=u.dtype, device=dev) if store_h else None
    gate = g_cum if gk_cum is None else gk_cum
    state_output_fwd_kernel[(triton.cdiv(V, BV), chunks.N * H)](
        q, k, w, u, gate, Aqk, initial_state, o, ht, h, v_new, chunks.cu_seqlens, chunks.chunk_offsets, scale,
        chunks.NT or 0, H=H, HK=HK, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV, USE_G=g_cum is not None,
        USE_GK=gk_cum is not None, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, STORE_H=store_h, IS_VARLEN=_while_loop(chunks), num_warps=warps,
        num_stages=stages)
    return o, ht, h, v_new


def state_bwd(q, k, w, g_cum, do, dht, scale: float, chunks: Chunks, need_dh0: bool, gk_cum=None, Aqk=None,
              block_v=None):
    """Returns (dh [NC, H, K, V], dv_tilde [1, T, H, V] in do's dtype, d initial_state fp32 or None)."""
    _, T, HK, K = k.shape
    H, V = do.shape[2], do.shape[-1]
    BK, BV = triton.next_power_of_2(K), _bv(block_v)
    warps, stages = launch_config(K, BV, k.element_size(), per_channel_bwd=gk_cum is not None)
    dev = q.device
    dh = alloc((chunks.NC, H, K, V), dtype=k.dtype, device=dev)
    dv = alloc(do.shape, device=dev, dtype=do.dtype)
    dh0 = alloc((chunks.N, H, K, V), dtype=torch.float32, device=dev) if need_dh0 else None
    gate = g_cum if gk_cum is None else gk_cum
    state_bwd_kernel[(triton.cdiv(V, BV), chunks.N * H)](
        q, k, w, gate, Aqk, do, dht, dh, dh0, dv, chunks.cu_seqlens, chunks.chunk_offsets, scale, chunks.NT or 0,
        H=H, HK=HK, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV, USE_G=g_cum is not None, USE_GK=gk_cum is not None,
        USE_FINAL_STATE_GRADIENT=dht is not None, STORE_INITIAL_STATE_GRADIENT=need_dh0,
        IS_VARLEN=_while_loop(chunks), num_warps=warps, num_stages=stages)
    return dh, dv, dh0
