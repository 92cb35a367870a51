"""Causal depthwise short convolution with an optional SiLU, in the [B, T, C] layout (Triton).

    pre_t[c] = sum_{j<W} w[c, j] x_{t-W+1+j}[c]  (+ bias[c])      (x_s = 0 for s < 0)
    y_t[c]   = silu(pre_t[c])   (or pre_t[c])

The layers' ShortConv on the training / prefill path: one read of x and one write of y,
where ``F.conv1d`` needs the channels-first layout (a transposed copy in, one out) and a
separate activation. Backward (pre recomputed from x, nothing saved but x):

    dpre_t  = dy_t * silu'(pre_t)
    dx_s[c] = sum_{j<W} w[c, j] dpre_{s+W-1-j}[c]        (terms with s+W-1-j >= T dropped)
    dw[c,j] = sum_{b,t} dpre_t[c] x_{t-W+1+j}[c],        dbias[c] = sum_{b,t} dpre_t[c]

x, y, dx: [B, T, C] (x's dtype); w: [C, W]; everything is accumulated in fp32. dw and dbias
are summed from per-tile partials ``[B, T/BT, W, C]`` fp32 by PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# sm_90 registers (ptxas, bf16, 4 warps): forward 76 at BT=16 (191 at 32: one block of 4 warps per
# 2 SMs' worth of registers); backward 127 at BT=8 (255 at 16: it recomputes pre at W shifts)
BT, BC = 16, 128
BT_BWD = 8


@triton.jit
def _pre(x, w, bias, base, o_t, o_c, m_c, T, C, W: tl.constexpr, HAS_BIAS: tl.constexpr,
         BT: tl.constexpr, BC: tl.constexpr):
    """pre at the rows ``o_t`` [BT] of one sequence (``base`` its offset), columns ``o_c`` [BC]."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        src = o_t - (W - 1) + j
        m = ((src >= 0) & (src < T))[:, None] & m_c[None, :]
        b_x = tl.load(x + base + src[:, None] * C + o_c[None, :], mask=m, other=0).to(tl.float32)
        b_w = tl.load(w + o_c * W + j, mask=m_c, other=0).to(tl.float32)
        acc += b_x * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m_c, other=0).to(tl.float32)[None, :]
    return acc


@triton.jit
def conv_fwd_kernel(x, w, bias, y, T, C, W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = i_b.to(tl.int64) * T * C
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    acc = _pre(x, w, bias, base, o_t, o_c, m_c, T, C, W, HAS_BIAS, BT, BC)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    m = (o_t < T)[:, None] & m_c[None, :]
    tl.store(y + base + o_t[:, None] * C + o_c[None, :], acc.to(y.dtype.element_ty), mask=m)


@triton.jit
def conv_bwd_kernel(x, w, bias, dy, dx, dw, db, T, C, NT, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = i_b.to(tl.int64) * T * C
    o_s = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_dx = tl.zeros([BT, BC], dtype=tl.float32)
    # partials of this tile go to row (i_b * NT + i_t) of dw [B * NT, W, C] and db [B * NT, C]
    o_part = (i_b * NT + i_t).to(tl.int64)
    for i in tl.static_range(W):
        # dpre at t = s + i (i = W-1-j feeds dx_s through w[:, j])
        o_t = o_s + i
        m_t = (o_t < T)[:, None] & m_c[None, :]
        b_dpre = tl.load(dy + base + o_t[:, None] * C + o_c[None, :], mask=m_t, other=0).to(tl.float32)
        if SILU:
            pre = _pre(x, w, bias, base, o_t, o_c, m_c, T, C, W, HAS_BIAS, BT, BC)
            sig = tl.sigmoid(pre)
            b_dpre = b_dpre * sig * (1 + pre * (1 - sig))
        b_w = tl.load(w + o_c * W + (W - 1 - i), mask=m_c, other=0).to(tl.float32)
        b_dx += b_dpre * b_w[None, :]
        if i == 0:
            # the tile's own dpre (t = s): its contribution to dw and dbias
            for j in tl.static_range(W):
                src = o_s - (W - 1) + j
                m = ((src >= 0) & (src < T))[:, None] & m_c[None, :]
                b_x = tl.load(x + base + src[:, None] * C + o_c[None, :], mask=m, other=0).to(tl.float32)
                tl.store(dw + (o_part * W + j) * C + o_c, tl.sum(b_dpre * b_x, 0), mask=m_c)
            if HAS_BIAS:
                tl.store(db + o_part * C + o_c, tl.sum(b_dpre, 0), mask=m_c)
    m = (o_s < T)[:, None] & m_c[None, :]
    tl.store(dx + base + o_s[:, None] * C + o_c[None, :], b_dx.to(dx.dtype.element_ty), mask=m)


def conv_fwd(x, w, bias, silu: bool):
    B, T, C = x.shape
    W = w.shape[-1]
    y = torch.empty_like(x)
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC), B)
    conv_fwd_kernel[grid](x, w, bias if bias is not None else w, y, T, C, W=W, HAS_BIAS=bias is not None,
                          SILU=silu, BT=BT, BC=BC, num_warps=4)
    return y


def conv_bwd(x, w, bias, dy, silu: bool):
    B, T, C = x.shape
    W = w.shape[-1]
    NT = triton.cdiv(T, BT_BWD)
    dx = torch.empty_like(x)
    dw = x.new_empty(B * NT, W, C, dtype=torch.float32)
    db = x.new_empty(B * NT, C, dtype=torch.float32) if bias is not None else None
    grid = (NT, triton.cdiv(C, BC), B)
    conv_bwd_kernel[grid](x, w, bias if bias is not None else w, dy, dx, dw, db if db is not None else dw,
                          T, C, NT, W=W, HAS_BIAS=bias is not None, SILU=silu, BT=BT_BWD, BC=BC, num_warps=4)
    return dx, dw.sum(0).t(), None if db is None else db.sum(0)


class ShortConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, silu):
        x, w = x.contiguous(), w.contiguous()
        ctx.save_for_backward(x, w, bias)
        ctx.silu = silu
        return conv_fwd(x, w, bias, silu)

    @staticmethod
    def backward(ctx, dy):
        x, w, bias = ctx.saved_tensors
        dx, dw, db = conv_bwd(x, w, bias, dy.contiguous(), ctx.silu)
        return dx, dw.to(w.dtype), None if db is None else db.to(bias.dtype), None


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               silu: bool = True) -> torch.Tensor:
    """Causal depthwise conv of x [B, T, C] with weight [C, W] (and bias [C]), then SiLU if ``silu``;
    zero history before t = 0. Differentiable in x, weight and bias (see the module docstring)."""
    return ShortConvFunction.apply(x, weight, bias, silu)
