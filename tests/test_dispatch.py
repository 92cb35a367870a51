"""The dispatcher's guard for kernel shapes that fail on the GPU (``impl.gpu_unverified``, docs/kernels.md)."""

import pytest
import torch

from fastweight import dispatch, ops
from fastweight.kernels import delta


def test_no_shape_is_fenced_now():
    """The shapes fenced in session 2 (K = 256, V < 32 on CUDA) pass on the H200 since the kernels'
    narrow blocks were padded (docs/bench/runs-2026-11-30-s3.md): no registered kernel declares one."""
    from fastweight.kernels import decay
    for impl in (delta.chunk_gated_delta_rule, delta.chunk_delta_rule, delta.chunk_kda, decay.chunk_simple_gla,
                 decay.chunk_linear_attn, decay.chunk_retention):
        assert getattr(impl, "gpu_unverified", None) is None


def _inputs(K=8, V=8):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 20, 2, K, generator=g), dim=-1) for _ in range(2))
    return q, k, torch.randn(1, 20, 2, V, generator=g), torch.rand(1, 20, 2, generator=g)


def test_explicit_triton_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(delta.chunk_delta_rule, "gpu_unverified", lambda device, K, V: f"K = {K} (test)",
                        raising=False)
    with pytest.raises(ValueError, match="backend='triton'.*K = 8 \\(test\\).*backend='torch'"):
        ops.chunk_delta_rule(*_inputs(), backend="triton")


def test_auto_falls_back_to_torch_with_one_warning(monkeypatch):
    resolve = dispatch.resolve
    # as on CUDA: the automatic choice is the Triton kernel, which declares the shape unverified
    monkeypatch.setattr(dispatch, "resolve", lambda op, mode, backend, device: resolve(
        op, mode, "triton" if backend is None else backend, device))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(delta.chunk_delta_rule, "gpu_unverified", lambda device, K, V: "V = 8 (test)",
                        raising=False)
    monkeypatch.setattr(dispatch, "_WARNED", set())
    x = _inputs()
    with pytest.warns(UserWarning, match="V = 8 \\(test\\).*PyTorch chunk path"):
        o, _ = ops.chunk_delta_rule(*x)
    ref, _ = ops.chunk_delta_rule(*x, backend="torch")
    assert torch.equal(o, ref)
