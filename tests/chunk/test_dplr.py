"""The generic DPLR chunkwise algorithm against the per-token definition (float64 truth)."""

import pytest
import torch

from fastweight import ops
from fastweight.chunk import chunk_dplr_delta_rule, chunk_rwkv7
from fastweight.chunk.dplr import dplr_chunk
from fastweight.mechanisms import get
from fastweight.reference import dplr_recurrent
from fastweight.testing import generator, rel_err

from chunk_cases import assert_close, run

NAMES = ("q", "k", "v", "a", "b", "gk")
# measured worst over 8 seeds (o, S, every gradient): fp64 2e-14, fp32 3.4e-7 (1.6e-5 in d gk
# with strong gates when the cumulative log gates are fp32 rather than fp64: this catches it)
TOL = {torch.float64: 1e-10, torch.float32: 1e-6}


def sample(B, T, H, K, V, dtype, seed=None, gk_range=None):
    """Core-named DPLR inputs (the registry's ``dplr`` sample: stable transitions), fp64 first."""
    g = generator(seed)
    x = get("dplr").sample(B, T, H, K, V, dtype=torch.float64, device="cpu", generator=g)
    if gk_range is not None:
        lo, hi = gk_range
        x["gk"] = lo + (hi - lo) * torch.rand(B, T, H, K, dtype=torch.float64, generator=g)
    return {n: t.to(dtype) for n, t in x.items()}


def reference(x, h0, scale, cu_seqlens=None):
    x64 = {n: t.double() for n, t in x.items()}
    return run(dplr_recurrent, x64, None if h0 is None else h0.double(), scale=scale, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("T", [1, 63, 64, 100, 257])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_matches_reference_fp64(T, chunk_size):
    x = sample(1, T, 2, 16, 8, torch.float64)
    h0 = torch.randn(1, 2, 16, 8, dtype=torch.float64, generator=generator())
    got = run(dplr_chunk, x, h0, scale=0.3, chunk_size=chunk_size)
    assert_close(got, reference(x, h0, 0.3), TOL[torch.float64])


@pytest.mark.parametrize("gk_range", [None, (0.0, 0.0), (-20.0, 0.0)], ids=["rwkv7-like", "no-decay", "strong"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gates_without_overflow(dtype, gk_range):
    """log decays in [-20, 0] per step (cumulative -1280 over a chunk) and none at all."""
    x = sample(2, 100, 2, 32, 16, dtype, gk_range=gk_range)
    h0 = torch.randn(2, 2, 32, 16, dtype=dtype, generator=generator())
    got = run(dplr_chunk, x, h0, scale=32 ** -0.5, chunk_size=64)
    assert all(bool(torch.isfinite(t).all()) for t in got.values())
    assert_close(got, reference(x, h0, 32 ** -0.5), TOL[dtype])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_varlen_three_sequences(chunk_size):
    cu_seqlens = torch.tensor([0, 37, 38, 150])
    x = sample(1, 150, 2, 16, 8, torch.float64)
    h0 = torch.randn(3, 2, 16, 8, dtype=torch.float64, generator=generator())
    got = run(dplr_chunk, x, h0, scale=0.25, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    assert_close(got, reference(x, h0, 0.25, cu_seqlens), TOL[torch.float64])
    # each sequence alone gives the same
    for i in range(3):
        s, e = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        o, S = dplr_chunk(**{n: t[:, s:e] for n, t in x.items()}, scale=0.25, initial_state=h0[i:i + 1],
                          output_final_state=True, chunk_size=chunk_size)
        assert rel_err(o, got["o"][:, s:e]) <= 1e-12 and rel_err(S, got["S"][i:i + 1]) <= 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes(seed):
    g = generator(seed)
    B, T, H = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 3), (1, 130), (1, 3)))
    K, V = (int(torch.randint(1, 5, (1,), generator=g)) * 8 for _ in range(2))
    chunk_size = (16, 32, 64)[seed % 3]
    x = sample(B, T, H, K, V, torch.float64, seed=seed)
    got = run(dplr_chunk, x, None, scale=K ** -0.5, chunk_size=chunk_size)
    assert_close(got, reference(x, None, K ** -0.5), TOL[torch.float64])


def test_scalar_decay_no_low_rank_and_bonus():
    """The paths the attention maps use: scalar gk, a = b = None, RWKV-6's bonus u."""
    x = sample(1, 77, 2, 16, 8, torch.float64)
    u = torch.randn(2, 16, dtype=torch.float64, generator=generator())
    cases = [dict(x, gk=x["gk"][..., 0]), dict(x, a=None, b=None), dict(x, a=None, b=None, u=u), dict(x, u=u),
             dict(x, gk=None)]
    for case in cases:
        o, _ = dplr_chunk(**case, scale=0.25, chunk_size=32)
        o_ref, _ = dplr_recurrent(**case, scale=0.25)
        assert rel_err(o, o_ref) <= TOL[torch.float64]
    # the bonus is differentiable too
    grads = []
    for fn in (dplr_chunk, dplr_recurrent):
        u_ = u.clone().requires_grad_()
        o, _ = fn(**dict(x, u=u_), scale=0.25)
        (o * x["v"]).sum().backward()
        grads.append(u_.grad)
    assert rel_err(*grads) <= TOL[torch.float64]


def test_fla_names_swap_a_and_b():
    """chunk_dplr_delta_rule(q, k, v, a, b, gk) is S = (Diag(exp gk) + b a^T) S + k v^T."""
    x = sample(1, 70, 2, 16, 8, torch.float64)
    fla = dict(q=x["q"], k=x["k"], v=x["v"], a=x["b"], b=x["a"], gk=x["gk"])
    o, S = chunk_dplr_delta_rule(**fla, scale=0.25, output_final_state=True, chunk_size=32)
    o_ref, S_ref = dplr_recurrent(**x, scale=0.25, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(S, S_ref) <= 1e-10


@pytest.mark.parametrize("T", [63, 100])
def test_rwkv7_against_the_papers_recurrence(T):
    """chunk_rwkv7 with fla's arguments (the mechanism's ``to_op``) vs RWKV-7's row-wise update."""
    mech = get("rwkv7")
    x = mech.sample(2, T, 2, 16, 16, dtype=torch.float64, device="cpu", generator=generator())
    h0 = torch.randn(2, 2, 16, 16, dtype=torch.float64, generator=generator())
    o, S = chunk_rwkv7(**mech.to_op(x), scale=1.0, initial_state=h0, output_final_state=True, chunk_size=64)
    o_ref, S_ref = mech.recurrent(x, scale=1.0, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-10 and rel_err(S, S_ref) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(dtype):
    """Low-precision inputs are computed in fp32: o is within 2x of the fp64 reference's own rounding
    error to ``dtype`` (plus the fp32 slack of ``check_low_precision``); the fp32 state to 1e-5."""
    x = sample(1, 100, 2, 16, 16, dtype)
    o, S = dplr_chunk(**x, scale=0.25, output_final_state=True)
    o_ref, S_ref = dplr_recurrent(**{n: t.double() for n, t in x.items()}, scale=0.25, output_final_state=True)
    assert o.dtype == dtype and S.dtype == torch.float32
    floor = rel_err(o_ref.to(dtype), o_ref)
    assert rel_err(o, o_ref) <= 2 * floor + 1e-4 and rel_err(S, S_ref) <= 1e-5


def test_public_ops_use_this_path():
    x = sample(1, 40, 2, 16, 8, torch.float32)
    fla = dict(q=x["q"], k=x["k"], v=x["v"], a=x["b"], b=x["a"], gk=x["gk"])
    o, _ = ops.chunk_dplr_delta_rule(**fla, backend="torch")
    o_ref, _ = ops.chunk_dplr_delta_rule(**{n: t.double() for n, t in fla.items()}, backend="reference")
    assert rel_err(o, o_ref) <= TOL[torch.float32]
    mech = get("rwkv7")
    y = mech.to_op(mech.sample(1, 40, 2, 16, 8, dtype=torch.float64, device="cpu", generator=generator()))
    o, _ = ops.chunk_rwkv7(**{n: t.float() for n, t in y.items()}, backend="torch")
    o_ref, _ = ops.chunk_rwkv7(**y, backend="reference")
    assert rel_err(o, o_ref) <= TOL[torch.float32]


def test_bad_chunk_size():
    x = sample(1, 8, 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        dplr_chunk(**x, scale=1.0, chunk_size=48)
