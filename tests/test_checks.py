"""Bad input gets a ValueError/TypeError naming the argument, before any kernel runs."""

import importlib
import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastweight import checks, ops
from fastweight.mechanisms import get
from fastweight.testing import generator, rel_err

B, T, H, K, V = 2, 7, 2, 8, 4


def inputs(name, B=B, T=T):
    return get(name).to_op(get(name).sample(B, T, H, K, V, dtype=torch.float32, device="cpu",
                                            generator=generator(0)))


def gdn(**overrides):
    x = inputs("gated_deltanet")
    x.update(overrides)
    return ops.chunk_gated_delta_rule(**x, backend="reference")


def raises(exc, name):
    return pytest.raises(exc, match=re.escape(f"`{name}`"))


def test_valid_input_passes():
    o, S = gdn(output_final_state=True)
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)


@pytest.mark.parametrize("name, shape", [
    ("q", (B, T, H, K, 1)), ("k", (B, T, H, K + 1)), ("k", (B, T + 1, H, K)), ("v", (B, T + 1, H, V)),
    ("v", (B, T, 3, V)), ("g", (B, T, H, 1)), ("g", (B, T)), ("beta", (B, T, H + 1)),
])
def test_shape_mismatch(name, shape):
    with raises(ValueError, name):
        gdn(**{name: torch.zeros(shape)})


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_integer_tensor(name):
    x = inputs("gated_deltanet")
    with raises(TypeError, name):
        gdn(**{name: x[name].to(torch.int64)})


@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_dtypes(name):
    x = inputs("gated_deltanet")
    with raises(TypeError, name):
        gdn(**{name: x[name].to(torch.float64)})
    y = {n: t.bfloat16() for n, t in inputs("rwkv7").items()}
    ops.chunk_rwkv7(**{**y, "w": y["w"].float()}, backend="reference")  # gates may differ
    with raises(TypeError, "b"):
        ops.chunk_rwkv7(**{**y, "b": y["b"].half()}, backend="reference")


def test_not_a_tensor():
    with raises(TypeError, "q"):
        gdn(q=[[1.0]])
    with raises(TypeError, "scale"):
        gdn(scale="big")
    with raises(ValueError, "scale"):
        gdn(scale=torch.ones(2))
    with raises(TypeError, "scale"):
        gdn(scale=True)
    with raises(ValueError, "scale"):
        gdn(scale=float("nan"))


def test_scale_any_real_number():
    """Python and numpy reals, and 0-d tensors as torch's number arguments take them; never a bool,
    a non-finite or non-positive value, a 1-element 1-D tensor (torch refuses it too) or a tensor
    that wants a gradient (it would get none)."""
    o = gdn(scale=float(np.float32(0.3)))[0]
    for scale in (np.float32(0.3), torch.tensor(0.3, dtype=torch.float32)):
        assert torch.equal(gdn(scale=scale)[0], o)
    assert torch.equal(gdn(scale=np.int64(2))[0], gdn(scale=2.0)[0])
    assert torch.equal(gdn(scale=np.float64(0.3))[0], gdn(scale=0.3)[0])
    for bad in (np.bool_(True), torch.tensor(True), 1j):
        with raises(TypeError, "scale"):
            gdn(scale=bad)
    for bad in (0, -0.5, np.float32("inf"), float("-inf"), torch.ones(1), torch.tensor(0.3, requires_grad=True)):
        with raises(ValueError, "scale"):
            gdn(scale=bad)


@pytest.mark.parametrize("dim, names", [(0, "qkv"), (1, "qkv"), (2, "qkv"), (3, "qk"), (3, "v")], ids=str)
def test_empty_dimension(dim, names):
    """B, T, H, K or V of size 0."""
    x = inputs("gated_deltanet")
    with raises(ValueError, "q"):
        gdn(**{n: x[n].narrow(dim, 0, 0) for n in names})


@pytest.mark.parametrize("name", ["k", "v", "g", "beta", "initial_state"])
def test_mixed_devices(name):
    x = inputs("gated_deltanet")
    x["initial_state"] = torch.zeros(B, H, K, V)
    x[name] = x[name].to("meta")
    with raises(ValueError, name):
        ops.chunk_gated_delta_rule(**x, backend="reference")


def test_cu_seqlens():
    x = inputs("gated_deltanet", B=1, T=10)
    call = lambda cu, **kw: ops.chunk_gated_delta_rule(**{**x, **kw}, cu_seqlens=cu, backend="reference")  # noqa: E731
    with raises(TypeError, "cu_seqlens"):
        call(torch.tensor([0.0, 10.0]))
    with raises(TypeError, "cu_seqlens"):
        call([0, 10])
    with raises(ValueError, "cu_seqlens"):
        call(torch.tensor([0, 6, 4, 10]))
    with raises(ValueError, "cu_seqlens"):
        call(torch.tensor([1, 10]))
    with raises(ValueError, "cu_seqlens"):
        call(torch.tensor([0, 9]))
    with raises(ValueError, "cu_seqlens"):
        call(torch.tensor([[0, 10]]))
    y = inputs("gated_deltanet", B=2, T=10)
    with raises(ValueError, "cu_seqlens"):
        ops.chunk_gated_delta_rule(**y, cu_seqlens=torch.tensor([0, 10]), backend="reference")
    with raises(ValueError, "initial_state"):
        call(torch.tensor([0, 4, 10]), initial_state=torch.zeros(1, H, K, V))
    o, S = call(torch.tensor([0, 4, 10]), initial_state=torch.zeros(2, H, K, V), output_final_state=True)
    assert S.shape == (2, H, K, V)


@pytest.mark.parametrize("shape", [(B, H, K, V + 1), (B + 1, H, K, V), (H, K, V)])
def test_initial_state_shape(shape):
    with raises(ValueError, "initial_state"):
        gdn(initial_state=torch.zeros(shape))


@pytest.mark.parametrize("mechanism, gate", [
    ("gated_deltanet", "g"), ("gla", "g"), ("kda", "g"), ("rwkv6", "w"), ("rwkv7", "w"), ("hgrn2", "g"),
    ("dplr", "gk"), ("comba", "g"), ("mamba2", "g"), ("retnet", "g_gamma"),
])
def test_positive_log_gate(mechanism, gate):
    m = get(mechanism)
    x = inputs(mechanism)
    x[gate] = x[gate].abs() + 0.1
    with raises(ValueError, gate):
        getattr(ops, f"chunk_{m.op}")(**x, backend="reference")
    with checks.value_checks(False):
        getattr(ops, f"chunk_{m.op}")(**x, backend="reference")


@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "initial_state"])
def test_nan_input(name):
    x = inputs("gated_deltanet")
    x["initial_state"] = torch.zeros(B, H, K, V)
    x[name] = x[name].clone()
    x[name].view(-1)[3] = float("nan")
    with raises(ValueError, name):
        ops.chunk_gated_delta_rule(**x, backend="reference")


def test_nan_gate():
    x = inputs("kda")
    x["g"][0, 0, 0, 0] = float("nan")
    with raises(ValueError, "g"):
        ops.chunk_kda(**x, backend="reference")


def test_beta_range():
    with raises(ValueError, "beta"):
        gdn(beta=torch.full((B, T, H), 1.5))
    with raises(ValueError, "beta"):
        gdn(beta=torch.full((B, T, H), -0.1))
    x = inputs("longhorn")
    with raises(ValueError, "beta"):
        ops.chunk_longhorn(**{**x, "beta": -x["beta"]}, backend="reference")


def test_per_op_extra_arguments():
    x = inputs("rwkv6")
    with raises(ValueError, "u"):
        ops.chunk_rwkv6(**{**x, "u": torch.zeros(H, K + 1)}, backend="reference")
    with raises(ValueError, "v"):
        ops.chunk_rwkv6(**{**x, "v": torch.zeros(B, T, 2 * H, V)}, backend="reference")
    with raises(ValueError, "r"):
        ops.chunk_rwkv6(**{**x, "r": torch.zeros(B, T, H)}, backend="reference")
    y = inputs("retnet")
    with raises(ValueError, "g_gamma"):
        ops.chunk_simple_gla(**{**y, "g_gamma": torch.zeros(H + 1)}, backend="reference")
    z = inputs("comba")
    with raises(ValueError, "p"):
        ops.chunk_comba(**{**z, "p": z["p"][:, :, :, :3]}, backend="reference")
    w = inputs("rwkv7")
    with raises(ValueError, "b"):
        ops.chunk_rwkv7(**{**w, "b": w["b"][:, 1:]}, backend="reference")
    with raises(TypeError, "gk"):
        ops.fused_recurrent_gla(w["r"], w["k"], w["v"], backend="reference")


def test_unknown_backend():
    with raises(ValueError, "backend"):
        ops.chunk_gated_delta_rule(**inputs("gated_deltanet"), backend="cuda-magic")


@pytest.mark.parametrize("name", ["g", "beta", "initial_state"])
def test_float64_beside_low_precision_inputs(name):
    x = {n: t.bfloat16() for n, t in inputs("gated_deltanet").items()}
    x["initial_state"] = torch.zeros(B, H, K, V)
    x[name] = x[name].double()
    with raises(TypeError, name):
        ops.chunk_gated_delta_rule(**x)
    x = {n: t.double() for n, t in x.items()}  # all float64: the reference dtype, accepted
    assert ops.chunk_gated_delta_rule(**x)[0].dtype == torch.float64


def test_value_check_modes():
    """auto (the default): values are read for CPU tensors only; True/False force them on/off for
    every device; a meta tensor has no values to read."""
    cpu, cuda, meta = torch.device("cpu"), torch.device("cuda"), torch.device("meta")
    assert checks.checking_values(cpu) and not checks.checking_values(cuda)
    for mode, want in ((True, True), ("1", True), (False, False), ("off", False), ("auto", None), (None, None)):
        with checks.value_checks(mode):
            assert checks.checking_values(cuda) is (want is True)
            assert checks.checking_values(cpu) is (want is not False)
            assert not checks.checking_values(meta)
    with pytest.raises(ValueError, match="`enabled`"):
        checks.set_value_checks("sometimes")


@pytest.mark.parametrize("env, on_cpu, on_cuda", [("auto", True, False), ("1", True, True), ("0", False, False)])
def test_value_checks_environment_variable(monkeypatch, env, on_cpu, on_cuda):
    monkeypatch.setenv("FASTWEIGHT_VALUE_CHECKS", env)
    try:
        importlib.reload(checks)
        assert checks.checking_values(torch.device("cpu")) is on_cpu
        assert checks.checking_values(torch.device("cuda")) is on_cuda
        monkeypatch.setenv("FASTWEIGHT_VALUE_CHECKS", "yes please")
        with pytest.raises(ValueError, match="FASTWEIGHT_VALUE_CHECKS"):
            importlib.reload(checks)
    finally:
        monkeypatch.undo()  # the environment as the session started, and the module's mode from it
        importlib.reload(checks)


class ValueReads(TorchDispatchMode):
    """Counts the reads of a tensor value on the host (``.item()``, ``bool()``: a sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def validate_only(monkeypatch):
    """ops validate as usual and then return instead of dispatching; the device decision of auto
    mode is the one for a CUDA tensor (values cost a sync)."""
    monkeypatch.setattr(ops.common, "call", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(checks, "reads_values_for_free", lambda device: False)


def test_default_cuda_call_reads_no_value(monkeypatch):
    validate_only(monkeypatch)
    x = inputs("gated_deltanet")
    x["g"], x["beta"] = x["g"].abs() + 0.1, torch.full_like(x["beta"], 3.0)
    x["q"] = x["q"].clone()
    x["q"].view(-1)[3] = float("nan")
    with ValueReads() as mode:
        ops.chunk_gated_delta_rule(**x, initial_state=torch.zeros(B, H, K, V))
    assert mode.reads == 0
    with checks.value_checks(True), raises(ValueError, "q"):
        ops.chunk_gated_delta_rule(**x)


def test_cu_seqlens_is_checked_in_every_mode_from_one_host_copy(monkeypatch):
    validate_only(monkeypatch)
    x = inputs("gated_deltanet", B=1, T=10)
    copies = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t) or tolist(t))
    for mode in ("auto", False):
        with checks.value_checks(mode):
            with raises(ValueError, "cu_seqlens"):
                ops.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 6, 4, 10]))
            with raises(ValueError, "cu_seqlens"):
                ops.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 9]))
    copies.clear()
    cu = torch.tensor([0, 4, 10])
    with ValueReads() as reads:
        ops.chunk_gated_delta_rule(**x, cu_seqlens=cu)
    assert len(copies) == 1 and copies[0] is cu and reads.reads == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_call_reads_cu_seqlens_once(monkeypatch, backend):
    """A whole varlen call, check and kernels' chunk bookkeeping, copies cu_seqlens to the host
    once (one sync on CUDA); the next call reads it again, in-place changes and all."""
    x = inputs("gated_deltanet", B=1, T=10)
    reads = []
    monkeypatch.setattr(checks, "_read", lambda t: reads.append(t) or t.tolist())
    cu = torch.tensor([0, 4, 10])
    o, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)
    assert len(reads) == 1 and reads[0] is cu
    cu.numpy()[1] = 7          # a write autograd's version counter does not see
    o2, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)
    assert len(reads) == 2
    ref, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 7, 10]), backend="reference")
    assert rel_err(o2, ref) < 1e-5 and rel_err(o, ref) > 1e-3


@pytest.fixture
def device_like_cpu(monkeypatch):
    """CPU tensors treated as device tensors by the cu_seqlens caches, which start empty."""
    import fastweight.kernels.common as common
    monkeypatch.setattr(checks, "_cacheable", lambda t: not t.is_inference())
    monkeypatch.setattr(common, "_cacheable", lambda t: not t.is_inference())
    monkeypatch.setattr(checks, "_HOST_CACHE", {})
    monkeypatch.setattr(common, "_CHUNKS_CACHE", {})
    reads = []
    monkeypatch.setattr(checks, "_read", lambda t: reads.append(t) or t.tolist())
    return reads


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_device_cu_seqlens_read_once_while_unchanged(device_like_cpu, backend, dtype):
    """A device cu_seqlens is copied to the host by its first call only, while the same tensor
    comes back unchanged (a model's layers: one sync a step); an in-place write (``_version``) or
    a new tensor reads again, and the result follows it."""
    reads = device_like_cpu
    x = inputs("gated_deltanet", B=1, T=10)
    cu = torch.tensor([0, 4, 10], dtype=dtype)
    o, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)
    o1, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)
    assert len(reads) == 1 and rel_err(o1, o) == 0
    cu[1] = 7                  # bumps _version
    o2, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)
    assert len(reads) == 2
    ref, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 7, 10]), backend="reference")
    assert rel_err(o2, ref) < 1e-5 and rel_err(o, ref) > 1e-3
    with raises(ValueError, "cu_seqlens"):
        ops.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 7, 9]), backend=backend)
    assert len(reads) == 4     # the new tensor above and the bad one, each read once


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unseen_write_keeps_the_checked_bounds(device_like_cpu, backend):
    """A write torch's version counter does not see (``.data``) is not seen by the cache: the call
    runs on the bounds checked before, all of them (the kernels read the checked copy, not the
    caller's tensor), never on a mix that would index out of bounds."""
    x = inputs("gated_deltanet", B=1, T=130)
    cu = torch.tensor([0, 130, 130])
    o, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)
    cu.data[1] = 65
    o2, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend=backend)
    assert torch.isfinite(o2).all() and rel_err(o2, o) == 0


def test_inference_mode_cu_seqlens():
    """A cu_seqlens made under torch.inference_mode (no version counter) is read every call."""
    x = inputs("gated_deltanet", B=1, T=10)
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 10])
    o, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=cu, backend="torch")
    ref, _ = ops.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 4, 10]), backend="reference")
    assert rel_err(o, ref) < 1e-5


def test_cu_seqlens_cache_threads():
    """The caches take concurrent readers and writers (autograd's device threads, threaded callers)."""
    import sys
    import threading
    cache, errors = {}, []
    tensors = [torch.tensor([0, i]) for i in range(64)]

    def work():
        try:
            for _ in range(200):
                for t in tensors:
                    if checks.cached_for(t, cache) is None:
                        checks.cache_for(t, cache, t.tolist())
        except Exception as e:  # noqa: BLE001 - any failure of a thread is the finding
            errors.append(e)
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert errors == [] and len(cache) <= checks._CACHE_SIZE


def test_cu_seqlens_on_meta():
    x = inputs("gated_deltanet", B=1, T=10)
    with raises(ValueError, "cu_seqlens") as e:
        ops.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 4, 10], device="meta"), backend="reference")
    assert "meta" in str(e.value)
    meta = {n: t.to("meta") for n, t in x.items()}
    with raises(ValueError, "cu_seqlens"):
        ops.chunk_gated_delta_rule(**meta, cu_seqlens=torch.tensor([0, 4, 10], device="meta"), backend="reference")
