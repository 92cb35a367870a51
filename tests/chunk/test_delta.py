"""The delta family's chunkwise algorithm (``fastweight.chunk.delta``) against the float64 reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fastweight.chunk.delta import delta_chunk
from fastweight.reference import dplr_recurrent
from fastweight.testing import rel_err

from chunk_cases import (DELTA_OPS, GATED_OPS, TOL, assert_close, check_fp32, check_gate_extremes,
                         check_low_precision, check_matches_reference_fp64, check_public_op, check_random_shapes,
                         check_varlen, chunk_impl, reference_impl, run, sample)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 63, 64, 100, 257])
@pytest.mark.parametrize("op", DELTA_OPS)
def test_matches_reference_fp64(op, T, chunk_size):
    check_matches_reference_fp64(op, T, chunk_size)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("op", DELTA_OPS)
def test_varlen(op, chunk_size):
    check_varlen(op, chunk_size)


@pytest.mark.parametrize("op", DELTA_OPS)
def test_fp32(op):
    check_fp32(op)


@pytest.mark.parametrize("gate_range", [(-20.0, 0.0), (0.0, 0.0)], ids=["strong", "none"])
@pytest.mark.parametrize("op", [op for op in DELTA_OPS if op in GATED_OPS])
def test_gate_extremes(op, gate_range):
    check_gate_extremes(op, gate_range)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    check_low_precision("gated_delta_rule", dtype)


def test_read_after_decay_or_not():
    """The generic core's two read modes are the two DPLR read keys: b = exp(g) r or b = r."""
    x = sample("comba", 1, 70, 2, 8, 8)
    kw = dict(scale=0.5, output_final_state=True, chunk_size=16)
    bk = x["beta"][..., None] * x["k"]
    for after, b in ((True, x["g"].exp()[..., None] * x["p"]), (False, x["p"])):
        o, S = delta_chunk(x["q"], x["k"], x["v"], x["beta"], x["g"], x["p"], after, **kw)
        ro, rS = dplr_recurrent(x["q"], bk, x["v"], a=-bk, b=b, gk=x["g"], scale=0.5, output_final_state=True)
        assert rel_err(o, ro) <= TOL[torch.float64] and rel_err(S, rS) <= TOL[torch.float64]


def test_negative_eigenvalues():
    """beta in (1, 2) (allow_neg_eigval): the transition's eigenvalue 1 - beta is negative."""
    x = sample("gated_delta_rule", 1, 100, 2, 8, 8)
    x["beta"] = 2 * x["beta"]
    assert_close(run(chunk_impl("gated_delta_rule"), x, None, scale=0.4, grads=False),
                 run(reference_impl("gated_delta_rule"), x, None, scale=0.4, grads=False), TOL[torch.float64])


@pytest.mark.parametrize("op", DELTA_OPS)
def test_public_op_uses_this_path(op):
    check_public_op(op)


def test_rejects_bad_chunk_size():
    x = sample("delta_rule", 1, 10, 1, 4, 4)
    for bad in (48, 16.0):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_impl("delta_rule")(**x, scale=1.0, chunk_size=bad)


@settings(max_examples=12, deadline=None)
@given(op=st.sampled_from(DELTA_OPS), B=st.integers(1, 2), T=st.integers(1, 90), H=st.integers(1, 2),
       K=st.sampled_from([4, 8, 16]), V=st.sampled_from([4, 8]), chunk_size=st.sampled_from([16, 32, 64]),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes(op, B, T, H, K, V, chunk_size, seed):
    check_random_shapes(op, B, T, H, K, V, chunk_size, seed)


def test_varlen_with_an_empty_sequence():
    """A sequence of length 0 keeps its initial state as its final state."""
    check_varlen("gated_delta_rule", 16, lengths=(20, 0, 30))
