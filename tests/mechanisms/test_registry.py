"""The registry is the single source of truth: every list of ops or mixers in the package is read
from the ops and mixers the mechanism files declare, and every op reaches its implementations
through its declaration."""

import pathlib

import pytest
import torch

import fastweight
import fastweight.chunk
import fastweight.kernels
import fastweight.reference.ops
from fastweight import mechanisms, ops
from fastweight.analysis.attention import recorded_recurrences
from fastweight.layers import build_mixer
from fastweight.layers.linear_op import GENERIC
from fastweight.models import MIXERS, LMConfig


def test_the_lists_are_the_registry():
    assert ops.OPS == tuple(mechanisms.OPS)
    assert MIXERS == (*mechanisms.MIXERS, "attn", "swa")
    assert set(GENERIC) == {n for n, op in mechanisms.OPS.items() if op.dplr is not None}
    for name, op in mechanisms.OPS.items():
        assert op.name == name and op.mechanism in mechanisms.REGISTRY
        assert op.family in ("decay", "delta", "dplr")
        assert set(op.gates) <= set(op.args) and all(kind in ("head", "channel") for kind in op.gates.values())
        for mode in ("chunk", "fused_recurrent"):
            assert callable(getattr(ops, f"{mode}_{name}"))


@pytest.mark.parametrize("op", list(mechanisms.OPS))
def test_every_op_has_every_implementation(op):
    spec = mechanisms.OPS[op]
    assert fastweight.kernels.__getattr__(f"chunk_{op}") is spec.triton_chunk.fn
    assert fastweight.kernels.__getattr__(f"fused_recurrent_{op}") is spec.triton_fused_recurrent.fn
    assert getattr(fastweight.chunk, f"chunk_{op}") is spec.torch.fn
    assert getattr(fastweight.reference.ops, op) is spec.reference
    assert spec.impl("reference", "chunk").fn is spec.reference
    assert spec.impl("torch", "fused_recurrent") is spec.torch    # the chunk path serves both modes


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown op 'deltanet'.*delta_rule"):
        mechanisms.get_op("deltanet")
    with pytest.raises(AttributeError):
        fastweight.kernels.__getattr__("chunk_deltanet")
    with pytest.raises(ValueError, match="unknown mixer 'gated_deltanet'"):
        build_mixer("gated_deltanet", LMConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=16))


@pytest.mark.parametrize("name", list(mechanisms.MIXERS))
def test_every_mixer_runs_its_op(name):
    """A forward pass of the mixer its mechanism file declares calls that file's op."""
    torch.manual_seed(0)
    mixer = build_mixer(name, LMConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=16, mixer=name))
    with recorded_recurrences() as calls:
        mixer(torch.randn(1, 5, 32))
    assert [c.op for c in calls] == [mechanisms.MIXERS[name].op]


def test_a_mechanism_lives_in_its_file():
    """Issue 14's yardstick: the package names Longhorn in its mechanism file, the registry's import
    list and its two public functions in its family's ops module (ops/delta.py), and nowhere else."""
    root = pathlib.Path(fastweight.__file__).parent
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "longhorn" in p.read_text())
    assert files == ["mechanisms/__init__.py", "mechanisms/longhorn.py", "ops/delta.py"]
