"""The SwiGLU product silu(a) * b in one Triton pass forward and one backward.

    y = silu(a) b = a sigmoid(a) b
    da = dy b sigmoid(a) (1 + a (1 - sigmoid(a))),    db = dy silu(a)

a, b, y: the same shape and dtype (the MLP's two projections, bf16 under autocast); fp32
arithmetic, y rounded once. PyTorch runs silu, then the product (two passes over a [T, 8/3 D]
tensor and an intermediate), and three in the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def swiglu_fwd_kernel(a, b, y, N, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_a = tl.load(a + o, mask=m, other=0).to(tl.float32)
    b_b = tl.load(b + o, mask=m, other=0).to(tl.float32)
    tl.store(y + o, (b_a * tl.sigmoid(b_a) * b_b).to(y.dtype.element_ty), mask=m)


@triton.jit
def swiglu_bwd_kernel(a, b, dy, da, db, N, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_a = tl.load(a + o, mask=m, other=0).to(tl.float32)
    b_b = tl.load(b + o, mask=m, other=0).to(tl.float32)
    b_dy = tl.load(dy + o, mask=m, other=0).to(tl.float32)
    s = tl.sigmoid(b_a)
    tl.store(da + o, (b_dy * b_b * s * (1 + b_a * (1 - s))).to(da.dtype.element_ty), mask=m)
    tl.store(db + o, (b_dy * b_a * s).to(db.dtype.element_ty), mask=m)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        y = torch.empty_like(a)
        N = a.numel()
        swiglu_fwd_kernel[(triton.cdiv(N, BLOCK),)](a, b, y, N, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        da, db = torch.empty_like(a), torch.empty_like(b)
        N = a.numel()
        swiglu_bwd_kernel[(triton.cdiv(N, BLOCK),)](a, b, dy.contiguous(), da, db, N, BLOCK=BLOCK, num_warps=8)
        return da, db


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for a, b of one shape and dtype; differentiable in both."""
    return SwiGLUFunction.apply(a, b)
