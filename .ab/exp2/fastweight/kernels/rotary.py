"""Rotary position embedding (rotate-half form) in one Triton pass, forward and backward.

For x [B, T, H, D] (rows of D = two halves x1, x2) and the angle table at each row's position t,
cos, sin [T, D/2] (fp32):

    y1 = x1 cos - x2 sin,    y2 = x2 cos + x1 sin

The backward is the rotation by the opposite angle (same kernel, sin negated). y in x's dtype,
arithmetic in fp32: one read and one write, where the PyTorch form makes six passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotary_kernel(x, cos, sin, y, N, T, H, D2, SIGN: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r, m_d = o_r < N, o_d < D2
    m = m_r[:, None] & m_d[None, :]
    t = (o_r // H) % T
    offs = o_r.to(tl.int64)[:, None] * (2 * D2) + o_d[None, :]
    b_x1 = tl.load(x + offs, mask=m, other=0).to(tl.float32)
    b_x2 = tl.load(x + offs + D2, mask=m, other=0).to(tl.float32)
    o_a = t[:, None] * D2 + o_d[None, :]
    b_c = tl.load(cos + o_a, mask=m, other=0)
    b_s = tl.load(sin + o_a, mask=m, other=0) * SIGN
    tl.store(y + offs, (b_x1 * b_c - b_x2 * b_s).to(y.dtype.element_ty), mask=m)
    tl.store(y + offs + D2, (b_x2 * b_c + b_x1 * b_s).to(y.dtype.element_ty), mask=m)


def _rotate(x, cos, sin, sign):
    B, T, H, D = x.shape
    N, D2 = B * T * H, D // 2
    BD = triton.next_power_of_2(D2)
    BR = max(1, min(16, 1024 // BD))  # 1024 elements per 4 warps (126 registers at 2048 on sm_90)
    y = torch.empty_like(x)
    rotary_kernel[(triton.cdiv(N, BR),)](x, cos, sin, y, N, T, H, D2, SIGN=sign, BR=BR, BD=BD, num_warps=4)
    return y


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy.contiguous(), cos, sin, -1.0), None, None


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the angles whose cos, sin [T, D/2] (fp32) are given; differentiable in x."""
    return RotaryFunction.apply(x.contiguous(), cos.contiguous(), sin.contiguous())
