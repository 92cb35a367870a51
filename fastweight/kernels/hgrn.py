"""HGRN's elementwise recurrence (fla's ``hgrn`` op), one program per sequence and block of channels.

    h_t = exp(g_t) * h_{t-1} + x_t,   o_t = h_t                 (elementwise over D; h_0 = initial state)

Backward (reverse time, ``dh`` the gradient reaching h_t from o_t, the future and ``dht``):

    dh_t = do_t + exp(g_{t+1}) dh_{t+1}     dx_t = dh_t     dg_t = dh_t exp(g_t) h_{t-1}     dh_0 = exp(g_1) dh_1

h_{t-1} is read back from the forward's output (o_{t-1}; h_0 at a sequence's first token), never
formed as (h_t - x_t) exp(-g_t), which overflows under a strong decay. The state is D floats, so a
token is a few vector operations and the kernel is a stream over [T, BD] tiles: x, g read once,
o written once (forward); do, g, o read, dx, dg written (backward). Every value is fp32 inside.
x, g, o: [B, T, D] (or [1, T_total, D] with ``cu_seqlens`` [N+1]); states [N, D] fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import exp

BD = 64


@triton.jit
def _sequence(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence ``i_n``: from ``cu_seqlens``, else the i_n-th row of T."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n.to(tl.int64) * T
    return bos, T


@triton.jit(do_not_specialize=["T"])
def hgrn_fwd_kernel(x, g, o, h0, ht, cu_seqlens, T, D, BD: tl.constexpr, USE_H0: tl.constexpr,
                    STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_n = tl.program_id(1)
    bos, T = _sequence(cu_seqlens, i_n, T, IS_VARLEN)
    o_d = tl.program_id(0) * BD + tl.arange(0, BD)
    m_d = o_d < D
    h = tl.zeros([BD], dtype=tl.float32)
    if USE_H0:
        h += tl.load(h0 + i_n * D + o_d, mask=m_d, other=0).to(tl.float32)
    p = bos * D + o_d
    # a while loop, not range(T): the interpreter cannot iterate to a runtime bound
    t = tl.zeros([], dtype=tl.int64)
    while t < T:
        b_x = tl.load(x + p, mask=m_d, other=0).to(tl.float32)
        b_g = tl.load(g + p, mask=m_d, other=0).to(tl.float32)
        h = exp(b_g) * h + b_x
        tl.store(o + p, h.to(o.dtype.element_ty), mask=m_d)
        p += D
        t += 1
    if STORE_HT:
        tl.store(ht + i_n * D + o_d, h, mask=m_d)


@triton.jit(do_not_specialize=["T"])
def hgrn_bwd_kernel(g, o, h0, do, dht, dx, dg, dh0, cu_seqlens, T, D, BD: tl.constexpr, USE_H0: tl.constexpr,
                    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_n = tl.program_id(1)
    bos, T = _sequence(cu_seqlens, i_n, T, IS_VARLEN)
    o_d = tl.program_id(0) * BD + tl.arange(0, BD)
    m_d = o_d < D
    dh = tl.zeros([BD], dtype=tl.float32)
    if USE_DHT:
        dh += tl.load(dht + i_n * D + o_d, mask=m_d, other=0).to(tl.float32)
    first = tl.zeros([BD], dtype=tl.float32)
    if USE_H0:
        first += tl.load(h0 + i_n * D + o_d, mask=m_d, other=0).to(tl.float32)
    p = (bos + T - 1) * D + o_d
    t = T - 1
    while t >= 0:
        dh += tl.load(do + p, mask=m_d, other=0).to(tl.float32)
        decay = exp(tl.load(g + p, mask=m_d, other=0).to(tl.float32))
        if t > 0:
            prev = tl.load(o + p - D, mask=m_d, other=0).to(tl.float32)
        else:
            prev = first
        tl.store(dx + p, dh.to(dx.dtype.element_ty), mask=m_d)
        tl.store(dg + p, (dh * decay * prev).to(dg.dtype.element_ty), mask=m_d)
        dh = dh * decay
        p -= D
        t -= 1
    if STORE_DH0:
        tl.store(dh0 + i_n * D + o_d, dh, mask=m_d)


class _HGRN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, h0, output_final_state, cu_seqlens):
        B, T, D = x.shape
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        x, g = x.contiguous(), g.contiguous()
        cu_seqlens = None if cu_seqlens is None else cu_seqlens.contiguous()
        h0c = None if h0 is None else h0.float().contiguous()
        o = torch.empty_like(x)
        ht = x.new_empty(N, D, dtype=torch.float32) if output_final_state else None
        grid = (triton.cdiv(D, BD), N)
        hgrn_fwd_kernel[grid](x, g, o, h0c, ht, cu_seqlens, T, D, BD=BD, USE_H0=h0 is not None,
                              STORE_HT=output_final_state, IS_VARLEN=cu_seqlens is not None)
        ctx.save_for_backward(g, o, h0c, cu_seqlens)
        ctx.h0_dtype = None if h0 is None else h0.dtype
        ctx.N = N
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        g, o, h0, cu_seqlens = ctx.saved_tensors
        B, T, D = o.shape
        do = torch.zeros_like(o) if do is None else do.contiguous()
        dht = None if dht is None else dht.float().contiguous()
        dx, dg = torch.empty_like(o), torch.empty_like(g)
        dh0 = torch.empty(ctx.N, D, device=o.device, dtype=torch.float32) if h0 is not None else None
        grid = (triton.cdiv(D, BD), ctx.N)
        hgrn_bwd_kernel[grid](g, o, h0, do, dht, dx, dg, dh0, cu_seqlens, T, D, BD=BD, USE_H0=h0 is not None,
                              USE_DHT=dht is not None, STORE_DH0=h0 is not None, IS_VARLEN=cu_seqlens is not None)
        return dx, dg, None if dh0 is None else dh0.to(ctx.h0_dtype), None, None


def hgrn(x: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None = None,
         output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None):
    """(o [B, T, D] in x's dtype, final state [N, D] fp32 or None); arguments checked by the op."""
    return _HGRN.apply(x, g, initial_state, output_final_state, cu_seqlens)
