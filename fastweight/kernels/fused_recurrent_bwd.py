"""Backward of the fused recurrent kernel: a reverse-time pass and a forward recompute pass.

For the generic step (all vectors fp32, ``w_t = exp(gk_t)``, ``r_t = S_{t-1}^T b_t``)

    S_t = P_t + a_t r_t^T + k_t v_t^T,   P_t = Diag(w_t) S_{t-1}        o_t = S_t^T (scale q_t)

with ``dS_t`` the gradient reaching ``S_t`` (from the future and from ``o_t``) and
``dP_t = Diag(w_{t+1}) dS_{t+1}`` (``dht`` at a sequence's last token):

    dv_t = dS_t^T k_t    dr_t = dS_t^T a_t    dS_{t-1} = Diag(w_t) dS_t + b_t dr_t^T   (reverse pass)
    dk'_t = dP_t v_t     da'_t = dP_t r_t                                              (reverse pass)
    dq'_t = scale P_t do_t    db'_t = P_{t-1} dr_t                                     (forward pass)
    dgk_t = sum_{s>=t} (q_s dq'_s - [s not last] (k_s dk'_s + a_s da'_s)) + sum_{s>t} b_s db'_s
            + rowsum(dht * P_T)                                      (elementwise products)

The primed gradients leave out the pairs of a write at ``t`` (``k_t v_t^T``, ``a_t r_t^T``) and a
read of ``S_t`` (``q_t``'s readout, ``b_{t+1}``'s, ``dht``): in the gate identity those terms
have no decay between them and cancel exactly, so leaving them out keeps every term O(w) like
``dgk_t`` itself (``docs/fused_recurrent.md``). The full ``dq, dk, da, db`` are the primed ones
plus those rank-one pairs, added here. No state is stored: the forward kernel keeps ``r_t``
(``[B, T, HV, V]``), the reverse pass keeps ``dr_t``, and neither pass needs ``S_{t-1}`` and
``dS_t`` at once. With ``READOUT_PREV`` (RWKV-6) ``o_t`` reads ``S_{t-1}``: its readout is a read
by the next token, like ``b``'s (``dq'_{t+1} = scale P_t do_{t+1}``). Every K-vector gradient is a
sum over V and comes back per V block (``[NV, B, T, HV, K]``), summed here. The kernels see one
head layout (H = HV); the maps from each op's own inputs (tied keys, l2 norm, gate
parameterisation, RWKV-6's bonus) are differentiated by PyTorch autograd in ``fused_recurrent.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels import fused_recurrent as base
from fastweight.kernels.common import exp


@triton.jit(do_not_specialize=["T", "TT"])
def fused_recurrent_bwd_reverse_kernel(
    q, k, v, a, b, g, r, do, dht, h0, dh0, dk, dv, da, dr, dg_initial, cu_seqlens,
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

    # b_dh enters step t as dP_t = Diag(w_{t+1}) dS_{t+1} (dht at the last token)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0).to(tl.float32)
    # the next token's reads of S_t, added after this token's writes have met dP_t:
    # b_{t+1} dr_{t+1}^T, and with READOUT_PREV scale q_{t+1} do_{t+1}^T
    b_b_next = tl.zeros([BK], dtype=tl.float32)
    b_dr_next = tl.zeros([BV], dtype=tl.float32)
    b_q_next = tl.zeros([BK], dtype=tl.float32)
    b_do_next = tl.zeros([BV], dtype=tl.float32)
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
            b_w = exp(tl.load(g + i_tok * H + i_h).to(tl.float32))
        elif GATE == 2:
            b_w = exp(tl.load(g + o_tk, mask=m_k, other=0).to(tl.float32))

        # dk'_t = dP_t v_t, da'_t = dP_t r_t (the rest of dk_t, da_t is rank one, added in PyTorch)
        tl.store(dk + o_pk, tl.sum(b_dh * b_v[None, :], 1), mask=m_k)
        if LOW_RANK:
            tl.store(da + o_pk, tl.sum(b_dh * b_r[None, :], 1), mask=m_k)
        # dS_t = dP_t + the reads of S_t
        if LOW_RANK:
            b_dh += b_b_next[:, None] * b_dr_next[None, :]
        if READOUT_PREV:
            b_dh += b_q_next[:, None] * b_do_next[None, :]
        else:
            b_dh += b_q[:, None] * b_do[None, :]
        tl.store(dv + o_tv, tl.sum(b_dh * b_k[:, None], 0), mask=m_v)
        if LOW_RANK:
            b_dr = tl.sum(b_dh * b_a[:, None], 0)
            tl.store(dr + o_tv, b_dr, mask=m_v)
            b_b_next, b_dr_next = b_b, b_dr
        if READOUT_PREV:
            b_q_next, b_do_next = b_q, b_do
        if GATE == 1:
            b_dh = b_dh * b_w
        elif GATE == 2:
            b_dh = b_dh * b_w[:, None]
        t -= 1
    if STORE_DH0:
        if GATE:
            # rowsum(dP_{-1} * h0) = dgk_0: the gate sum's other end (see _gate_gradient)
            b_h0 = tl.load(h0 + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0).to(tl.float32)
            tl.store(dg_initial + (i_v.to(tl.int64) * tl.num_programs(1) + i_nh) * K + o_k,
                     tl.sum(b_dh * b_h0, 1), mask=m_k)
        # dS_{-1}: dP_{-1} plus token 0's reads of the initial state
        if LOW_RANK:
            b_dh += b_b_next[:, None] * b_dr_next[None, :]
        if READOUT_PREV:
            b_dh += b_q_next[:, None] * b_do_next[None, :]
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + o_h, b_dh, mask=m_h)


@triton.jit(do_not_specialize=["T", "TT"])
def fused_recurrent_bwd_forward_kernel(
    q, k, v, a, b, g, do, dr, h0, dht, dq, db, dg_final, cu_seqlens,
    scale, T, TT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, LOW_RANK: tl.constexpr, READOUT_PREV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
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

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0).to(tl.float32)
    # token 0's reads of the initial state: nothing was written before them
    if T > 0:
        o_tv = (bos * H + i_h) * V + o_v
        o_pk = i_v.to(tl.int64) * TT * H * K + (bos * H + i_h) * K + o_k
        if READOUT_PREV:
            b_do = tl.load(do + o_tv, mask=m_v, other=0).to(tl.float32)
            tl.store(dq + o_pk, scale * tl.sum(b_h * b_do[None, :], 1), mask=m_k)
        if LOW_RANK:
            b_dr = tl.load(dr + o_tv, mask=m_v, other=0)
            tl.store(db + o_pk, tl.sum(b_h * b_dr[None, :], 1), mask=m_k)
    # rowsum(dht * P_{T-1}): the final state's term of the gate sum, without the last token's writes
    b_dg_final = tl.zeros([BK], dtype=tl.float32)
    t = tl.zeros([], dtype=tl.int64)
    while t < T:
        i_tok = bos + t
        o_tk = (i_tok * H + i_h) * K + o_k
        o_tv = (i_tok * H + i_h) * V + o_v
        o_pk = i_v.to(tl.int64) * TT * H * K + o_tk
        # the next token's reads of S_t see the pre-write state too; masked past the last token
        m_next = t + 1 < T
        b_k = tl.load(k + o_tk, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_v, other=0).to(tl.float32)
        if READOUT_PREV:
            b_do = tl.load(do + o_tv + H * V, mask=m_v & m_next, other=0).to(tl.float32)
        else:
            b_do = tl.load(do + o_tv, mask=m_v, other=0).to(tl.float32)
        if LOW_RANK:
            b_a = tl.load(a + o_tk, mask=m_k, other=0).to(tl.float32)
            b_b = tl.load(b + o_tk, mask=m_k, other=0).to(tl.float32)
            b_dr = tl.load(dr + o_tv + H * V, mask=m_v & m_next, other=0)
        if GATE == 1:
            b_w = exp(tl.load(g + i_tok * H + i_h).to(tl.float32))
        elif GATE == 2:
            b_w = exp(tl.load(g + o_tk, mask=m_k, other=0).to(tl.float32))

        if LOW_RANK:
            b_r = tl.sum(b_b[:, None] * b_h, 0)
        # P_t = Diag(w_t) S_{t-1}: the state before this token's writes
        if GATE == 1:
            b_h = b_h * b_w
        elif GATE == 2:
            b_h = b_h * b_w[:, None]
        # dq'_t = scale P_t do_t (READOUT_PREV: dq'_{t+1} = scale P_t do_{t+1}), db'_{t+1} = P_t dr_{t+1}
        if READOUT_PREV:
            tl.store(dq + o_pk + H * K, scale * tl.sum(b_h * b_do[None, :], 1), mask=m_k & m_next)
        else:
            tl.store(dq + o_pk, scale * tl.sum(b_h * b_do[None, :], 1), mask=m_k)
        if LOW_RANK:
            tl.store(db + o_pk + H * K, tl.sum(b_h * b_dr[None, :], 1), mask=m_k & m_next)
        if USE_DHT and GATE:
            if t == T - 1:
                b_dht = tl.load(dht + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0).to(tl.float32)
                b_dg_final = tl.sum(b_dht * b_h, 1)
        if LOW_RANK:
            b_h += b_a[:, None] * b_r[None, :]
        b_h += b_k[:, None] * b_v[None, :]
        t += 1
    if USE_DHT and GATE:
        tl.store(dg_final + (i_v.to(tl.int64) * tl.num_programs(1) + i_nh) * K + o_k, b_dg_final, mask=m_k)


def _cumsums(x: torch.Tensor, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_{s < t} x_s, sum_{s >= t} x_s) along dim 1, within each sequence of ``cu_seqlens``."""
    T = x.shape[1]
    prefix = torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(1)], 1)  # [B, T + 1, ...]: sum_{s < t}
    if cu_seqlens is None:
        start, end = prefix[:, :1], prefix[:, T:]
    else:
        lengths = cu_seqlens.diff()
        start = prefix[:, torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=T)]
        end = prefix[:, torch.repeat_interleave(cu_seqlens[1:], lengths, output_size=T)]
    return prefix[:, :T] - start, end - prefix[:, :T]


def _per_token(x: torch.Tensor, B: int, T: int, cu_seqlens) -> torch.Tensor:
    """A per-sequence quantity [N, ...] broadcast to tokens: [B, T or 1, ...]."""
    if cu_seqlens is None:
        return x[:, None]
    seq = torch.repeat_interleave(torch.arange(x.shape[0], device=x.device), cu_seqlens.diff(),
                                  output_size=T)
    return x[seq][None]


def _last_token(x: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """[1 or B, T, 1, 1] bool: whether token t is the last of its sequence."""
    T = x.shape[1]
    last = torch.zeros(T + 1, dtype=torch.bool, device=x.device)
    if cu_seqlens is None:
        last[T] = True
    else:
        last[cu_seqlens[1:]] = True
    return last[1:].view(1, T, 1, 1)


def _shift(x: torch.Tensor, step: int, last: torch.Tensor) -> torch.Tensor:
    """x_{t+step} (step = 1 or -1) along dim 1, zero where that token is in another sequence."""
    if step == 1:
        return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1).masked_fill(last, 0)
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1].masked_fill(last[:, :-1], 0)], 1)


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum(-1, keepdim=True)


def _gate_gradient(q, k, a, b, dq, dk, da, db, dg_final, dg_initial, last, cu_seqlens, readout_prev):
    """dgk [B, T, H, K] in float64 from the kernels' primed terms (the identity in the module docstring).

    Per token ``dgk_t = dgk_{t+1} + terms_t``, with ``terms_t = q_t dq'_t - k_t dk'_t - a_t da'_t +
    b_{t+1} db'_{t+1}`` (RWKV-6: ``q_{t+1} dq'_{t+1}`` in place of ``q_t dq'_t``; the last token's
    writes meet only dht, a pair left out of ``dg_final`` as well). Summed from the end,
    ``dgk_t = rowsum(dht * P_T) + sum_{s >= t} terms_s``; from the start, ``dgk_t = dgk_0 -
    sum_{s < t} terms_s`` with ``dgk_0 = rowsum(dP_{-1} * h0)``. Both are exact; each token takes
    the one whose parts are smaller in magnitude (the rounding it inherits): with a loss on the
    state alone, early tokens' gradients are far smaller than the final state's term.
    """
    B, T = q.shape[:2]
    products = [q.double() * dq] if not readout_prev else [_shift(q.double() * dq, 1, last)]
    products.append(-(k.double() * dk).masked_fill(last, 0))
    if a is not None:
        products.append(-(a.double() * da).masked_fill(last, 0))
        products.append(_shift(b.double() * db, 1, last))
    terms, size = sum(products), sum(p.abs() for p in products)
    (before, after), (size_before, size_after) = _cumsums(terms, cu_seqlens), _cumsums(size, cu_seqlens)
    end = start = torch.zeros_like(terms[:, :1])
    if dg_final is not None:
        end = _per_token(dg_final.sum(0).double(), B, T, cu_seqlens)
    if dg_initial is not None:
        start = _per_token(dg_initial.sum(0).double(), B, T, cu_seqlens)
    from_start = size_before + start.abs() < size_after + end.abs()
    return torch.where(from_start, start - before, end + after)


def fused_recurrent_bwd(q, k, v, a, b, g, r, do, dht, h0, *, scale: float, cu_seqlens=None,
                        readout_prev: bool = False, block_v=None, num_warps=None):
    """Gradients of the generic step. q, k, a, b: [B, T, H, K]; v, r, do: [B, T, H, V];
    g: [B, T, H] (scalar log decay), [B, T, H, K] or None; dht, h0: [N, H, K, V] or None.

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
    dg_final = base.buffer(q, NV, N, H, K, dtype=f32) if dht is not None and gate else None
    dg_initial = base.buffer(q, NV, N, H, K, dtype=f32) if h0 is not None and gate else None
    grid = (NV, N * H)
    common = dict(H=H, K=K, V=V, BK=BK, BV=BV, GATE=gate, LOW_RANK=low_rank, READOUT_PREV=readout_prev,
                  USE_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None, num_warps=warps)
    fused_recurrent_bwd_reverse_kernel[grid](
        q, k, v, a, b, g, r, do, dht, h0, dh0, dk, dv, da, dr, dg_initial, cu_seqlens, scale, T, TT,
        STORE_DH0=dh0 is not None, **common)
    fused_recurrent_bwd_forward_kernel[grid](
        q, k, v, a, b, g, do, dr, h0, dht, dq, db, dg_final, cu_seqlens, scale, T, TT,
        USE_INITIAL_STATE=h0 is not None, **common)
    dq, dk = dq.sum(0), dk.sum(0)
    if low_rank:
        da, db = da.sum(0), db.sum(0)

    last = _last_token(q, cu_seqlens)
    dg = None
    if g is not None:
        dg = _gate_gradient(q, k, a, b, dq, dk, da, db, dg_final, dg_initial, last, cu_seqlens, readout_prev)
        dg = (dg.sum(-1) if gate == 1 else dg).float()

    # the full gradients: each write at t (k_t v_t^T, a_t r_t^T) against each read of S_t (its key
    # x, its value y: scale q_t do_t^T, or q_{t+1} with READOUT_PREV; b_{t+1} dr_{t+1}^T) adds
    # x (y . z) to the write key's gradient and u (z . y) to the read key's; dht's pair is in dk', da'
    q_next = readout_prev
    x_q, y_q = (_shift(q, 1, last), _shift(do.float(), 1, last)) if q_next else (q, do.float())
    readers = [("q", scale * x_q, y_q, scale, q_next)]
    if low_rank:
        readers.append(("b", _shift(b.float(), 1, last), _shift(dr, 1, last), 1.0, True))
    writers = [("k", k.float(), v.float())] + ([("a", a.float(), r)] if low_rank else [])
    grads = dict(q=dq, k=dk, a=da, b=db)
    for read, x, y, factor, next_token in readers:
        correction = 0
        for write, u, z in writers:
            yz = _dot(y, z)
            grads[write] = grads[write] + x * yz
            correction = correction + factor * u * yz
        # a read by the next token: its correction belongs to token t + 1
        grads[read] = grads[read] + (_shift(correction, -1, last) if next_token else correction)
    return grads["q"], grads["k"], dv, grads["a"], grads["b"], dg, dh0
