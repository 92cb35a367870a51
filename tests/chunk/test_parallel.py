"""The fully parallel form: every mechanism's attention map times V is its recurrent output."""

import pytest
import torch

from fastweight.chunk.parallel import attention_map, dplr_attention_map, gated_delta_attention_map
from fastweight.mechanisms import REGISTRY, get
from fastweight.testing import generator, rel_err


def apply(A, v):
    """A [B, H, T, T] @ v [B, T, H, V] -> [B, T, H, V]."""
    return (A @ v.transpose(1, 2).to(A.dtype)).transpose(1, 2)


@pytest.mark.parametrize("T", [1, 63, 100])
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_map_reproduces_recurrent_output(name, T):
    mech = get(name)
    x = mech.sample(2, T, 2, 16, 8, dtype=torch.float64, device="cpu", generator=generator())
    A = attention_map(name, x, scale=0.3)
    o, _ = mech.recurrent(x, scale=0.3)
    n = mech.steps(x)   # DPLR steps a token (Gated DeltaProduct: each token's values at n rows)
    assert A.shape == (2, 2, T, T * n)
    future = torch.arange(T * n)[None, :] > n * torch.arange(T)[:, None] + n - 1
    assert torch.equal(A[..., future], torch.zeros_like(A[..., future]))
    assert rel_err(apply(A, mech.to_dplr(x)["v"]), o) <= 1e-10


def test_map_fp32_and_default_scale():
    mech = get("rwkv7")
    x = mech.sample(1, 80, 2, 32, 8, dtype=torch.float32, device="cpu", generator=generator())
    A = attention_map(mech, x)
    o, _ = mech.recurrent({n: t.double() for n, t in x.items()})
    assert A.dtype == torch.float32
    assert rel_err(apply(A, x["v"]), o) <= 1e-5


@pytest.mark.parametrize("gated", [False, True])
def test_seed_closed_form_matches(gated):
    """A = (Q K^T * M) T for DeltaNet, (Q K^T * Gamma * M) T_Gamma for Gated DeltaNet (seed 2.4)."""
    mech = get("gated_deltanet" if gated else "deltanet")
    x = mech.sample(2, 70, 2, 16, 8, dtype=torch.float64, device="cpu", generator=generator())
    A = gated_delta_attention_map(x["q"], x["k"], x["beta"], x.get("g") if gated else None)
    assert rel_err(A, attention_map(mech, x)) <= 1e-10
    assert rel_err(apply(A, x["v"]), mech.recurrent(x)[0]) <= 1e-10


def test_strong_decays_give_finite_maps():
    """Per-channel log decays down to -20 per step: finite, and exactly lower triangular."""
    x = get("dplr").sample(1, 100, 2, 16, 8, dtype=torch.float64, device="cpu", generator=generator())
    gk = -20 * torch.rand(x["gk"].shape, dtype=torch.float64, generator=generator())
    A = dplr_attention_map(x["q"], x["k"], x["a"], x["b"], gk, chunk_size=32)
    assert torch.isfinite(A).all()
    o, _ = get("dplr").recurrent(dict(x, gk=gk))
    assert rel_err(apply(A, x["v"]), o) <= 1e-10
