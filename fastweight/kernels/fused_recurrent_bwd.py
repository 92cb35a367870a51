"""Backward of the fused recurrent kernel: a reverse-time pass and a forward recompute pass.

For the generic step (all vectors fp32, ``w_t = exp(gk_t)``, ``r_t = S_{t-1}^T b_t``)

    S_t = Diag(w_t) S_{t-1} + a_t r_t^T + k_t v_t^T        o_t = S_t^T (scale q_t)

with ``dS_t`` the gradient reaching ``S_t`` (from the future and from ``o_t``):

    dk_t = dS_t v_t    dv_t = dS_t^T k_t    da_t = dS_t r_t    dr_t = dS_t^T a_t
    dS_{t-1} = Diag(w_t) dS_t + b_t dr_t^T                           (reverse pass)
    dq_t = scale S_t do_t    db_t = S_{t-1} dr_t                      (forward pass)
    dgk_t = sum_{s>=t} (q_s dq_s - k_s dk_s - a_s da_s) + sum_{s>t} b_s db_s
            + rowsum(dS_T * S_T)                                        (elementwise products)

No state is stored: the forward kernel keeps ``r_t`` (``[B, T, HV, V]``), the reverse pass
keeps ``dr_t``, and the gate gradient comes from the identity above (derived in
``docs/fused_recurrent.md``), so neither pass needs ``S_{t-1}`` and ``dS_t`` at once.
With ``READOUT_PREV`` (RWKV-6) ``o_t`` reads ``S_{t-1}``: its ``q dq`` term moves to the
exclusive sum. Every K-vector gradient is a sum over V and comes back per V block
(``[NV, B, T, HV, K]``), summed here. The kernels see one head layout (H = HV); the maps
from each op's own inputs (tied keys, l2 norm, gate parameterisation, RWKV-6's bonus) are
differentiated by PyTorch autograd in ``fused_recurrent.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels import fused_recurrent as base


@triton.jit(do_not_specialize=["T", "TT"])
def fused_recurrent_bwd_reverse_kernel(
    q, k, v, a, b, g, r, do, dht, dh0, dk, dv, da, dr, cu_seqlens,
    scale, T, TT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, LOW_RANK: tl.constexpr, READOUT_PREV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
    else:
        bos = i_n.to(tl.int64) * T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0).to(tl.float32)
    t = tl.zeros([], dtype=tl.int64) + T - 1
    while t >= 0:
        i_tok = bos + t
        o_tk = (i_tok * H + i_h) * K + o_k
        o_tv = (i_tok * H + i_h) * V + o_v
        # the partial of V block i_v: [NV, TT tokens, H, K]
        o_pk = i_v.to(tl.int64) * TT * H * K + o_tk
        # every load before any store: the compiler cannot move a load above a store that may alias it
        b_q = tl.load(q + o_tk, mask=m_k, other=0).to(tl.float32) * scale
        b_k = tl.load(k + o_tk, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_v, other=0).to(tl.float32)
        b_do = tl.load(do + o_tv, mask=m_v, other=0).to(tl.float32)
        if LOW_RANK:
            b_a = tl.load(a + o_tk, mask=m_k, other=0).to(tl.float32)
            b_b = tl.load(b + o_tk, mask=m_k, other=0).to(tl.float32)
            b_r = tl.load(r + o_tv, mask=m_v, other=0)
        if GATE == 1:
            b_w = tl.exp(tl.load(g + i_tok * H + i_h).to(tl.float32))
        elif GATE == 2:
            b_w = tl.exp(tl.load(g + o_tk, mask=m_k, other=0).to(tl.float32))

        if not READOUT_PREV:
            b_dh += b_q[:, None] * b_do[None, :]
        tl.store(dk + o_pk, tl.sum(b_dh * b_v[None, :], 1), mask=m_k)
        tl.store(dv + o_tv, tl.sum(b_dh * b_k[:, None], 0), mask=m_v)
        if LOW_RANK:
            tl.store(da + o_pk, tl.sum(b_dh * b_r[None, :], 1), mask=m_k)
            b_dr = tl.sum(b_dh * b_a[:, None], 0)
            tl.store(dr + o_tv, b_dr, mask=m_v)
        # dS_{t-1} = Diag(w_t) dS_t + b_t dr_t^T
        if GATE == 1:
            b_dh = b_dh * b_w
        elif GATE == 2:
            b_dh = b_dh * b_w[:, None]
        if LOW_RANK:
            b_dh += b_b[:, None] * b_dr[None, :]
        if READOUT_PREV:
            b_dh += b_q[:, None] * b_do[None, :]
        t -= 1
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_h, b_dh, mask=m_h)


@triton.jit(do_not_specialize=["T", "TT"])
def fused_recurrent_bwd_forward_kernel(
    q, k, v, a, b, g, do, dr, h0, dq, db, cu_seqlens,
    scale, T, TT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, LOW_RANK: tl.constexpr, READOUT_PREV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = eos - bos
    else:
        bos = i_n.to(tl.int64) * T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                       mask=m_h, other=0).to(tl.float32)
    t = tl.zeros([], dtype=tl.int64)
    while t < T:
        i_tok = bos + t
        o_tk = (i_tok * H + i_h) * K + o_k
        o_tv = (i_tok * H + i_h) * V + o_v
        o_pk = i_v.to(tl.int64) * TT * H * K + o_tk
        b_k = tl.load(k + o_tk, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_v, other=0).to(tl.float32)
        b_do = tl.load(do + o_tv, mask=m_v, other=0).to(tl.float32)
        if LOW_RANK:
            b_a = tl.load(a + o_tk, mask=m_k, other=0).to(tl.float32)
            b_b = tl.load(b + o_tk, mask=m_k, other=0).to(tl.float32)
            b_dr = tl.load(dr + o_tv, mask=m_v, other=0)
        if GATE == 1:
            b_w = tl.exp(tl.load(g + i_tok * H + i_h).to(tl.float32))
        elif GATE == 2:
            b_w = tl.exp(tl.load(g + o_tk, mask=m_k, other=0).to(tl.float32))

        if READOUT_PREV:
            b_dq = scale * tl.sum(b_h * b_do[None, :], 1)
        if LOW_RANK:
            b_db = tl.sum(b_h * b_dr[None, :], 1)
            b_r = tl.sum(b_b[:, None] * b_h, 0)
        if GATE == 1:
            b_h = b_h * b_w
        elif GATE == 2:
            b_h = b_h * b_w[:, None]
        if LOW_RANK:
            b_h += b_a[:, None] * b_r[None, :]
        b_h += b_k[:, None] * b_v[None, :]
        if not READOUT_PREV:
            b_dq = scale * tl.sum(b_h * b_do[None, :], 1)
        tl.store(dq + o_pk, b_dq, mask=m_k)
        if LOW_RANK:
            tl.store(db + o_pk, b_db, mask=m_k)
        t += 1


def _reverse_cumsum(x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """sum_{s >= t} x_s along dim 1, within each sequence of ``cu_seqlens`` (one cumsum, no flips)."""
    T = x.shape[1]
    prefix = torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(1)], 1)  # [B, T + 1, ...]: sum_{s < t}
    if cu_seqlens is None:
        end = prefix[:, T:]
    else:
        end = prefix[:, torch.repeat_interleave(cu_seqlens[1:], cu_seqlens.diff(), output_size=T)]
    return end - prefix[:, :T]


def _per_token(x: torch.Tensor, B: int, T: int, cu_seqlens) -> torch.Tensor:
    """A per-sequence quantity [N, ...] broadcast to tokens: [B, T or 1, ...]."""
    if cu_seqlens is None:
        return x[:, None]
    seq = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), cu_seqlens.diff(),
                                  output_size=T)
    return x[seq][None]


def fused_recurrent_bwd(q, k, v, a, b, g, r, do, dht, h0, ht, *, scale: float, cu_seqlens=None,
                        readout_prev: bool = False, block_v=None, num_warps=None):
    """Gradients of the generic step. q, k, a, b: [B, T, H, K]; v, r, do: [B, T, H, V];
    g: [B, T, H] (scalar log decay), [B, T, H, K] or None; dht, h0, ht: [N, H, K, V] or None
    (``ht`` is the forward's final state, needed with ``dht``).

    Returns (dq, dk, dv, da, db, dg, dh0) in fp32 (None where the input is None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    TT = B * T
    BK = triton.next_power_of_2(K)
    BV, warps = base.default_block_v(K, V, backward=True)
    BV, warps = block_v or BV, num_warps or warps
    NV = triton.cdiv(V, BV)
    low_rank = a is not None
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
    cont = lambda x: None if x is None else x.contiguous()  # noqa: E731
    a, b, g, r, h0, dht = map(cont, (a, b, g, r, h0, dht))

    f32 = torch.float32
    dq, dk = (base.buffer(q, NV, B, T, H, K, dtype=f32) for _ in range(2))
    da, db = (base.buffer(q, NV, B, T, H, K, dtype=f32) for _ in range(2)) if low_rank else (None, None)
    dv = base.buffer(q, B, T, H, V, dtype=f32)
    dr = base.buffer(q, B, T, H, V, dtype=f32) if low_rank else None
    dh0 = base.buffer(q, N, H, K, V, dtype=f32) if h0 is not None else None
    grid = (NV, N * H)
    common = dict(H=H, K=K, V=V, BK=BK, BV=BV, GATE=gate, LOW_RANK=low_rank, READOUT_PREV=readout_prev,
                  IS_VARLEN=cu_seqlens is not None, num_warps=warps)
    fused_recurrent_bwd_reverse_kernel[grid](
        q, k, v, a, b, g, r, do, dht, dh0, dk, dv, da, dr, cu_seqlens, scale, T, TT,
        USE_DHT=dht is not None, STORE_DH0=dh0 is not None, **common)
    fused_recurrent_bwd_forward_kernel[grid](
        q, k, v, a, b, g, do, dr, h0, dq, db, cu_seqlens, scale, T, TT,
        USE_INITIAL_STATE=h0 is not None, **common)
    dq, dk = dq.sum(0), dk.sum(0)
    if low_rank:
        da, db = da.sum(0), db.sum(0)

    dg = None
    if g is not None:
        # the gate gradient from the identity in the module docstring, summed in float64: its
        # terms can be much larger than their sum (docs/fused_recurrent.md, Precision)
        qdq = q.double() * dq
        inclusive = -k.double() * dk + (0 if readout_prev else qdq)
        exclusive = qdq if readout_prev else torch.zeros_like(inclusive)
        if low_rank:
            inclusive = inclusive - a.double() * da
            exclusive = exclusive + b.double() * db
        dg = _reverse_cumsum(inclusive + exclusive, cu_seqlens) - exclusive
        if dht is not None:
            dg = dg + _per_token((dht.float() * ht.float()).sum(-1), B, T, cu_seqlens)
        dg = (dg.sum(-1) if gate == 1 else dg).float()
    return dq, dk, dv, da, db, dg, dh0
