"""``fastweight.bench.compile_delta``: kernels compiled for sm_90 (H100 / H200) on a machine without a
GPU, so a launch configuration the GPU would refuse fails here (the interpreter never compiles)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dplr_forward_state_pass_fits_sm90(dtype):
    """The DPLR forward state pass with its output fused, at K = V = 128, fits sm_90's shared memory
    (fp32 at 2 stages would need 262,656 B of its 232,448)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "fastweight.bench.compile_delta", "--ops", "rwkv7", "--heads",
                          "128x128", "--dtype", dtype, "--kernels", "state_fwd_kernel"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("state_fwd_kernel")]
    assert lines and all(" ok, " in line and "FUSE_OUTPUT" in line for line in lines), run.stdout[-2000:]
