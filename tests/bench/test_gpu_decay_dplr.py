"""``fastweight.bench.gpu_decay_dplr.fast_op``: the path check and time run (the bench itself needs a
GPU; the op runs here in the interpreter)."""

import pytest
import torch

from fastweight import ops
from fastweight.bench import gpu_decay_dplr
from fastweight.kernels.dplr import DplrLaunch
from fastweight.testing import rel_err


def test_default_is_the_users_path(monkeypatch):
    monkeypatch.delenv("DPLR_LAUNCH", raising=False)
    fn = gpu_decay_dplr.fast_op("rwkv7", 16)
    assert fn.func is ops.chunk_rwkv7 and fn.keywords == {"backend": "triton"}


def test_dplr_launch_from_the_environment(monkeypatch):
    """Python keywords: booleans, tuples, strings; decay ops ignore it; the DPLR op runs with it."""
    monkeypatch.setenv("DPLR_LAUNCH", "state_grads_fp32=False, bwd_config=(4, 1), wide_grid='chunk'")
    assert gpu_decay_dplr.fast_op("gla", 16).func is ops.chunk_gla
    fn = gpu_decay_dplr.fast_op("rwkv7", 16)
    assert fn.keywords["launch"] == DplrLaunch(state_grads_fp32=False, bwd_config=(4, 1), wide_grid="chunk")
    assert fn.keywords["scale"] == 1.0 and gpu_decay_dplr.fast_op("dplr_delta_rule", 16).keywords["scale"] == 0.25
    x = gpu_decay_dplr.inputs("rwkv7", 1, 70, 2, 16, torch.float32, device="cpu")
    o, _ = fn(**x, output_final_state=True)
    want, _ = ops.chunk_rwkv7(**{n: t.double() for n, t in x.items()}, output_final_state=True, backend="reference")
    assert rel_err(o, want) < 2e-5


def test_a_bad_launch_field_is_named(monkeypatch):
    monkeypatch.setenv("DPLR_LAUNCH", "state_grads=False")
    with pytest.raises(TypeError, match="state_grads"):
        gpu_decay_dplr.fast_op("rwkv7", 16)
