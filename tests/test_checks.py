"""Bad input gets a ValueError/TypeError naming the argument, before any kernel runs."""

import re

import pytest
import torch

from fastweight import checks, ops
from fastweight.mechanisms import get
from fastweight.testing import generator

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
