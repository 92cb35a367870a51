"""The dispatcher's guard for kernel shapes that failed on the GPU (fastweight/kernels/delta.py)."""

import pytest
import torch

from fastweight import dispatch, ops
from fastweight.kernels import delta


def test_gpu_unverified_names_the_shape():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert delta.gpu_unverified(cuda, 128, 128) is None
    assert delta.gpu_unverified(cuda, 64, 32) is None
    assert "K = 256" in delta.gpu_unverified(cuda, 256, 256)
    assert "V = 16" in delta.gpu_unverified(cuda, 64, 16)
    assert delta.gpu_unverified(cpu, 256, 16) is None  # the interpreter computes them right


def _inputs(K=8, V=8):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 20, 2, K, generator=g), dim=-1) for _ in range(2))
    return q, k, torch.randn(1, 20, 2, V, generator=g), torch.rand(1, 20, 2, generator=g)


def test_explicit_triton_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(delta.chunk_delta_rule, "gpu_unverified", lambda device, K, V: f"K = {K} (test)")
    with pytest.raises(ValueError, match="backend='triton'.*K = 8 \\(test\\).*backend='torch'"):
        ops.chunk_delta_rule(*_inputs(), backend="triton")


def test_auto_falls_back_to_torch_with_one_warning(monkeypatch):
    resolve = dispatch.resolve
    # as on CUDA: the automatic choice is the Triton kernel, which declares the shape unverified
    monkeypatch.setattr(dispatch, "resolve", lambda op, mode, backend, device: resolve(
        op, mode, "triton" if backend is None else backend, device))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(delta.chunk_delta_rule, "gpu_unverified", lambda device, K, V: "V = 8 (test)")
    monkeypatch.setattr(dispatch, "_WARNED", set())
    x = _inputs()
    with pytest.warns(UserWarning, match="V = 8 \\(test\\).*PyTorch chunk path"):
        o, _ = ops.chunk_delta_rule(*x)
    ref, _ = ops.chunk_delta_rule(*x, backend="torch")
    assert torch.equal(o, ref)


def test_scalar_decay_small_value_heads_unverified():
    from fastweight.kernels import decay
    cuda = torch.device("cuda")
    assert "V = 16" in decay.gpu_unverified(cuda, 64, 16)
    assert decay.gpu_unverified(cuda, 64, 64) is None
    assert decay.gpu_unverified(torch.device("cpu"), 64, 16) is None
    assert dispatch._lookup("triton", "chunk", "simple_gla").gpu_unverified is decay.gpu_unverified
