"""The inter-chunk state pass: the one sequential loop over chunks, shared by every family.

Per sequence, head and [BK, BV] block of the state, chunk after chunk (S the state at the chunk's
start, D = Diag(exp G_C) the chunk's decay, Kd = Diag(exp(G_C - G)) K its decayed write keys, G
the chunk-local cumulative log gate, scalar or per channel, C the chunk's last row). The
transitions differ only in what is written, which is what ``TRANSITION`` selects:

    DECAY (linear attention, GLA, Mamba-2, RWKV-6):   S <- D S + Kd^T V
    DELTA (the delta rule: U, W from kkt_solve.py or wy.py): R = U - W S,   S <- D S + Kd^T R
    DPLR  (generic, U~, W from dplr_wy.py):           R = U~ + W S,  S <- D S + Bd^T R + Kd^T V

R is the low-rank read (DELTA: the pseudo values v_tilde; DPLR: the reads a_t^T S). ``h`` (the
state at each chunk's start, [NC, H, K, V], or two 16-bit planes [2, NC, H, K, V] with
``state_dtype="split"``) and R are stored when asked; each forward can also form the output on the
fly (FUSE_OUTPUT), so inference writes neither:

    DECAY:  O = scale Diag(exp G) Q S + (A * M) V                          M: i >= j
    DELTA:  O = scale (Diag(exp G) Q S + ((Q K^T) * Gamma * M) R)
    DPLR:   O = scale Diag(exp G) Q S + (A_qk * M) V + (A_qb * M) R

(DECAY's A = scale (Q K^T) * Gamma is formed in the pass for a scalar or no gate and comes from
decay_intra.py for a per-channel one; the per-channel delta gate's Q K^T * Gamma comes precomputed,
``A``, from intra.py; DPLR's A_qk and A_qb, scaled, from dplr_intra.py as ``A`` and ``A2``).

The backward runs the same loop from the last chunk, dS the gradient of the state at the chunk's
end (``dh`` stores it per chunk); Qd = Diag(exp Gq) Q scale (Gq = G, or RWKV-6's exclusive gate):

    DECAY:  dS <- D dS + Qd^T dO
    DELTA:  dR = scale (A^T dO) + Kd dS,       dS <- D dS + Qd^T dO - W^T dR
    DPLR:   dR = A_qb^T dO + Bd dS,            dS <- D dS + Qd^T dO + W^T dR

Rows past a sequence's end read as zero; their gates repeat G_C, so no exponent a padded lane
forms can overflow. DELTA and DPLR contract all of K against S (W S), so their programs hold the
whole key dimension; DECAY tiles it, except where it forms the output (one key block, K <=
``FUSED_DECAY_MAX_K``). ``launch_config`` (``state_launch.py``) is the table of blocks, warps and stages for every
transition; ``state_fwd`` widens DECAY's key block and sets two stages at K = 128 for FUSE_OUTPUT.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import (Chunks, alloc, chunk_gate_last_k, chunk_gates, chunk_gates_k, chunk_gates_raw_k,
                                      dot_at, exp, mm, while_loops)
from fastweight.kernels.state_launch import TRANSITIONS, launch_config

# the transitions, as the kernels' TRANSITION constexpr (a kernel reads globals only as constexprs; TRANSITIONS
# maps their names)
DECAY, DELTA, DPLR = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _rows(x, bos, T, i_t, heads, i_head, D: tl.constexpr, i_d, BT: tl.constexpr, BD: tl.constexpr):
    """The chunk's rows of a packed [1, T, heads, D] tensor: block (i_t, i_d) of [BT, BD]."""
    return tl.make_block_ptr(x + (bos * heads + i_head) * D, (T, D), (heads * D, 1), (i_t * BT, i_d * BD), (BT, BD),
                             (1, 0))


@triton.jit
def _bounds(cu_seqlens, i_n, OFF32: tl.constexpr):
    """Sequence i_n's (bos, eos), in int32 where every token offset of the launch fits (``OFF32``):
    64-bit row offsets cost the state passes registers they spill (sm_90: the delta forward at K =
    128 and 3 stages 216 B of stack, 40 B in int32)."""
    bos, eos = tl.load(cu_seqlens + i_n), tl.load(cu_seqlens + i_n + 1)
    if OFF32:
        bos, eos = bos.to(tl.int32), eos.to(tl.int32)
    else:
        bos, eos = bos.to(tl.int64), eos.to(tl.int64)
    return bos, eos


def _off32(*tensors) -> bool:
    """Whether every element offset of these tensors fits in int32 (``_bounds``)."""
    return all(t is None or t.numel() < 2 ** 31 for t in tensors)


@triton.jit
def _cols(x, bos, T, i_t, heads, i_head, D: tl.constexpr, i_d, BT: tl.constexpr, BD: tl.constexpr):
    """The chunk's rows of a packed [1, T, heads, D] tensor, transposed: block (i_d, i_t) of [BD, BT]."""
    return tl.make_block_ptr(x + (bos * heads + i_head) * D, (D, T), (1, heads * D), (i_d * BD, i_t * BT), (BD, BT),
                             (0, 1))


@triton.jit
def _state_block(x, i, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, i_k, i_v, BK: tl.constexpr,
                 BV: tl.constexpr):
    """Block (i_k, i_v) of state i of a [*, H, K, V] tensor (i = chunk * H + head)."""
    return tl.make_block_ptr(x + i.to(tl.int64) * K * V, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV), (1, 0))


@triton.jit
def _store_state(x, xl, i, b_x, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, i_k, i_v, BK: tl.constexpr,
                 BV: tl.constexpr, SPLIT: tl.constexpr):
    """Stores block (i_k, i_v) of state i: in x's dtype, or SPLIT in two 16-bit planes, x = b_x rounded
    and xl = the rounding's residual (b_x - x) rounded (``state_fwd(state_dtype="split")``)."""
    p_x = _state_block(x, i, H, K, V, i_k, i_v, BK, BV)
    b_hi = b_x.to(p_x.dtype.element_ty)
    tl.store(p_x, b_hi, boundary_check=(0, 1))
    if SPLIT:
        p_l = _state_block(xl, i, H, K, V, i_k, i_v, BK, BV)
        tl.store(p_l, (b_x - b_hi.to(tl.float32)).to(p_l.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _fwd_step(i_t, b_h, q, k, v, w, u, b, g, A, A2, Ai, beta, o, h, hl, r, bos, T, boh, i_h, i_k, i_v, scale,
              H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, TRANSITION: tl.constexpr, GATE: tl.constexpr,
              FUSE_OUTPUT: tl.constexpr, STORE_H: tl.constexpr, STORE_R: tl.constexpr, PRESCALED: tl.constexpr,
              FUSE_WY: tl.constexpr, KT: tl.constexpr, QK_GIVEN: tl.constexpr, RAW_GATE: tl.constexpr):
    """One chunk of the forward pass; returns the state at the chunk's end. RAW_GATE (DPLR): g is
    the raw log gate, summed here. PRESCALED (per-channel
    gate): q and k hold the gated rows qg = q exp(G) and kd = k exp(G_C - G) (``wy.recompute_w_u``).
    FUSE_WY (DELTA, scalar or no gate): the read from Ai and the raw rows, R = Ai Diag(beta) (V -
    Diag(gamma) K S), so W and U are never formed (v is V, w and u unused); 2: Ai holds Ai Diag(beta)
    (``kkt_solve(fold_beta=True)``), beta is not read. KT (DELTA, scalar or no
    gate): k read as K^T [BK, BT] from memory, the form both Q K^T and K^T R take. QK_GIVEN (DELTA,
    scalar or no gate, FUSE_OUTPUT): A holds the output's scores lower(Gamma * Q K^T)
    (``kkt_solve(q=...)``), read instead of formed."""
    o_i = tl.arange(0, BT)
    m_row = i_t * BT + o_i < T
    i_hk = i_h // (H // HK)
    # the order of the same operations sets the compiled schedule, which moves this kernel by up to
    # 30% on the H200: DPLR stores the state first, then reads k and its gates; the delta rule and
    # DECAY load the chunk's tiles first, store the state, and read their gates after W S
    if STORE_H and TRANSITION == DPLR:
        p_h = _state_block(h, (boh + i_t) * H + i_h, H, K, V, i_k, i_v, BK, BV)
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), boundary_check=(0, 1))
    if FUSE_OUTPUT:
        b_q = tl.load(_rows(q, bos, T, i_t, HK, i_hk, K, 0, BT, BK), boundary_check=(0, 1))
    if KT:
        b_kt = tl.load(_cols(k, bos, T, i_t, HK, i_hk, K, i_k, BT, BK), boundary_check=(0, 1))
        dt = b_kt.dtype
    else:
        b_k = tl.load(_rows(k, bos, T, i_t, HK, i_hk, K, i_k, BT, BK), boundary_check=(0, 1))
        dt = b_k.dtype
    if TRANSITION == DPLR:
        if RAW_GATE:
            b_gk, b_gklast = chunk_gates_raw_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
        else:
            b_gk, b_gklast = chunk_gates_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
        b_ek = tl.where(m_row[:, None], exp(b_gklast[None, :] - b_gk), 0.)
        b_hc = b_h.to(dt)
        b_w = tl.load(_rows(w, bos, T, i_t, H, i_h, K, 0, BT, BK), boundary_check=(0, 1))
    if TRANSITION == DELTA:
        if FUSE_WY:
            b_Ai = tl.load(_rows(Ai, bos, T, i_t, H, i_h, BT, 0, BT, BT), boundary_check=(0, 1))
            if FUSE_WY == 1:
                b_beta = tl.load(beta + (bos + i_t * BT + o_i) * H + i_h, mask=m_row, other=0.).to(tl.float32)
        else:
            b_w = tl.load(_rows(w, bos, T, i_t, H, i_h, K, 0, BT, BK), boundary_check=(0, 1))
        b_hc = b_h.to(dt)
    if STORE_H and TRANSITION != DPLR:
        _store_state(h, hl, (boh + i_t) * H + i_h, b_h, H, K, V, i_k, i_v, BK, BV, STORE_H == 2)
    if TRANSITION != DECAY:
        # the read R = U -/+ W S against the state at the chunk's start
        if FUSE_WY:
            b_vr = tl.load(_rows(v, bos, T, i_t, H, i_h, V, i_v, BT, BV), boundary_check=(0, 1)).to(tl.float32)
            # the rows' factors: beta (unless Ai holds Ai Diag(beta), FUSE_WY 2) times gamma
            if FUSE_WY == 1:
                b_vr = b_vr * b_beta[:, None]
                b_ks = b_beta
            if GATE == 1:
                b_g, b_glast = chunk_gates(g, bos, T, i_t, H, i_h, BT)
                if FUSE_WY == 1:
                    b_ks = b_beta * exp(b_g)
                else:
                    b_ks = exp(b_g)
            if KT:
                b_ks_v = mm(tl.trans(b_kt), b_hc)
                if FUSE_WY == 1 or GATE == 1:
                    b_ks_v = b_ks_v * b_ks[:, None]
                b_xr = b_vr - b_ks_v
            else:
                b_kr = b_k
                if FUSE_WY == 1 or GATE == 1:
                    b_kr = (b_k * b_ks[:, None]).to(dt)
                b_xr = b_vr - mm(b_kr, b_hc)
            b_r = mm(b_Ai.to(dt), b_xr.to(dt))
        else:
            b_u = tl.load(_rows(u, bos, T, i_t, H, i_h, V, i_v, BT, BV), boundary_check=(0, 1)).to(tl.float32)
            if TRANSITION == DELTA:
                b_r = b_u - mm(b_w, b_hc)
            else:
                b_r = b_u + mm(b_w, b_hc)
        if STORE_R:
            p_r = _rows(r, bos, T, i_t, H, i_h, V, i_v, BT, BV)
            tl.store(p_r, b_r.to(p_r.dtype.element_ty), boundary_check=(0, 1))
    if GATE == 1 and not FUSE_WY:
        b_g, b_glast = chunk_gates(g, bos, T, i_t, H, i_h, BT)
    if GATE == 2 and TRANSITION != DPLR:
        if PRESCALED:
            b_gklast = chunk_gate_last_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
        else:
            b_gk, b_gklast = chunk_gates_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
            b_ek = tl.where(m_row[:, None], exp(b_gklast[None, :] - b_gk), 0.)
    if FUSE_OUTPUT and TRANSITION == DPLR:
        # o = scale (q exp G) S + A_qk V + A_qb R (A_qk, A_qb scaled, lower-inclusive)
        m_causal = o_i[:, None] >= o_i[None, :]
        b_x = tl.load(_rows(v, bos, T, i_t, H, i_h, V, i_v, BT, BV), boundary_check=(0, 1))
        b_o = mm((b_q * exp(b_gk)).to(dt), b_hc) * scale
        p_A = tl.make_block_ptr(A + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        b_o += mm(tl.where(m_causal, tl.load(p_A, boundary_check=(0, 1)), 0.).to(dt), b_x.to(dt))
        p_A = tl.make_block_ptr(A2 + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        b_o += mm(tl.where(m_causal, tl.load(p_A, boundary_check=(0, 1)), 0.).to(dt), b_r.to(dt))
        p_o = _rows(o, bos, T, i_t, H, i_h, V, i_v, BT, BV)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
    elif FUSE_OUTPUT and TRANSITION == DECAY:
        # o = scale (q exp G) S + A V: A the intra kernel's scores (per-channel gate; scaled there), else
        # scale lower(Gamma * Q K^T) formed here, as decay_output_fwd_kernel forms them
        m_causal = o_i[:, None] >= o_i[None, :]
        b_hc = b_h.to(dt)
        if GATE == 2:
            b_o = mm((b_q * exp(b_gk)).to(dt), b_hc) * scale
            p_A = tl.make_block_ptr(A + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
            b_A = tl.where(m_causal, tl.load(p_A, boundary_check=(0, 1)), 0.)
        else:
            b_o = mm(b_q, b_hc)
            b_A = mm(b_q, tl.trans(b_k))
            if GATE == 1:
                b_o = b_o * exp(b_g)[:, None]
                b_A = b_A * exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
            else:
                b_A = tl.where(m_causal, b_A, 0.)
            b_o, b_A = b_o * scale, b_A * scale
        b_vo = tl.load(_rows(v, bos, T, i_t, H, i_h, V, i_v, BT, BV), boundary_check=(0, 1))
        b_o += mm(b_A.to(dt), b_vo.to(dt))
        p_o = _rows(o, bos, T, i_t, H, i_h, V, i_v, BT, BV)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
    elif FUSE_OUTPUT:
        if GATE == 2:
            if PRESCALED:
                b_o = mm(b_q, b_hc)
            else:
                b_o = mm((b_q * exp(b_gk)).to(dt), b_hc)
            p_A = tl.make_block_ptr(A + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
            b_A = tl.load(p_A, boundary_check=(0, 1))
        else:
            m_causal = o_i[:, None] >= o_i[None, :]
            b_o = mm(b_q, b_hc)
            if QK_GIVEN:
                # lower(Gamma * Q K^T), formed by the solve's kernel off the serial path
                p_A = tl.make_block_ptr(A + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (i_t * BT, 0), (BT, BT),
                                        (1, 0))
                b_A = tl.load(p_A, boundary_check=(0, 1))
            elif KT:
                b_A = mm(b_q, b_kt)
            else:
                b_A = mm(b_q, tl.trans(b_k))
            if GATE == 1:
                b_o = b_o * exp(b_g)[:, None]
                if not QK_GIVEN:
                    b_A = b_A * exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
            elif not QK_GIVEN:
                b_A = tl.where(m_causal, b_A, 0.)
        b_o = (b_o + mm(b_A.to(dt), b_r.to(dt))) * scale
        p_o = _rows(o, bos, T, i_t, H, i_h, V, i_v, BT, BV)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
    # the write: scalar gates scale the written rows, per-channel gates the write keys
    if TRANSITION == DELTA:
        b_x = b_r
    elif not (FUSE_OUTPUT and TRANSITION == DPLR):
        b_x = tl.load(_rows(v, bos, T, i_t, H, i_h, V, i_v, BT, BV), boundary_check=(0, 1)).to(tl.float32)
    if GATE == 1:
        b_x = b_x * exp(b_glast - b_g)[:, None]
        b_h = b_h * exp(b_glast)
    if KT:
        b_h += mm(b_kt, b_x.to(dt))
    else:
        b_kd = b_k
        if GATE == 2:
            if not PRESCALED:
                b_kd = (b_k * b_ek).to(dt)
            b_h = b_h * exp(b_gklast)[:, None]
        b_h += mm(tl.trans(b_kd), b_x.to(dt))
    if TRANSITION == DPLR:
        b_b = tl.load(_rows(b, bos, T, i_t, H, i_h, K, 0, BT, BK), boundary_check=(0, 1))
        b_h += mm(tl.trans((b_b * b_ek).to(dt)), b_r.to(dt))
    return b_h


@triton.jit
def state_fwd_kernel(q, k, v, w, u, b, g, A, A2, Ai, beta, h0, o, ht, h, hl, r, cu_seqlens, chunk_offsets, order, scale,
                     NT_ALL,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, TRANSITION: tl.constexpr, GATE: tl.constexpr,
                     FUSE_OUTPUT: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
                     STORE_H: tl.constexpr, STORE_R: tl.constexpr, UNIFORM: tl.constexpr,
                     WHILE_LOOP: tl.constexpr, PRESCALED: tl.constexpr, FUSE_WY: tl.constexpr,
                     KT: tl.constexpr, QK_GIVEN: tl.constexpr, OFF32: tl.constexpr, RAW_GATE: tl.constexpr):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # sequences longest first (Chunks.order); i_nh below is the (sequence, head) pair's state index
    i_n, i_h = tl.load(order + i_nh // H), i_nh % H
    i_nh = i_n * H + i_h
    bos, eos = _bounds(cu_seqlens, i_n, OFF32)
    T = (eos - bos).to(tl.int32)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(_state_block(h0, i_nh, H, K, V, i_k, i_v, BK, BV), boundary_check=(0, 1)).to(tl.float32)
    if WHILE_LOOP:
        # the interpreter cannot range() to a bound loaded through program_id
        NT = tl.cdiv(T, BT)
        i_t = 0
        while i_t < NT:
            b_h = _fwd_step(i_t, b_h, q, k, v, w, u, b, g, A, A2, Ai, beta, o, h, hl, r, bos, T, boh, i_h, i_k, i_v,
                            scale, H, HK, K, V, BT, BK, BV, TRANSITION, GATE, FUSE_OUTPUT, STORE_H, STORE_R,
                            PRESCALED, FUSE_WY, KT, QK_GIVEN, RAW_GATE)
            i_t += 1
    else:
        # compiled: a for loop, which Triton software-pipelines (the next chunk's loads overlap); its
        # bound from the host when every sequence has NT_ALL chunks (UNIFORM)
        if UNIFORM:
            NT = NT_ALL
        else:
            NT = tl.cdiv(T, BT)
        for i_t in range(0, NT):
            b_h = _fwd_step(i_t, b_h, q, k, v, w, u, b, g, A, A2, Ai, beta, o, h, hl, r, bos, T, boh, i_h, i_k, i_v,
                            scale, H, HK, K, V, BT, BK, BV, TRANSITION, GATE, FUSE_OUTPUT, STORE_H, STORE_R,
                            PRESCALED, FUSE_WY, KT, QK_GIVEN, RAW_GATE)
    if STORE_HT:
        tl.store(_state_block(ht, i_nh, H, K, V, i_k, i_v, BK, BV), b_h, boundary_check=(0, 1))


@triton.jit
def _bwd_step(i_t, b_dh, q, k, w, b, g, gq, A, do, dh, dhl, dr, gs, bos, T, boh, i_h, i_k, i_v, scale, H: tl.constexpr,
              HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, TRANSITION: tl.constexpr, GATE: tl.constexpr, GATE_SUMS: tl.constexpr,
              SPLIT: tl.constexpr):
    """One chunk of the backward pass, last chunk first; returns dS at the chunk's start. GATE_SUMS
    (per-channel gate): g is the raw log gate; the chunk's sums are formed here and stored to gs by the
    first V block's programs. SPLIT: dS stored in two 16-bit planes, dh and dhl (``_store_state``)."""
    o_i = tl.arange(0, BT)
    m_row = i_t * BT + o_i < T
    m_anticausal = o_i[:, None] <= o_i[None, :]
    i_hk = i_h // (H // HK)
    _store_state(dh, dhl, (boh + i_t) * H + i_h, b_dh, H, K, V, i_k, i_v, BK, BV, SPLIT)
    b_q = tl.load(_rows(q, bos, T, i_t, HK, i_hk, K, i_k, BT, BK), boundary_check=(0, 1))
    dt = b_q.dtype
    b_do = tl.load(_rows(do, bos, T, i_t, H, i_h, V, i_v, BT, BV), boundary_check=(0, 1)).to(dt)
    if GATE == 1:
        b_g, b_glast = chunk_gates(g, bos, T, i_t, H, i_h, BT)
        b_gq = b_g
        if gq is not None:
            b_gq = tl.load(gq + (bos + i_t * BT + o_i) * H + i_h, mask=m_row, other=0.)
        b_qd = (b_q * (exp(b_gq) * scale)[:, None]).to(dt)
    elif GATE == 2:
        if GATE_SUMS:
            b_gk, b_gklast = chunk_gates_raw_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
            if i_v == 0:
                tl.store(_rows(gs, bos, T, i_t, H, i_h, K, i_k, BT, BK), b_gk, boundary_check=(0, 1))
        else:
            b_gk, b_gklast = chunk_gates_k(g, bos, T, i_t, H, i_h, i_k, K, BT, BK)
        b_ek = tl.where(m_row[:, None], exp(b_gklast[None, :] - b_gk), 0.)
        b_gq = b_gk
        if gq is not None:
            b_gq = tl.load(_rows(gq, bos, T, i_t, H, i_h, K, i_k, BT, BK), boundary_check=(0, 1))
        b_qd = (b_q * exp(b_gq) * scale).to(dt)
    else:
        b_qd = (b_q * scale).to(dt)
    if TRANSITION != DECAY:
        b_w = tl.load(_rows(w, bos, T, i_t, H, i_h, K, 0, BT, BK), boundary_check=(0, 1))
        if TRANSITION == DELTA:
            # the write keys and A^T, [BT, BT]: entry (j, i) = k_j . q_i (gated), the output's scores
            b_k = tl.load(_rows(k, bos, T, i_t, HK, i_hk, K, 0, BT, BK), boundary_check=(0, 1))
            if GATE == 2:
                p_A = tl.make_block_ptr(A + (bos * H + i_h) * BT, (BT, T), (1, H * BT), (0, i_t * BT), (BT, BT),
                                        (0, 1))
                b_At = tl.load(p_A, boundary_check=(0, 1)).to(tl.float32)
                b_kd = (b_k * b_ek).to(dt)
            elif GATE == 1:
                b_At = mm(b_k, tl.trans(b_q)) * exp(tl.where(m_anticausal, b_g[None, :] - b_g[:, None],
                                                                float("-inf")))
                b_kd = (b_k * exp(b_glast - b_g)[:, None]).to(dt)
            else:
                b_At = tl.where(m_anticausal, mm(b_k, tl.trans(b_q)), 0.)
                b_kd = b_k
            if GATE == 2 and dt == tl.bfloat16:
                # KDA's scores A^T (fp32, O(1) products of decayed rows) kept in fp32 at TF32 for bf16:
                # rounded to bf16 they put dv at 1.11x fla's error (CPU, GPU emulation: 3.89e-3
                # against 3.51e-3; 3.60e-3 so)
                b_dr = dot_at(b_At * scale, b_do.to(tl.float32), "tf32") + mm(b_kd, b_dh.to(dt))
            else:
                b_dr = mm((b_At * scale).to(dt), b_do) + mm(b_kd, b_dh.to(dt))
        else:
            p_A = tl.make_block_ptr(A + (bos * H + i_h) * BT, (BT, T), (1, H * BT), (0, i_t * BT), (BT, BT), (0, 1))
            b_At = tl.where(m_anticausal & m_row[None, :], tl.load(p_A, boundary_check=(0, 1)), 0.)
            b_b = tl.load(_rows(b, bos, T, i_t, H, i_h, K, 0, BT, BK), boundary_check=(0, 1))
            b_dr = mm(b_At.to(dt), b_do) + mm((b_b * b_ek).to(dt), b_dh.to(dt))
        p_dr = _rows(dr, bos, T, i_t, H, i_h, V, i_v, BT, BV)
        tl.store(p_dr, b_dr.to(p_dr.dtype.element_ty), boundary_check=(0, 1))
    if GATE == 1:
        b_dh = b_dh * exp(b_glast)
    if GATE == 2:
        b_dh = b_dh * exp(b_gklast)[:, None]
    b_dh += mm(tl.trans(b_qd), b_do)
    if TRANSITION == DELTA:
        b_dh -= mm(tl.trans(b_w), b_dr.to(dt))
    if TRANSITION == DPLR:
        b_dh += mm(tl.trans(b_w), b_dr.to(dt))
    return b_dh


@triton.jit
def state_bwd_kernel(q, k, w, b, g, gq, A, do, dht, dh, dhl, dh0, dr, gs, cu_seqlens, chunk_offsets, order, scale,
                     H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, TRANSITION: tl.constexpr, GATE: tl.constexpr,
                     USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, WHILE_LOOP: tl.constexpr,
                     OFF32: tl.constexpr, GATE_SUMS: tl.constexpr, SPLIT: tl.constexpr):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # sequences longest first (Chunks.order); i_nh below is the (sequence, head) pair's state index
    i_n, i_h = tl.load(order + i_nh // H), i_nh % H
    i_nh = i_n * H + i_h
    bos, eos = _bounds(cu_seqlens, i_n, OFF32)
    T = (eos - bos).to(tl.int32)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(_state_block(dht, i_nh, H, K, V, i_k, i_v, BK, BV), boundary_check=(0, 1)).to(tl.float32)
    if WHILE_LOOP:
        i_t = tl.cdiv(T, BT) - 1
        while i_t >= 0:
            b_dh = _bwd_step(i_t, b_dh, q, k, w, b, g, gq, A, do, dh, dhl, dr, gs, bos, T, boh, i_h, i_k, i_v, scale,
                             H, HK, K, V, BT, BK, BV, TRANSITION, GATE, GATE_SUMS, SPLIT)
            i_t -= 1
    else:
        NT = tl.cdiv(T, BT)
        for i_c in range(0, NT):
            b_dh = _bwd_step(NT - 1 - i_c, b_dh, q, k, w, b, g, gq, A, do, dh, dhl, dr, gs, bos, T, boh, i_h, i_k,
                             i_v, scale, H, HK, K, V, BT, BK, BV, TRANSITION, GATE, GATE_SUMS, SPLIT)
    if STORE_DH0:
        tl.store(_state_block(dh0, i_nh, H, K, V, i_k, i_v, BK, BV), b_dh, boundary_check=(0, 1))


# the decay transition's pass forms the output (one key block: all of K) up to this key size
FUSED_DECAY_MAX_K = 128


def _gate_kind(g) -> int:
    return 0 if g is None else (1 if g.dim() == 3 else 2)


def _split(state_dtype, dtype: torch.dtype) -> bool:
    """Whether ``state_dtype`` asks for the two-plane 16-bit form ("split", for 16-bit inputs)."""
    if isinstance(state_dtype, str) and (state_dtype != "split" or dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"state_dtype: a torch dtype, None, or 'split' for 16-bit inputs; got {state_dtype!r} "
                         f"with {dtype} inputs")
    return state_dtype == "split"


def state_fwd(transition: str, k, v, chunks: Chunks, *, g=None, w=None, u=None, b=None, q=None, A=None,
              A2=None, scale: float = 1.0, initial_state=None, output_final_state: bool = False, store_h: bool = True,
              store_r: bool = False, fuse_output: bool = False, state_dtype=None, block_v=None,
              prescaled: bool = False, Ai=None, beta=None, k_transposed: bool = True, r_dtype=None,
              raw_gate: bool = False):
    """The forward state pass (module docstring).

    k: [1, T, HK, K] (q likewise, with ``fuse_output``); v: [1, T, H, V]; w, b: [1, T, H, K]; u:
    [1, T, H, V]; g: None, [1, T, H] or [1, T, H, K] (fp32 chunk-local cumsum); A: [1, T, H, BT]
    (DPLR: A_qk, and A2 A_qb, both with ``fuse_output``; delta, scalar or no gate: the output's scores
    lower(Gamma * Q K^T) of ``kkt_solve(q=...)``, read instead of formed in the pass; decay with a per-channel
    gate and ``fuse_output``: the intra scores of ``decay_intra.intra_fwd``, scaled, required there, K <=
    ``FUSED_DECAY_MAX_K``); initial_state: [N, H, K, V];
    ``prescaled`` (delta, per-channel g): k and q are the gated rows kd, qg [1, T, H, K] of
    ``wy.recompute_w_u``. ``Ai`` [1, T, H, BT] and ``beta`` [1, T, H] (delta,
    scalar or no gate) in place of w and u: the read is formed from v, R = Ai Diag(beta) (V -
    Diag(gamma) K S) (one [BT, BT] product more a chunk; W and U are not formed). ``Ai`` with
    ``beta=None``: Ai already holds Ai Diag(beta) (``kkt_solve(fold_beta=True)``), R = Ai (V -
    Diag(gamma) K S). ``state_dtype="split"`` (16-bit k, not DPLR): h in two planes of k's dtype, [2, NC, H,
    K, V], h[0] the state rounded and h[1] the rounding's residual rounded, so h[0] + h[1] carries ~16
    (bf16) or ~22 (fp16; fewer where the residual falls below fp16's normal range, |x| < ~0.25) bits in
    the bytes of one fp32 state, and a reader that wants h[0] alone (the 16-bit dots of the output kernel)
    reads half. Returns (h [NC,
    H, K, V] in ``state_dtype`` (default k's) or None, R [1, T, H, V] in ``r_dtype`` (default v's) or None, o [1,
    T, H, V] in v's dtype or None, final state fp32 or None). ``k_transposed`` (DELTA, scalar or no
    gate): k read as K^T tiles (False: as rows; the tiles made GDN's inference forward 7% faster on
    the H100, docs/bench/delta.md). ``raw_gate`` (dplr): g is the raw log gate [1, T, H, K], whose
    chunk sums the pass forms itself (no gate-sum tensor written before it or read)."""
    _, T, HK, K = k.shape
    H, V = v.shape[2], v.shape[-1]
    # the third stage where it is measured faster: no h kept, the read formed here, a scalar gate
    inference = not store_h and Ai is not None and _gate_kind(g) == 1
    BK, BV, warps, stages = launch_config(transition, K, V, k.element_size(), per_channel=_gate_kind(g) == 2,
                                          block_v=block_v, inference=inference)
    if fuse_output and transition == "decay":
        BK = max(BK, triton.next_power_of_2(K))  # the output needs all of K in one program
        # three stages of a per-channel gate's K = 128 tiles need 247 KB of shared memory (sm_90 has 227)
        stages = 2 if BK > 64 else stages
    kt = k_transposed and transition == "delta" and _gate_kind(g) != 2
    # the delta rule's loop takes its bound from the host when every sequence has NT chunks (its forward
    # keeping h is faster so on the H200); decay and DPLR read it from cu_seqlens, which is faster for them
    uniform = chunks.NT is not None and transition == "delta"
    dev = k.device
    split = _split(state_dtype, k.dtype)
    if split and transition == "dplr":
        raise ValueError("state_dtype='split' is not supported for the dplr transition's forward")
    if store_h and split:  # hi and lo planes, each in k's 16-bit dtype
        h = alloc((2, chunks.NC, H, K, V), dtype=k.dtype, device=dev)
    else:
        h = alloc((chunks.NC, H, K, V), dtype=state_dtype or k.dtype, device=dev) if store_h else None
    r = alloc(v.shape, dtype=r_dtype or v.dtype, device=dev) if store_r else None
    o = alloc(v.shape, dtype=v.dtype, device=dev) if fuse_output else None
    ht = alloc((chunks.N, H, K, V), dtype=torch.float32, device=dev) if output_final_state else None
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), chunks.N * H)
    fuse_wy = 0 if Ai is None else (1 if beta is not None else 2)
    if fuse_output and (q is None or (A is None and (transition == "dplr" or _gate_kind(g) == 2))
                        or (transition == "dplr" and A2 is None) or (transition == "decay" and K > FUSED_DECAY_MAX_K)):
        raise ValueError("`fuse_output` needs `q`, `A` with a per-channel gate, `A2` (A_qb) for dplr, and "
                         f"K <= {FUSED_DECAY_MAX_K} for decay")
    # the delta rule's scalar or no gate forms the output's scores in the pass unless A holds them
    qk_given = transition == "delta" and _gate_kind(g) != 2 and A is not None
    if qk_given and not fuse_output:
        raise ValueError("`A` (the output's scores) for the delta transition needs `fuse_output`")
    if fuse_wy and (transition != "delta" or _gate_kind(g) == 2):
        raise ValueError("`Ai` (the fused W/U read) needs the delta transition and a scalar or no gate")
    if raw_gate and (transition != "dplr" or _gate_kind(g) != 2):
        raise ValueError("`raw_gate` needs the dplr transition and a per-channel `g`")
    hi, lo = (h[0], h[1]) if store_h and split else (h, None)
    state_fwd_kernel[grid](q, k, v, w, u, b, g, A, A2, Ai, beta, initial_state, o, ht, hi, lo, r, chunks.cu_seqlens,
                           chunks.chunk_offsets, chunks.order, scale, chunks.NT or 0, H=H, HK=HK, K=K, V=V,
                           BT=chunks.BT, BK=BK, BV=BV, TRANSITION=TRANSITIONS[transition], GATE=_gate_kind(g),
                           FUSE_OUTPUT=fuse_output, USE_H0=initial_state is not None, STORE_HT=output_final_state,
                           STORE_H=2 if store_h and split else store_h, STORE_R=store_r, UNIFORM=uniform,
                           WHILE_LOOP=while_loops(),
                           PRESCALED=prescaled, FUSE_WY=fuse_wy, KT=kt, QK_GIVEN=qk_given,
                           OFF32=_off32(q, k, v, w, u, b, g, A, A2, Ai, beta, o, r), RAW_GATE=raw_gate,
                           num_warps=warps, num_stages=stages)
    return h, r, o, ht


def state_bwd(transition: str, q, do, chunks: Chunks, *, g=None, gq=None, k=None, w=None, b=None, A=None,
              scale: float = 1.0, dht=None, need_dh0: bool = False, state_dtype=None, dr_dtype=None,
              block_v=None, gate_sums=None):
    """The backward state pass (module docstring): q [1, T, HK, K], do [1, T, H, V], gq (RWKV-6's
    exclusive readout gate) as g, the rest as in :func:`state_fwd`. ``gate_sums`` [1, T, H, K] fp32
    (per-channel gate): g is the raw log gate, and the pass forms its chunk-local sums and stores them
    there (``cumsum.chunk_cumsum``'s, formed beside the pass's serial work instead of by a kernel of
    their own). Returns (dh [NC, H, K, V] in ``state_dtype`` (default q's; "split": [2, NC, H, K, V] as
    :func:`state_fwd`'s h), dR [1, T, H, V] in
    ``dr_dtype`` (default do's) or None (DECAY), d initial_state fp32 or None)."""
    if gate_sums is not None and (_gate_kind(g) != 2 or gq is not None or gate_sums.shape != g.shape):
        raise ValueError("`gate_sums` needs a per-channel `g` of its shape and no `gq`")
    _, T, HK, K = q.shape
    H, V = do.shape[2], do.shape[-1]
    BK, BV, warps, stages = launch_config(transition, K, V, q.element_size(), backward=True,
                                          per_channel=_gate_kind(g) == 2, block_v=block_v)
    dev = q.device
    split = _split(state_dtype, q.dtype)
    dh = alloc((2, chunks.NC, H, K, V) if split else (chunks.NC, H, K, V), dtype=q.dtype if split else
               state_dtype or q.dtype, device=dev)
    dr = alloc(do.shape, dtype=dr_dtype or do.dtype, device=dev) if transition != "decay" else None
    dh0 = alloc((chunks.N, H, K, V), dtype=torch.float32, device=dev) if need_dh0 else None
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), chunks.N * H)
    state_bwd_kernel[grid](q, k, w, b, g, gq, A, do, dht, dh[0] if split else dh, dh[1] if split else None, dh0, dr,
                           gate_sums, chunks.cu_seqlens,
                           chunks.chunk_offsets, chunks.order, scale, H=H, HK=HK, K=K, V=V, BT=chunks.BT, BK=BK,
                           BV=BV, TRANSITION=TRANSITIONS[transition], GATE=_gate_kind(g), USE_DHT=dht is not None,
                           STORE_DH0=need_dh0, WHILE_LOOP=while_loops(),
                           OFF32=_off32(q, k, w, b, g, gq, A, do, dr, gate_sums), GATE_SUMS=gate_sums is not None,
                           SPLIT=split,
                           num_warps=warps, num_stages=stages)
    return dh, dr, dh0
