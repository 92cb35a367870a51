"""``fastweight.bench.side_by_side``: ours against fla in one process (on the CPU: the interpreter, fp16,
with fla stood in by fastweight's PyTorch path, and with fla absent)."""

import json
import sys
import types

import pytest
import torch

from fastweight import ops
from fastweight.bench import side_by_side


def _fake_fla(monkeypatch, calls):
    def chunk_gated_delta_rule(**x):
        calls.append((sorted(x), tuple(x["q"].shape)))
        return ops.chunk_gated_delta_rule(**x, backend="torch")
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    guard = types.ModuleType("fla.ops.common.chunk_o")
    guard.IS_NVIDIA_HOPPER = True
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", guard)
    return guard


def test_checks_times_and_tabulates_both(monkeypatch, tmp_path, capsys):
    calls = []
    guard = _fake_fla(monkeypatch, calls)
    rows = side_by_side.main(["--ops", "gated_delta_rule", "--shapes", "tiny", "--device", "cpu", "--dtype", "float16",
                              "--rep", "1", "--out", str(tmp_path)])
    assert guard.IS_NVIDIA_HOPPER is False   # the guard lifted by default (the check reports fla's gradients)
    assert calls and calls[0][0] == ["beta", "g", "k", "q", "v"]   # fla got the same tensors by name
    # fla's first call (where it autotunes) is at the timed shape, before the check's (1, 300)
    assert calls[0][1] == (1, 128, 2, 32) and calls[1][1] == (1, 300, 2, 32)
    (row,) = rows
    for name in ("fastweight", "fla"):
        errs = row["checks"][name]
        assert set(errs) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
        assert max(errs.values()) < 5e-3, errs   # fp16 against float64 (measured ~5e-4)
        assert row[name]["fwd"] > 0 and row[name]["fb"] > 0 and row[name]["peak"] is None
    table = capsys.readouterr().out.split("| op |")[1]
    assert "| gated_delta_rule | tiny (1, 128, 2, 32) |" in table and "x / " in table
    saved = json.loads((tmp_path / "side_by_side.json").read_text())
    assert saved["rows"][0]["fla"]["fb"] == pytest.approx(row["fla"]["fb"])


def test_without_fla(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", None)   # an import of it raises ImportError
    (row,) = side_by_side.main(["--ops", "simple_gla", "--shapes", "tiny", "--device", "cpu", "--dtype", "float16",
                                "--rep", "1", "--out", str(tmp_path / "new" / "dir")])
    assert row["fla"] is None and "fla" not in row["checks"] and row["fastweight"]["fwd"] > 0
    assert "| - / - | - |" in capsys.readouterr().out
    assert (tmp_path / "new" / "dir" / "side_by_side.json").exists()   # --out made where missing


@pytest.mark.parametrize("flag, value", [("--shapes", "huge"), ("--ops", "mamba")])
def test_unknown_names_refused(flag, value):
    with pytest.raises(SystemExit, match=f"{flag}: unknown"):
        side_by_side.main([flag, value, "--device", "cpu"])


def test_resume_keeps_finished_rows(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", None)
    monkeypatch.setitem(side_by_side.SHAPES, "tiny2", (1, 70, 2, 32))
    first = tmp_path / "first"
    (row,) = side_by_side.main(["--ops", "simple_gla", "--shapes", "tiny", "--device", "cpu", "--dtype", "float16",
                                "--rep", "1", "--out", str(first)])
    ran = []
    real = side_by_side.measure
    monkeypatch.setattr(side_by_side, "measure", lambda fn, x, *a: ran.append(x["q"].shape) or real(fn, x, *a))
    rows = side_by_side.main(["--ops", "simple_gla", "--shapes", "tiny,tiny2", "--device", "cpu", "--dtype", "float16",
                              "--rep", "1", "--out", str(tmp_path / "second"), "--resume",
                              str(first / "side_by_side.json")])
    assert [r["shape"] for r in rows] == ["tiny", "tiny2"]
    assert json.dumps(rows[0], sort_keys=True) == json.dumps(row, sort_keys=True)   # the finished row kept as it was
    assert ran == [torch.Size((1, 70, 2, 32))]   # only the new shape was timed
    saved = json.loads((tmp_path / "second" / "side_by_side.json").read_text())
    assert [r["shape"] for r in saved["rows"]] == ["tiny", "tiny2"]
    rows = side_by_side.main(["--ops", "simple_gla", "--shapes", "tiny", "--device", "cpu", "--dtype", "float32",
                              "--rep", "1", "--out", str(tmp_path / "third"), "--resume", str(first / "side_by_side.json")])
    assert [r["dtype"] for r in rows] == ["float32"]   # another dtype's rows are not this run's
