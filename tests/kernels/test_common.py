"""``fastweight.kernels.common``: the round-to-nearest TF32 operands of ``dot_at(..., "tf32rn")``."""

import math

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import dot_at, round_tf32
from fastweight.testing import emulate_tf32


@triton.jit
def _round_kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, round_tf32(tl.load(x + o)))


@triton.jit
def _dot_kernel(a, b, c, N: tl.constexpr, P: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(a + o[:, None] * N + o[None, :])
    y = tl.load(b + o[:, None] * N + o[None, :])
    tl.store(c + o[:, None] * N + o[None, :], dot_at(x, y, P))


def _nearest_tf32(v: float) -> float:
    """v to 11 significant bits, to nearest, ties away from zero (from frexp, not from the bits)."""
    if v == 0:
        return 0.0
    m, e = math.frexp(abs(v))                  # abs(v) = m 2^e, m in [0.5, 1)
    q = math.floor(m * 2 ** 11 + 0.5)          # ties away from zero on the magnitude
    return math.copysign(q * 2.0 ** (e - 11), v)


def test_round_tf32_to_nearest_ties_away():
    g = torch.Generator().manual_seed(0)
    ulp = 2.0 ** -10                           # of a TF32 mantissa on [1, 2)
    special = [1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 2 - ulp / 4, 1 + ulp / 2 - 2 ** -23, 0.0, -0.0,
               2.0 ** -120 * (1 + ulp / 2), 3e38, 1.0, -7.0]
    x = torch.cat([torch.tensor(special), torch.randn(245, generator=g) * 10.0 ** torch.randint(-6, 7, (245,),
                                                                                          generator=g)]).float()
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, N=x.numel())
    want = torch.tensor([_nearest_tf32(v) for v in x.double().tolist()], dtype=torch.float64)
    assert torch.equal(y.double(), want)
    assert y[0] == 1 + ulp and y[1] == 1 + 2 * ulp and y[2] == -(1 + ulp) and y[3] == 2.0   # ties away, carry


def test_round_tf32_keeps_infinities_and_nans():
    bits = torch.tensor([0x7F800000, -0x800000, 0x7FFFFFFF, 0x7F800001, -1, 0x7FC00000], dtype=torch.int32)
    # +inf, -inf, NaNs whose rounding add would carry into the exponent or the sign; FLT_MAX, -0
    x = torch.cat([bits.view(torch.float32), torch.tensor([3.4028235e38, -0.0])])
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, N=8)
    assert y[0] == float("inf") and y[1] == float("-inf")
    assert torch.isnan(y[2:6]).all()
    assert y[6] == float("inf")                      # FLT_MAX is past TF32's largest finite value's midpoint
    assert y[7] == 0 and torch.signbit(y[7])


def test_dot_tf32rn_rounds_then_truncates_nothing():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    ra, rb = torch.empty_like(a), torch.empty_like(b)
    _round_kernel[(1,)](a.flatten(), ra.view(-1), N=256)
    _round_kernel[(1,)](b.flatten(), rb.view(-1), N=256)
    want = (ra.double() @ rb.double())
    c = torch.empty_like(a)
    with emulate_tf32():                       # the tensor cores' truncation: a no-op on rounded operands
        _dot_kernel[(1,)](a, b, c, N=16, P="tf32rn")
    assert torch.allclose(c.double(), want, rtol=1e-6, atol=1e-6)
    exact = a.double() @ b.double()
    trunc = torch.empty_like(a)
    with emulate_tf32():
        _dot_kernel[(1,)](a, b, trunc, N=16, P="tf32")
    assert (c.double() - exact).norm() < 0.75 * (trunc.double() - exact).norm()
