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


def test_sass_written_and_named_by_md5(tmp_path):
    """``--sass DIR``: each compiled kernel's SASS (no addresses or encodings) in DIR, its md5 on the
    kernel's line (what two trees are compared on)."""
    import hashlib
    import re
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "fastweight.bench.compile_delta", "--ops", "gated_delta_rule",
                          "--heads", "16x16", "--kernels", "chunk_cumsum_kernel", "--sass", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    digests = re.findall(r"sass (\d+) instructions, loops \[[\d, ]*\], md5 ([0-9a-f]{12})", run.stdout)
    files = sorted(tmp_path.iterdir())
    assert digests and len(files) == len(digests), run.stdout[-2000:]
    for (count, digest), path in zip(digests, files):
        body = path.read_text().rstrip("\n")
        assert "/*" not in body and len(body.splitlines()) == int(count) > 0
        assert hashlib.md5(body.encode()).hexdigest()[:12] == digest


def test_loop_bodies():
    """A branch back to an earlier address closes a loop (its body counted from the target to the
    branch, 16 bytes an instruction); forward branches and a branch to itself (the code's end) do not."""
    from fastweight.bench.compile_delta import loop_bodies
    text = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x4, PT ;",
        "        /*0020*/               @P0 BRA 0x60 ;",
        "        /*0030*/                   IADD3 R0, R0, 0x1, RZ ;",
        "        /*0040*/              @!P1 BRA 0x10 ;",
        "        /*0050*/                   BRA.U `(.L_x_1) ;",
        "        /*0060*/                   EXIT ;",
        "        /*0070*/                   BRA 0x70;",
    ])
    assert loop_bodies(text) == [4]
