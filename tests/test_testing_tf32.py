"""``fastweight.testing.emulate_tf32``: the interpreter's TF32 dots as the H200 forms them."""

import os

import pytest
import torch
import triton
import triton.language as tl

from fastweight.testing import emulate_tf32


@triton.jit
def _dot_kernel(a, b, c, N: tl.constexpr, PRECISION: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(a + o[:, None] * N + o[None, :])
    y = tl.load(b + o[:, None] * N + o[None, :])
    tl.store(c + o[:, None] * N + o[None, :], tl.dot(x, y, input_precision=PRECISION))


def _dot(a, b, precision):
    c = torch.empty_like(a)
    _dot_kernel[(1,)](a, b, c, N=a.shape[0], PRECISION=precision)
    return c


def _tf32(x):
    return (x.view(torch.int32) & -8192).view(torch.float32)   # 13 low mantissa bits dropped


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's dots")
def test_tf32_dots_truncate_their_operands_only_inside():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    exact = (a.double() @ b.double()).float()
    assert torch.allclose(_dot(a, b, "tf32"), exact, rtol=1e-5, atol=1e-5)
    with emulate_tf32():
        got = _dot(a, b, "tf32")
        assert torch.allclose(got, (_tf32(a).double() @ _tf32(b).double()).float(), rtol=1e-5, atol=1e-5)
        assert (got - exact).abs().max() > 1e-4   # the truncation shows
        for precision in ("tf32x3", "ieee"):
            assert torch.allclose(_dot(a, b, precision), exact, rtol=1e-5, atol=1e-5)
    assert torch.allclose(_dot(a, b, "tf32"), exact, rtol=1e-5, atol=1e-5)
