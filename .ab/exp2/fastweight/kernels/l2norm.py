"""L2 norm over the last dim, forward and backward (``use_qk_l2norm_in_kernel``).

    y = x * r,  r = (sum x^2 + eps)^{-1/2}          dx = r (dy - y <dy, y>)

Same definition as ``fastweight.dispatch.l2norm`` (eps = 1e-6); one program per block of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import alloc


@triton.jit
def l2norm_fwd_kernel(x, y, r, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, eps):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r[:, None] < N) & (o_d[None, :] < D)
    b_x = tl.load(x + o_r[:, None].to(tl.int64) * D + o_d[None, :], mask=m, other=0.).to(tl.float32)
    b_r = 1. / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + o_r[:, None].to(tl.int64) * D + o_d[None, :], (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(r + o_r, b_r, mask=o_r < N)


@triton.jit
def l2norm_bwd_kernel(x, r, dy, dx, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r[:, None] < N) & (o_d[None, :] < D)
    p = o_r[:, None].to(tl.int64) * D + o_d[None, :]
    b_r = tl.load(r + o_r, mask=o_r < N, other=0.)
    b_y = tl.load(x + p, mask=m, other=0.).to(tl.float32) * b_r[:, None]
    b_dy = tl.load(dy + p, mask=m, other=0.).to(tl.float32)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, 1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


def _launch(D):
    BD = triton.next_power_of_2(D)
    return BD, max(1, min(64, 4096 // BD))


class L2NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        x2 = x.contiguous().view(-1, x.shape[-1])
        N, D = x2.shape
        BD, BR = _launch(D)
        y = alloc(x2.shape, dtype=x2.dtype, device=x2.device)
        r = alloc((N,), device=x.device, dtype=torch.float32)
        l2norm_fwd_kernel[(triton.cdiv(N, BR),)](x2, y, r, N, D=D, BD=BD, BR=BR, eps=eps)
        ctx.save_for_backward(x2, r)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, r = ctx.saved_tensors
        N, D = x2.shape
        BD, BR = _launch(D)
        dx = alloc(x2.shape, dtype=x2.dtype, device=x2.device)
        l2norm_bwd_kernel[(triton.cdiv(N, BR),)](x2, r, dy.contiguous().view(N, D), dx, N, D=D, BD=BD, BR=BR)
        return dx.view(dy.shape), None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum x^2 + eps) over the last dim, with its backward, in Triton."""
    return L2NormFunction.apply(x, eps)
