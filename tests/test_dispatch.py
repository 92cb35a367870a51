"""The dispatcher: the guard for kernel shapes that fail on the GPU (``Impl.unverified``,
docs/kernels.md), the float64 route, and its PyTorch helpers."""

import dataclasses

import pytest
import torch

from fastweight import dispatch, mechanisms, ops


def test_no_shape_is_fenced_now():
    """The shapes fenced in session 2 (K = 256, V < 32 on CUDA) pass on the H200 since the kernels'
    narrow blocks were padded (docs/bench/runs-2026-11-30-s3.md): no registered kernel declares one."""
    for op in mechanisms.OPS.values():
        for impl in (op.triton_chunk, op.triton_fused_recurrent, op.torch):
            assert impl is not None and impl.unverified is None, op.name


def _inputs(K=8, V=8):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 20, 2, K, generator=g), dim=-1) for _ in range(2))
    return q, k, torch.randn(1, 20, 2, V, generator=g), torch.rand(1, 20, 2, generator=g)


def _fence(monkeypatch, why):
    """chunk_delta_rule's Triton kernel declares every shape unverified, for the test's duration."""
    op = mechanisms.OPS["delta_rule"]
    fenced = dataclasses.replace(op.triton_chunk, unverified=why)
    monkeypatch.setitem(mechanisms.OPS, "delta_rule", dataclasses.replace(op, triton_chunk=fenced))


def test_explicit_triton_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _fence(monkeypatch, lambda device, K, V: f"K = {K} (test)")
    with pytest.raises(ValueError, match="backend='triton'.*K = 8 \\(test\\).*backend='torch'"):
        ops.chunk_delta_rule(*_inputs(), backend="triton")


def test_auto_falls_back_to_torch_with_one_warning(monkeypatch):
    resolve = dispatch.resolve
    # as on CUDA: the automatic choice is the Triton kernel, which declares the shape unverified
    monkeypatch.setattr(dispatch, "resolve", lambda op, mode, backend, device, dtype: resolve(
        op, mode, "triton" if backend is None else backend, device, dtype))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _fence(monkeypatch, lambda device, K, V: "V = 8 (test)")
    monkeypatch.setattr(dispatch, "_WARNED", set())
    x = _inputs()
    with pytest.warns(UserWarning, match="V = 8 \\(test\\).*PyTorch chunk path"):
        o, _ = ops.chunk_delta_rule(*x)
    ref, _ = ops.chunk_delta_rule(*x, backend="torch")
    assert torch.equal(o, ref)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_float64_takes_the_torch_path_on_every_device(mode):
    """backend=None: float64 inputs go to the PyTorch chunk path (exact in float64), on CUDA too,
    where other dtypes go to the Triton kernels."""
    import fastweight.chunk
    import fastweight.kernels
    cuda = torch.device("cuda")
    for op in ops.OPS:
        torch_impl = getattr(fastweight.chunk, f"chunk_{op}")
        assert dispatch.resolve(op, mode, None, cuda, torch.float64).fn is torch_impl
        assert dispatch.resolve(op, mode, None, torch.device("cpu"), torch.float64).fn is torch_impl
        assert dispatch.resolve(op, mode, None, cuda, torch.bfloat16).fn is getattr(fastweight.kernels,
                                                                                    f"{mode}_{op}")


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_gated_delta_rule"])
def test_triton_refuses_float64(op, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, beta = (t.double() for t in _inputs())
    g = -torch.rand(k.shape if op == "chunk_kda" else beta.shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="no float64 path.*torch.float64.*backend='torch'"):
        getattr(ops, op)(q, k, v, g, beta=beta, backend="triton")
    o, _ = getattr(ops, op)(q, k, v, g, beta=beta)
    assert o.dtype == torch.float64


def test_l2norm_in_float64():
    """x / sqrt(sum x^2 + 1e-6), the norm in float64 for float64 x (in float32 for the rest)."""
    x = torch.randn(3, 5, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert (dispatch.l2norm(x) - want).abs().max() <= 1e-15
    y = dispatch.l2norm(x.float())
    assert y.dtype == torch.float32 and (y.double() - want).abs().max() <= 1e-6
