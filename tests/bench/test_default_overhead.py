"""The default-overhead benchmark: its inputs pass every op's checks, and the CPU smoke run prints
the table and fails on a ratio over the limit (the timings themselves need the GPU)."""

import pytest
import torch

from fastweight import checks, ops
from fastweight.bench import default_overhead


@pytest.mark.parametrize("op", ops.OPS)
def test_inputs_pass_the_value_checks(op):
    x, options = default_overhead.inputs(op, 1, 16, 2, 16, torch.device("cpu"))
    with checks.value_checks(True):
        o, _ = getattr(ops, f"chunk_{op}")(**x, **options)
    assert o.shape[:2] == (1, 16) and bool(torch.isfinite(o).all())


def test_cpu_smoke_run(capsys):
    argv = ["--device", "cpu", "--shape", "1,128,2,32", "--ops", "gated_delta_rule,rwkv7", "--rounds", "1"]
    assert default_overhead.main(argv + ["--limit", "0"]) == 1  # every ratio is over a limit of 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| op | default fwd | off fwd | ratio |")
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| gated_delta_rule", "| rwkv7"]
    assert "over it: gated_delta_rule, rwkv7" in out


def test_arguments_are_checked():
    for bad in (["--shape", "1,128,2"], ["--ops", "gdn"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            default_overhead.parse_args(bad)
