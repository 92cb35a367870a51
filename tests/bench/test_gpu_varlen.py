"""``fastweight.bench.gpu_varlen``'s packed batch and inputs (the timing itself needs a GPU)."""

import pytest
import torch

from fastweight import ops
from fastweight.bench.gpu_varlen import _inputs, mixed_lengths


def test_mixed_lengths_fill_the_tokens():
    lengths = mixed_lengths(4 * 8192, 8192, seed=0)
    assert sum(lengths) == 4 * 8192 and lengths[0] == 1
    assert all(1 <= n <= 2 * 8192 for n in lengths) and len(set(lengths)) > 10
    assert mixed_lengths(4 * 8192, 8192, seed=0) == lengths


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda", "simple_gla", "rwkv7"])
def test_inputs_run_packed_through_the_op(op):
    """The bench's inputs, packed with its lengths, through the op (PyTorch path, CPU)."""
    lengths = mixed_lengths(96, 48, seed=1)
    x = _inputs(op, 1, 96, 2, 16, "cpu")
    cu = torch.tensor([0] + lengths).cumsum(0)
    o = getattr(ops, f"chunk_{op}")(**{n: t.float() for n, t in x.items()}, cu_seqlens=cu, backend="torch")[0]
    assert o.shape[:3] == (1, 96, 2) and torch.isfinite(o).all()
