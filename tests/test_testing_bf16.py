"""``fastweight.testing.emulate_bf16``: the interpreter's bf16 as the GPU computes it."""

import os

import pytest
import torch
import triton
import triton.language as tl

from fastweight.testing import emulate_bf16

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="patches the interpreter")


@triton.jit
def _kernel(x, h, y, z, w, v, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, tl.load(x + o).to(tl.bfloat16))                      # fp32 -> bf16
    tl.store(y + N + o, tl.load(h + o).to(tl.bfloat16))                  # fp16 -> bf16
    b = tl.load(z + o[:, None] * N + o[None, :])
    tl.store(w + o[:, None] * N + o[None, :], tl.dot(b, b))              # bf16 operands, fp32 accumulator
    tl.store(v + o[:, None] * N + o[None, :], (b * b + b).to(tl.float32))   # bf16 arithmetic, rounded each step


def _run(x, h, z):
    N = z.shape[0]
    y, w, v = torch.empty(2 * N, dtype=torch.bfloat16), torch.empty(N, N), torch.empty(N, N)
    _kernel[(1,)](x, h, y, z, w, v, N=N)
    return y, w, v


def test_bf16_as_the_gpu_computes_it():
    g = torch.Generator().manual_seed(0)
    ulp = 2.0 ** -7                                   # of bf16 on [1, 2)
    ties = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), float("nan")])   # to even: 1, 1 + 2 ulp, -1
    x = torch.cat([ties, torch.randn(12, generator=g) * 100])
    h = (torch.randn(16, generator=g) * 10).half()
    z = torch.randn(16, 16, generator=g).bfloat16()
    with emulate_bf16():
        y, w, v = _run(x, h, z)
    assert torch.equal(y[:3], torch.tensor([1.0, 1 + 2 * ulp, -1.0]).bfloat16()) and y[3].isnan()
    assert torch.equal(y[4:16], x[4:].bfloat16()) and torch.equal(y[16:], h.bfloat16())
    assert torch.allclose(w, z.double().matmul(z.double()).float(), rtol=1e-6, atol=1e-5)
    assert torch.equal(v, (z * z + z).float())        # torch rounds each bf16 op to nearest even too


@triton.jit
def _more_kernel(x, y, s, N: tl.constexpr):
    o = tl.arange(0, N)
    a = tl.load(x + o)
    tl.store(y + o, a.to(tl.bfloat16))                                   # past bf16's range: inf
    tl.store(y + N + o, a.to(tl.bfloat16, fp_downcast_rounding="rtz"))   # toward zero when asked
    tl.store(s, tl.sum(tl.load(x + N + o).to(tl.bfloat16), 0).to(tl.float32))   # a bf16 sum


def test_overflow_rtz_and_sums():
    x = torch.tensor([3.4e38, -3.4e38, 1 + 2.0 ** -7 - 2.0 ** -20, 1.75, 1.75, 2.5, -0.125, 3.0])
    y, s = torch.empty(8, dtype=torch.bfloat16), torch.empty(1)
    with emulate_bf16():
        _more_kernel[(1,)](x, y, s, N=4)
    assert torch.equal(y[:4], x[:4].bfloat16()) and y[0] == float("inf") and y[1] == float("-inf")
    assert y[6] == 1.0 and y[4] == torch.finfo(torch.bfloat16).max   # truncated, not rounded up
    assert s.item() == 7.125                                          # the raw bits' sum would be garbage


def test_restored_after_the_block_and_after_an_error():
    from triton.runtime import interpreter
    B = interpreter.InterpreterBuilder
    names = [n for n in vars(B) if n.startswith(("create_", "binary_op", "unary_op", "cast_impl"))]
    before = {n: getattr(B, n) for n in names}
    reduce_sum, had = interpreter.ReduceOps.sum, hasattr(B, "get_bf16")
    with pytest.raises(RuntimeError):
        with emulate_bf16():
            assert B.create_dot is not before["create_dot"] and hasattr(B, "get_bf16")
            raise RuntimeError
    assert {n: getattr(B, n) for n in names} == before
    assert interpreter.ReduceOps.sum is reduce_sum and hasattr(B, "get_bf16") == had
