"""RMSNorm with an optional output gate, one Triton pass forward and one backward.

Over the last dim (size D) of x [..., D], per row:

    r = 1 / sqrt(mean(x^2) + eps),   n = r x,   y = (n * w) * act(g)     (act: silu, sigmoid, identity)

Backward (fp32; r is saved, n recomputed from x):

    du = dy * act(g)                 (u = n * w)
    dg = dy * n * w * act'(g)
    dw = sum_rows du * n
    dx = r (du w - n mean(du w n))

y is written in ``out_dtype`` (the autocast dtype when the layer runs under autocast: one
rounding, where the PyTorch form casts x to fp32, normalises, rounds, casts the gate, and
multiplies in 16 bits). dw is summed from per-program partials ``[P, D]`` fp32 by PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTS = {"identity": 0, "silu": 1, "sigmoid": 2}


@triton.jit
def _act(g, ACT: tl.constexpr):
    """(act(g), act'(g)) for ACT 1 (silu) or 2 (sigmoid)."""
    s = tl.sigmoid(g)
    if ACT == 1:
        a = g * s
        da = s * (1 + g * (1 - s))
    else:
        a = s
        da = s * (1 - s)
    return a, da


@triton.jit
def norm_fwd_kernel(x, g, w, y, rstd, N, D, eps, HAS_GATE: tl.constexpr, ACT: tl.constexpr,
                    BR: tl.constexpr, BD: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r, m_d = o_r < N, o_d < D
    m = m_r[:, None] & m_d[None, :]
    offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    b_x = tl.load(x + offs, mask=m, other=0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_w = tl.load(w + o_d, mask=m_d, other=0).to(tl.float32)
    b_y = b_x * b_r[:, None] * b_w[None, :]
    if HAS_GATE:
        b_g = tl.load(g + offs, mask=m, other=0).to(tl.float32)
        if ACT != 0:
            b_g, _ = _act(b_g, ACT)
        b_y = b_y * b_g
    tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=m_r)


@triton.jit
def norm_bwd_kernel(x, g, w, rstd, dy, dx, dg, dw, N, D, HAS_GATE: tl.constexpr, ACT: tl.constexpr,
                    BR: tl.constexpr, BD: tl.constexpr):
    i_p = tl.program_id(0)
    o_r = i_p * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r, m_d = o_r < N, o_d < D
    m = m_r[:, None] & m_d[None, :]
    offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    b_x = tl.load(x + offs, mask=m, other=0).to(tl.float32)
    b_r = tl.load(rstd + o_r, mask=m_r, other=0)
    b_w = tl.load(w + o_d, mask=m_d, other=0).to(tl.float32)
    b_dy = tl.load(dy + offs, mask=m, other=0).to(tl.float32)
    b_n = b_x * b_r[:, None]
    b_du = b_dy
    if HAS_GATE:
        b_g = tl.load(g + offs, mask=m, other=0).to(tl.float32)
        if ACT != 0:
            b_a, b_da = _act(b_g, ACT)
            tl.store(dg + offs, (b_dy * b_n * b_w[None, :] * b_da).to(dg.dtype.element_ty), mask=m)
        else:
            b_a = b_g
            tl.store(dg + offs, (b_dy * b_n * b_w[None, :]).to(dg.dtype.element_ty), mask=m)
        b_du = b_dy * b_a
    tl.store(dw + i_p.to(tl.int64) * D + o_d, tl.sum(b_du * b_n, 0), mask=m_d)
    b_dn = b_du * b_w[None, :]
    b_dx = b_r[:, None] * (b_dn - b_n * (tl.sum(b_dn * b_n, 1) / D)[:, None])
    tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=m)


def _blocks(D: int) -> tuple[int, int, int]:
    """(rows per program, padded D, warps): ~1024 elements per 4 warps (sm_90, bf16: 54/64 registers
    forward/backward at D=128; 16 rows used 96/155), 4096 per 8 warps from D=512 (64/80 at D=1024)."""
    BD = triton.next_power_of_2(D)
    if BD <= 256:
        return max(1, 1024 // BD), BD, 4
    return max(1, 4096 // BD), BD, 8


class GatedNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps, act, out_dtype):
        shape, D = x.shape, x.shape[-1]
        x = x.reshape(-1, D)
        gate = None if gate is None else gate.reshape(-1, D)
        N = x.shape[0]
        BR, BD, warps = _blocks(D)
        y = x.new_empty(N, D, dtype=out_dtype)
        rstd = x.new_empty(N, dtype=torch.float32)
        norm_fwd_kernel[(triton.cdiv(N, BR),)](x, gate if gate is not None else x, weight, y, rstd, N, D, eps,
                                               HAS_GATE=gate is not None, ACT=ACTS[act], BR=BR, BD=BD,
                                               num_warps=warps)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.act, ctx.shape = act, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        N, D = x.shape
        BR, BD, warps = _blocks(D)
        P = triton.cdiv(N, BR)
        dx = torch.empty_like(x)
        dg = torch.empty_like(gate) if gate is not None else None
        dw = x.new_empty(P, D, dtype=torch.float32)
        norm_bwd_kernel[(P,)](x, gate if gate is not None else x, weight, rstd, dy.reshape(N, D).contiguous(), dx,
                              dg if dg is not None else dx, dw, N, D, HAS_GATE=gate is not None,
                              ACT=ACTS[ctx.act], BR=BR, BD=BD, num_warps=warps)
        return (dx.view(ctx.shape), None if dg is None else dg.view(ctx.shape), dw.sum(0).to(weight.dtype),
                None, None, None)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   act: str = "silu", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm(x) * weight * act(gate) over the last dim (``gate`` None: plain RMSNorm), in one pass;
    x, gate [..., D] contiguous; weight [D]. See the module docstring."""
    return GatedNormFunction.apply(x.contiguous(), None if gate is None else gate.contiguous(), weight, eps,
                                   act, out_dtype or x.dtype)
