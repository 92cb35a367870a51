"""The normaliser's kernel (``fastweight.kernels.key_sum``) against the PyTorch division
(``ops.decay._normalize_output``) in float64 on the same inputs: y, z_state and the gradients of
q, k, o and z_0, under the interpreter (fp32, fp16) with every output buffer poisoned."""

import pytest
import torch

from fastweight import ops
from fastweight.kernels import key_sum
from fastweight.ops.decay import _normalize_output
from fastweight.testing import generator, rel_err

# measured over these tests' shapes and several seeds: fp32 at most 2.7e-7 (the key sum's fp32 scan against
# float64), fp16 4.6e-4 (the rounding of y, dq, dk, do and z_state)
TOL = {torch.float32: 1e-6, torch.float16: 2e-3}

pytestmark = pytest.mark.usefixtures("poisoned_empty")


def _inputs(B, T, H, K, HV, V, N, gen, dtype, z0=True):
    """Positive feature maps (the normaliser stays away from zero, as it is used), o any sign."""
    pos = lambda *s: torch.nn.functional.softplus(torch.randn(*s, generator=gen, dtype=torch.float64))  # noqa: E731
    x = dict(q=pos(B, T, H, K), k=pos(B, T, H, K), o=torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64))
    if z0:
        x["z0"] = pos(N, 1, H, K) * 3
    return {n: t.to(dtype) for n, t in x.items()}


def _run(fn, x, scale, cu, dy, dzt):
    """(y, z_state, grads by name) of fn on leaf copies of x."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    y, zt = fn(leaves["q"], leaves["k"], leaves["o"], scale, cu, leaves.get("z0"))
    loss = (y.double() * dy).sum() + ((zt.double() * dzt).sum() if dzt is not None else 0)
    loss.backward()
    return y, zt, {n: t.grad for n, t in leaves.items()}


def _check(B, T, H, K, HV, V, cu, dtype, z0=True, with_dzt=True, dy_layout="plain"):
    gen = generator()
    N = B if cu is None else len(cu) - 1
    x = _inputs(B, T, H, K, HV, V, N, gen, dtype, z0)
    dy = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    if dy_layout == "expanded":   # what autograd hands over for y.sum(): one value, stride 0
        dy = torch.randn((), generator=gen, dtype=torch.float64).expand(B, T, HV, V)
    elif dy_layout == "transposed":
        dy = torch.randn(B, T, V, HV, generator=gen, dtype=torch.float64).transpose(2, 3)
    dzt = torch.randn(N, 1, H, K, generator=gen, dtype=torch.float64) if with_dzt else None
    scale = K ** -0.5
    ref = _run(_normalize_output, {n: t.double() for n, t in x.items()}, scale, cu, dy, dzt)
    got = _run(key_sum.normalize, x, scale, cu, dy, dzt)
    tol = TOL[dtype]
    assert got[0].dtype == dtype and got[1].dtype == dtype
    assert rel_err(got[0], ref[0]) < tol, f"y: {rel_err(got[0], ref[0]):.3g}"
    assert rel_err(got[1], ref[1]) < tol, f"z_state: {rel_err(got[1], ref[1]):.3g}"
    for n in x:
        assert got[2][n].dtype == dtype, n
        err = rel_err(got[2][n], ref[2][n])
        assert err < tol, f"d{n}: {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_uniform_batch(dtype):
    """B = 2, T = 150 (a partial last chunk), K = 48 and V = 40 padded, no z_0."""
    _check(2, 150, 2, 48, 2, 40, None, dtype, z0=False, with_dzt=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_grouped_heads_and_carried_sum(dtype):
    """Varlen with empty sequences (first, middle, last), z_0 and z_state's cotangent, grouped value
    heads (HV = 3 H) and two value blocks (V = 100)."""
    cu = torch.tensor([0, 0, 1, 70, 70, 199, 199])
    _check(1, 199, 2, 32, 6, 100, cu, dtype)


@pytest.mark.parametrize("layout", ["expanded", "transposed"])
def test_cotangent_layouts(layout):
    """dy as autograd hands it over: expanded from one value, or transposed."""
    _check(1, 90, 1, 16, 1, 24, None, torch.float32, dy_layout=layout)


def test_long_sequence_carry():
    """Many chunks (T = 700: the carry passes 10 chunk boundaries) at K = 256, the widest key block."""
    _check(1, 700, 1, 256, 1, 16, None, torch.float32, with_dzt=False)


def test_int32_offsets_and_whole_chunks():
    """int32 cu_seqlens, sequences of exactly one and two chunks (64, 128 tokens) beside a 5-token one."""
    _check(1, 197, 1, 16, 2, 24, torch.tensor([0, 64, 69, 197], dtype=torch.int32), torch.float32)


def test_refusals():
    x = torch.ones(1, 4, 1, 257)
    with pytest.raises(ValueError, match="K must be <= 256"):
        key_sum.normalize(x, x, x, 1.0)
    q = torch.ones(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"o \[B, T, G\*H, V\]"):
        key_sum.normalize(q, q, torch.ones(1, 4, 3, 8), 1.0)
    with pytest.raises(ValueError, match="B must be 1"):
        key_sum.normalize(torch.ones(2, 4, 2, 8), torch.ones(2, 4, 2, 8), torch.ones(2, 4, 2, 8), 1.0,
                          torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="z_init must be"):
        key_sum.normalize(q, q, q, 1.0, torch.tensor([0, 1, 4]), torch.ones(1, 1, 2, 8))


def test_op_takes_the_kernel_with_the_triton_backend(monkeypatch):
    """chunk_linear_attn(normalize=True, backend='triton') divides by the kernel; backend='torch' by the
    PyTorch division (float64 and K > 256 likewise)."""
    calls = []
    real = key_sum.normalize
    monkeypatch.setattr(key_sum, "normalize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = generator()
    q, k = (torch.nn.functional.softplus(torch.randn(1, 40, 1, 16, generator=gen)) for _ in range(2))
    v = torch.randn(1, 40, 1, 16, generator=gen)
    o_t, (_, z_t) = ops.chunk_linear_attn(q, k, v, backend="triton", output_final_state=True)
    assert calls == [1]
    o_r, (_, z_r) = ops.chunk_linear_attn(q, k, v, backend="torch", output_final_state=True)
    assert calls == [1]
    assert rel_err(o_t, o_r) < 2e-5 and rel_err(z_t, z_r) < 2e-6
    ops.chunk_linear_attn(q.double(), k.double(), v.double())
    assert calls == [1]


def test_loop_stages_for_16_bit_inputs_only():
    """The chunk loop is pipelined for 16-bit inputs; fp32's prefetch buffers at K = 256 would need 264-329 KB of
    shared memory (sm_90 has 227), so its loop stays unannotated."""
    assert key_sum.loop_stages(torch.bfloat16) == key_sum.loop_stages(torch.float16) == key_sum.LOOP_STAGES
    assert key_sum.loop_stages(torch.float32) is None
