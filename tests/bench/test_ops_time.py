"""``fastweight.bench.ops_time`` on the CPU (the interpreter, wall clock): its cases, its lines, its errors."""

import os

import pytest

import fastweight
from fastweight.bench import ops_time


def test_parse_case_and_refusals():
    assert ops_time.parse_case("rwkv7:8,16384,64,64") == ("rwkv7", (8, 16384, 64, 64))
    with pytest.raises(ValueError, match="op:B,T,H,K"):
        ops_time.parse_case("rwkv7:8,16384,64")
    with pytest.raises(ValueError, match="unknown op"):
        ops_time.op_and_inputs("rwkv8", 1, 16, 1, 16, None, "cpu")


@pytest.mark.parametrize("op", ["gated_delta_rule", "simple_gla", "rwkv7"])
def test_times_each_family(op, capsys):
    """One line per case with a forward and a forward+backward time per sample (no peak off the GPU),
    through each family's op (delta, decay, DPLR)."""
    ops_time.main(["--cases", f"{op}:1,40,1,16", "--dtype", "fp32", "--samples", "2", "--label", "t"])
    line = capsys.readouterr().out.strip()
    head, fb = line.split(" fb ")
    fwd = head.split(" fwd ")[1].split()
    assert head.startswith(f"t {op} 1,40,1,16 fp32") and len(fwd) == 2 and len(fb.split()) == 2
    assert all(float(t) > 0 for t in fwd + fb.split())


def test_profile_needs_a_gpu():
    with pytest.raises(SystemExit, match="GPU"):
        ops_time.main(["--cases", "rwkv7:1,40,1,16", "--profile", "fwd"])


def test_forward_only(capsys):
    ops_time.main(["--cases", "simple_gla:1,40,1,16", "--dtype", "fp32", "--forward-only"])
    line = capsys.readouterr().out.strip()
    assert " fwd " in line and " fb " not in line and len(line.split(" fwd ")[1].split()) == 2


def test_refuses_a_tree_that_is_not_imported(tmp_path, monkeypatch):
    """A tree first on PYTHONPATH whose fastweight is not the one imported (``python -m`` run from another
    folder) is refused by name; the imported tree itself, or no tree, passes."""
    (tmp_path / "fastweight").mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(SystemExit, match=f"not from PYTHONPATH's {tmp_path}"):
        ops_time.main(["--cases", "simple_gla:1,40,1,16"])
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(fastweight.__file__)))
    ops_time.check_tree()
    monkeypatch.delenv("PYTHONPATH")
    ops_time.check_tree()
