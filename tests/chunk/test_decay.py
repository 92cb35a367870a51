"""The decay family's chunkwise algorithm (``fastweight.chunk.decay``) against the float64 reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fastweight.chunk import chunk_gla, chunk_simple_gla
from fastweight.chunk.decay import decay_chunk
from fastweight.mechanisms.retnet import retnet_log_gamma
from fastweight.reference import dplr_recurrent
from fastweight.testing import generator, rel_err

from chunk_cases import (DECAY_OPS, GATED_OPS, TOL, assert_close, check_fp32, check_gate_extremes,
                         check_low_precision, check_matches_reference_fp64, check_public_op, check_random_shapes,
                         check_varlen, chunk_impl, reference_impl, run, sample)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 63, 64, 100, 257])
@pytest.mark.parametrize("op", DECAY_OPS)
def test_matches_reference_fp64(op, T, chunk_size):
    check_matches_reference_fp64(op, T, chunk_size)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("op", DECAY_OPS)
def test_varlen(op, chunk_size):
    check_varlen(op, chunk_size)


@pytest.mark.parametrize("op", DECAY_OPS)
def test_fp32(op):
    check_fp32(op)


@pytest.mark.parametrize("gate_range", [(-20.0, 0.0), (0.0, 0.0)], ids=["strong", "none"])
@pytest.mark.parametrize("op", [op for op in DECAY_OPS if op in GATED_OPS])
def test_gate_extremes(op, gate_range):
    check_gate_extremes(op, gate_range)


@pytest.mark.parametrize("op", ["simple_gla", "gla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(op, dtype):
    check_low_precision(op, dtype)


def test_simple_gla_is_gla_with_a_constant_gate():
    """The scalar path (one [C, C] Gamma) and the per-channel path (secondary chunking) agree."""
    x = sample("simple_gla", 1, 100, 2, 8, 8)
    g = x["g"] + x["g_gamma"]
    o1, S1 = chunk_simple_gla(x["q"], x["k"], x["v"], g, scale=0.5, output_final_state=True)
    o2, S2 = chunk_gla(x["q"], x["k"], x["v"], g[..., None].expand_as(x["k"]), scale=0.5, output_final_state=True)
    assert rel_err(o1, o2) <= TOL[torch.float64] and rel_err(S1, S2) <= TOL[torch.float64]


def test_retention_decay_is_retnets():
    x = sample("retention", 1, 80, 3, 8, 8)
    o, S = chunk_impl("retention")(**x, scale=0.5, output_final_state=True, chunk_size=32)
    gk = retnet_log_gamma(3, dtype=torch.float64).expand(1, 80, 3)
    ro, rS = dplr_recurrent(x["q"], x["k"], x["v"], gk=gk, scale=0.5, output_final_state=True)
    assert rel_err(o, ro) <= TOL[torch.float64] and rel_err(S, rS) <= TOL[torch.float64]


def test_bonus_reads_the_state_before_the_write():
    """RWKV-6 with u = 0 and no decay: o_t = S_{t-1}^T (scale r_t), the linear attention output minus
    the current token's own contribution."""
    x = sample("rwkv6", 1, 50, 2, 8, 8, gate_range=(0.0, 0.0))
    o, _ = decay_chunk(x["r"], x["k"], x["v"], x["w"], torch.zeros_like(x["u"]), scale=0.5, chunk_size=16)
    la, _ = decay_chunk(x["r"], x["k"], x["v"], scale=0.5, chunk_size=16)
    own = 0.5 * (x["r"] * x["k"]).sum(-1, keepdim=True) * x["v"]
    assert rel_err(o, la - own) <= TOL[torch.float64]


@pytest.mark.parametrize("op", DECAY_OPS)
def test_public_op_uses_this_path(op):
    check_public_op(op)


@settings(max_examples=12, deadline=None)
@given(op=st.sampled_from(DECAY_OPS), B=st.integers(1, 2), T=st.integers(1, 90), H=st.integers(1, 2),
       K=st.sampled_from([4, 8, 16]), V=st.sampled_from([4, 8]), chunk_size=st.sampled_from([16, 32, 64]),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes(op, B, T, H, K, V, chunk_size, seed):
    check_random_shapes(op, B, T, H, K, V, chunk_size, seed)


@pytest.mark.parametrize("op, gate_dtype", [("hgrn2", torch.float16), ("simple_gla", torch.bfloat16),
                                            ("simple_gla", torch.float16)])
def test_16_bit_gates_beside_fp32_inputs(op, gate_dtype):
    """What is formed from a 16-bit gate (HGRN2's key 1 - exp g, simple GLA's g + g_gamma) is formed in
    fp32: output, final state and the gradients of q, k, v, h0 keep fp32 accuracy against the fp64
    reference on the same rounded gates (the gates' own gradients come back in their 16-bit dtype)."""
    x = {n: t.to(gate_dtype) if n in ("g", "g_gamma") else t.float() for n, t in sample(op, 2, 100, 2, 16, 16).items()}
    h0 = torch.randn(2, 2, 16, 16, generator=generator())
    got = run(chunk_impl(op), x, h0, scale=0.4)
    want = run(reference_impl(op), {n: t.double() for n, t in x.items()}, h0.double(), scale=0.4)
    assert_close(got, {n: t for n, t in want.items() if n not in ("dg", "dg_gamma")}, TOL[torch.float32])
