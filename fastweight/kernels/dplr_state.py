"""The state pass of the generic DPLR chunk algorithm, forward and backward.

In fla's names (``a`` read against the state, ``b`` the write direction), per chunk with S the
state before it, G the chunk-local cumulative log decay, G_e its value at the chunk's last token,
W = T (a * exp(G^-)) and U~ = T A_ak V from ``dplr_wy.py``:

    U  = W S + U~                                   (the reads u_t = a_t^T S_{t-1}, [BT, V])
    S' = Diag(exp G_e) S + (b * exp(G_e - G))^T U + (k * exp(G_e - G))^T V

Backward, the same loop from the last chunk, with dS' the gradient of the state after the chunk:

    dU = A_qb^T dO + (b * exp(G_e - G)) dS'
    dS = Diag(exp G_e) dS' + (scale q * exp(G))^T dO + W^T dU

W U reads contract the whole key dimension, so one program holds all of K (BK = K padded to a
power of two) for a block of V. ``h``/``dh`` are stored per chunk ([NC, H, K, V]), U and dU per
token ([1, T, H, V]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks
from fastweight.kernels.decay_state import dot_precision, while_loops


@triton.jit
def dplr_state_fwd_step(b_h, i_t, k, v, b, gc, w, ut, h, u, bos, boh, T, i_h, o_k, o_v, m_k, m_v, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Chunk i_t: store h[i_t] = S, form and store U = W S + U~, return S'."""
    tl.store(h + ((boh + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_h.to(h.dtype.element_ty),
             mask=m_k[:, None] & m_v[None, :])
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    p_k = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
    b_w = tl.load(w + p_k, mask=m_tk, other=0.)
    b_u = tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PRECISION)
    b_u += tl.load(ut + p_v, mask=m_tv, other=0.).to(tl.float32)
    tl.store(u + p_v, b_u.to(u.dtype.element_ty), mask=m_tv)
    last = bos + tl.minimum(T, i_t * BT + BT) - 1
    b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.)
    b_e = tl.exp(tl.where(m_tk, b_gl[None, :] - tl.load(gc + p_k, mask=m_tk, other=0.), float("-inf")))
    b_bd = (tl.load(b + p_k, mask=m_tk, other=0.).to(tl.float32) * b_e).to(b_w.dtype)
    b_kd = (tl.load(k + p_k, mask=m_tk, other=0.).to(tl.float32) * b_e).to(b_w.dtype)
    b_v = tl.load(v + p_v, mask=m_tv, other=0.)
    b_h *= tl.exp(b_gl)[:, None]
    b_h += tl.dot(tl.trans(b_bd), b_u.to(b_w.dtype), input_precision=DOT_PRECISION)
    b_h += tl.dot(tl.trans(b_kd), b_v.to(b_w.dtype), input_precision=DOT_PRECISION)
    return b_h


@triton.jit
def dplr_state_fwd_kernel(k, v, b, gc, w, ut, h, u, h0, ht, cu_seqlens, chunk_offsets, H: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          WHILE_LOOP: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    o_h = o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0.).to(tl.float32)
    if WHILE_LOOP:
        i_t = 0
        while i_t < NT:
            b_h = dplr_state_fwd_step(b_h, i_t, k, v, b, gc, w, ut, h, u, bos, boh, T, i_h, o_k, o_v, m_k, m_v, H, K,
                                      V, BT, DOT_PRECISION)
            i_t += 1
    else:
        for i_t in range(0, NT):
            b_h = dplr_state_fwd_step(b_h, i_t, k, v, b, gc, w, ut, h, u, bos, boh, T, i_h, o_k, o_v, m_k, m_v, H, K,
                                      V, BT, DOT_PRECISION)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_h, b_h, mask=m_h)


@triton.jit
def dplr_state_bwd_step(b_dh, i_t, q, b, gc, w, Aqb, do, dh, du, bos, boh, T, i_h, o_k, o_v, m_k, m_v, scale,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Chunk i_t, backward: store dh[i_t] = dS', form and store dU, return dS."""
    tl.store(dh + ((boh + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_dh.to(dh.dtype.element_ty),
             mask=m_k[:, None] & m_v[None, :])
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    p_k = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    p_v = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
    last = bos + tl.minimum(T, i_t * BT + BT) - 1
    b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=m_k, other=0.)
    b_g = tl.load(gc + p_k, mask=m_tk, other=0.)
    b_do = tl.load(do + p_v, mask=m_tv, other=0.)
    b_w = tl.load(w + p_k, mask=m_tk, other=0.)
    m_s = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_A = tl.load(Aqb + ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :], mask=m_s, other=0.)
    b_bd = tl.load(b + p_k, mask=m_tk, other=0.).to(tl.float32) * tl.exp(
        tl.where(m_tk, b_gl[None, :] - b_g, float("-inf")))
    b_du = tl.dot(tl.trans(b_A).to(b_do.dtype), b_do, input_precision=DOT_PRECISION)
    b_du += tl.dot(b_bd.to(b_w.dtype), b_dh.to(b_w.dtype), input_precision=DOT_PRECISION)
    tl.store(du + p_v, b_du.to(du.dtype.element_ty), mask=m_tv)
    b_qg = tl.load(q + p_k, mask=m_tk, other=0.).to(tl.float32) * tl.exp(b_g) * scale
    b_dh *= tl.exp(b_gl)[:, None]
    b_dh += tl.dot(tl.trans(b_qg.to(b_do.dtype)), b_do, input_precision=DOT_PRECISION)
    b_dh += tl.dot(tl.trans(b_w), b_du.to(b_w.dtype), input_precision=DOT_PRECISION)
    return b_dh


@triton.jit
def dplr_state_bwd_kernel(q, b, gc, w, Aqb, do, dh, du, dht, dh0, cu_seqlens, chunk_offsets, scale,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    o_h = o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0.).to(tl.float32)
    if WHILE_LOOP:
        i_c = 0
        while i_c < NT:
            b_dh = dplr_state_bwd_step(b_dh, NT - 1 - i_c, q, b, gc, w, Aqb, do, dh, du, bos, boh, T, i_h, o_k, o_v,
                                       m_k, m_v, scale, H, K, V, BT, DOT_PRECISION)
            i_c += 1
    else:
        for i_c in range(0, NT):
            b_dh = dplr_state_bwd_step(b_dh, NT - 1 - i_c, q, b, gc, w, Aqb, do, dh, du, bos, boh, T, i_h, o_k, o_v,
                                       m_k, m_v, scale, H, K, V, BT, DOT_PRECISION)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_h, b_dh, mask=m_h)


def launch_config(BK: int, backward: bool) -> tuple[int, int]:
    """(num_warps, num_stages) of the state passes at BV = 64: K <= 64 4 warps 2 stages; above,
    8 warps, the forward 1 stage, the backward 2 (1 at K = 256): the fastest for RWKV-7 bf16
    forward+backward on the H200 (docs/bench/decay_dplr.md)."""
    if BK <= 64:
        return 4, 2
    # at K = 256 two stages of the backward need more shared memory than the H200 has
    return (8, 2 if BK <= 128 else 1) if backward else (8, 1)


def _blocks(K, V, block_v=None):
    # all of K per program. BV = 64 (``block_v`` instead, narrowed to V): every V block reloads W,
    # k, b and the gates of each chunk, so wide blocks win (BV 16 / 32 / 64 timed on the H200:
    # docs/bench/decay_dplr.md), and 16-bit dots narrower than 64 are what Triton 3.6
    # miscompiles on the H200 (docs/kernels.md)
    BK = max(16, triton.next_power_of_2(K))
    return BK, min(block_v or 64, max(16, triton.next_power_of_2(V)))


def dplr_state_fwd(k, v, b, gc, w, ut, chunks: Chunks, initial_state, output_final_state: bool, *,
                   block_v: int | None = None):
    """h [NC, H, K, V] (k's dtype), U [1, T, H, V] (k's dtype), final state [N, H, K, V] fp32 or None.
    ``block_v``: the V block instead of 64."""
    _, T, H, K = k.shape
    V = v.shape[-1]
    BK, BV = _blocks(K, V, block_v)
    warps, stages = launch_config(BK, False)
    h = torch.empty(chunks.NC, H, K, V, dtype=k.dtype, device=k.device)
    u = torch.empty(1, T, H, V, dtype=k.dtype, device=k.device)
    ht = torch.empty(chunks.N, H, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    dplr_state_fwd_kernel[(triton.cdiv(V, BV), chunks.N * H)](
        k, v, b, gc, w, ut, h, u, initial_state if initial_state is not None else h, ht if ht is not None else h,
        chunks.cu_seqlens, chunks.chunk_offsets, H=H, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV,
        USE_H0=initial_state is not None, STORE_HT=output_final_state, DOT_PRECISION=dot_precision(k.dtype),
        WHILE_LOOP=while_loops(), num_warps=warps, num_stages=stages)
    return h, u, ht


def dplr_state_bwd(q, b, gc, w, Aqb, do, dht, scale: float, chunks: Chunks, need_dh0: bool, *,
                   block_v: int | None = None):
    """dh [NC, H, K, V] fp32 (gradient of the state after each chunk), dU [1, T, H, V] fp32, dh0 or None.
    ``block_v``: the V block instead of 64."""
    _, T, H, K = q.shape
    V = do.shape[-1]
    BK, BV = _blocks(K, V, block_v)
    warps, stages = launch_config(BK, True)
    dh = torch.empty(chunks.NC, H, K, V, dtype=torch.float32, device=q.device)
    du = torch.empty(1, T, H, V, dtype=torch.float32, device=q.device)
    dh0 = torch.empty(chunks.N, H, K, V, dtype=torch.float32, device=q.device) if need_dh0 else None
    dplr_state_bwd_kernel[(triton.cdiv(V, BV), chunks.N * H)](
        q, b, gc, w, Aqb, do, dh, du, dht if dht is not None else dh, dh0 if dh0 is not None else dh,
        chunks.cu_seqlens, chunks.chunk_offsets, scale, H=H, K=K, V=V, BT=chunks.BT, BK=BK, BV=BV,
        USE_DHT=dht is not None, STORE_DH0=need_dh0, DOT_PRECISION=dot_precision(q.dtype),
        WHILE_LOOP=while_loops(), num_warps=warps, num_stages=stages)
    return dh, du, dh0
