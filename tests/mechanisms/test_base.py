"""Every registry entry: its own recurrence is the DPLR recurrence and its step is one step of its objective."""

import pytest
import torch

from fastweight import theory
from fastweight.mechanisms import REGISTRY, Mechanism, get, register
from fastweight.mechanisms.base import KERNEL_PATHS
from fastweight.testing import generator, rel_err

NAMES = tuple(REGISTRY)
TOL64 = 1e-12


def sample(name, B, T, H=2, K=8, V=6, dtype=torch.float64, seed=None):
    g = generator(seed)
    return get(name).sample(B, T, H, K, V, dtype=dtype, device="cpu", generator=g), g


def test_registry_holds_the_family():
    assert set(NAMES) == {"linear_attention", "retnet", "mamba2", "gla", "rwkv6", "hgrn2", "deltanet",
                          "gated_deltanet", "gated_deltaproduct", "kda", "comba", "longhorn", "rwkv7", "dplr"}
    for m in REGISTRY.values():
        assert m.kernel_path in KERNEL_PATHS and m.objective is not None and m.op is not None


@pytest.mark.parametrize("T", [1, 2, 63, 100])
@pytest.mark.parametrize("name", NAMES)
def test_dplr_map_and_gradient_step(name, T):
    x, g = sample(name, 2, T)
    h0 = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=g)
    m = get(name)
    assert theory.check_dplr_map(m, x, initial_state=h0, scale=0.7) <= TOL64
    assert theory.check_gradient_step(m, x, initial_state=h0) <= TOL64


@pytest.mark.parametrize("name", NAMES)
def test_varlen_is_separate_sequences(name):
    """cu_seqlens packs sequences: each restarts from its own initial state."""
    x, g = sample(name, 1, 100)
    cu = torch.tensor([0, 30, 63, 63, 100])
    h0 = torch.randn(4, 2, 8, 6, dtype=torch.float64, generator=g)
    m = get(name)
    o, S = m.recurrent(x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for i in range(4):
        bos, eos = int(cu[i]), int(cu[i + 1])
        part = {n: (t if n.startswith("_") else t[:, bos:eos]) for n, t in x.items()}
        o_i, S_i = m.recurrent(part, initial_state=h0[i:i + 1], output_final_state=True)
        if eos > bos:
            assert rel_err(o[:, bos:eos], o_i) <= TOL64
        assert rel_err(S[i:i + 1], S_i) <= TOL64
    assert theory.check_dplr_map(m, x, initial_state=h0, cu_seqlens=cu) <= TOL64


@pytest.mark.parametrize("name", NAMES)
def test_low_precision_inputs_accumulate_in_fp32(name):
    x, _ = sample(name, 1, 63, dtype=torch.float64)
    m = get(name)
    o64, S64 = m.recurrent(x, output_final_state=True)
    low = {n: t.to(torch.bfloat16) for n, t in x.items()}
    o, S = m.recurrent(low, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_err(o, o64) <= 5e-2


def test_a_broken_step_is_caught():
    """The checks can fail: a gated DeltaNet that forgets to decay fails both."""
    gdn = get("gated_deltanet")
    broken = Mechanism(**{**gdn.__dict__, "name": "broken", "step": lambda S, x: gdn.step(S, {**x, "g": 0 * x["g"]})})
    x, _ = sample("gated_deltanet", 2, 5)
    assert theory.check_dplr_map(broken, x) > 1e-3
    assert theory.check_gradient_step(broken, x) > 1e-3


def test_registry_rejects_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="registered twice"):
        register(get("gla"))
    with pytest.raises(ValueError, match="unknown mechanism"):
        get("nope")
    with pytest.raises(ValueError, match="kernel_path"):
        Mechanism(**{**get("gla").__dict__, "kernel_path": "fancy"})


def test_gradients_flow_through_the_reference():
    """The reference recurrence is differentiable in every input (autograd against finite differences)."""
    for name in ("kda", "rwkv7", "comba"):
        x, g = sample(name, 1, 3, H=1, K=3, V=2)
        m = get(name)
        names = [n for n in x if not n.startswith("_")]

        def f(*ts):
            o, S = m.recurrent({**x, **dict(zip(names, ts))}, output_final_state=True)
            return o, S

        assert torch.autograd.gradcheck(f, tuple(x[n].clone().requires_grad_() for n in names))

