"""The ``fastweight`` command and ``fastweight verify``."""

import dataclasses
import importlib
import json

import pytest

from fastweight import cli, verify
from fastweight.mechanisms import REGISTRY, get


def test_verify_passes_and_prints_every_mechanism(capsys):
    assert cli.main(["verify", "--seed", "0", "--length", "63"]) == 0
    out = capsys.readouterr().out
    for name, m in verify.forms().items():
        assert name in out and m.dplr_in_words in out
    assert "all passed" in out and "FAIL" not in out


def test_verify_has_a_row_for_each_variant_form_after_its_mechanism():
    """Longhorn's diagonal_step=True (longhorn.DIAGONAL) is a row of its own, not a registry entry."""
    from fastweight.mechanisms.longhorn import DIAGONAL
    names = list(verify.forms())
    assert [n for n in names if n in REGISTRY] == list(REGISTRY) and "longhorn_diagonal" not in REGISTRY
    assert names.index("longhorn_diagonal") == names.index("longhorn") + 1
    assert verify.forms()["longhorn_diagonal"] is DIAGONAL and get("longhorn").variants == (DIAGONAL,)
    result = verify.run(seed=4, length=7, names=["longhorn_diagonal"])
    assert [r["mechanism"] for r in result["rows"]] == ["longhorn_diagonal"] and result["ok"]
    assert result["rows"][0]["dplr"] == DIAGONAL.dplr_in_words
    with pytest.raises(ValueError, match="unknown mechanism 'nope'"):
        verify.run(length=2, names=["nope"])


def test_verify_fails_on_a_broken_variant(monkeypatch, capsys):
    longhorn = get("longhorn")
    (diagonal,) = longhorn.variants
    bad = dataclasses.replace(diagonal, step=longhorn.step)   # the exact step is not the diagonal one
    monkeypatch.setitem(REGISTRY, "longhorn", dataclasses.replace(longhorn, variants=(bad,)))
    assert cli.main(["verify", "--seed", "5", "--length", "4", "--mechanism", "longhorn",
                     "--mechanism", "longhorn_diagonal"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: longhorn_diagonal" in out and "FAILED: longhorn," not in out


def test_verify_json_and_float32(capsys):
    assert cli.main(["verify", "--seed", "1", "--length", "5", "--dtype", "float32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["mechanism"] for r in result["rows"]] == list(verify.forms())
    assert result["ok"] and result["dtype"] == "float32" and result["seed"] == 1
    assert all(r["dplr_err"] <= 1e-5 and r["step_err"] <= 1e-5 for r in result["rows"])


@pytest.mark.parametrize("broken", ["step", "to_dplr"])
def test_verify_fails_on_a_broken_mechanism(broken, monkeypatch, capsys):
    kda = get("kda")
    if broken == "step":
        bad = dataclasses.replace(kda, step=lambda S, x: kda.step(S, {**x, "beta": 0.9 * x["beta"]}))
    else:
        bad = dataclasses.replace(kda, to_dplr=lambda x: {**kda.to_dplr(x), "b": x["k"]})
    monkeypatch.setitem(REGISTRY, "kda", bad)
    assert cli.main(["verify", "--seed", "2", "--length", "4"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: kda" in out
    row = next(line for line in out.splitlines() if line.startswith("kda "))
    assert row.endswith("FAIL")


def test_verify_one_mechanism(capsys):
    assert cli.main(["verify", "--mechanism", "rwkv7", "--length", "2"]) == 0
    out = capsys.readouterr().out
    assert "rwkv7" in out and "gated_deltanet" not in out


def test_every_subcommand_module_exists():
    for name in cli.SUBCOMMANDS:
        importlib.import_module(name)
    with pytest.raises(ModuleNotFoundError, match="not_written_yet"):
        cli.build_parser(("fastweight.verify", "fastweight.not_written_yet"))


def test_a_broken_subcommand_module_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "fw_broken_sub.py").write_text("import fw_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="fw_missing_dependency_xyz"):
        cli.build_parser(("fw_broken_sub",))


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "verify" in capsys.readouterr().out


def test_verify_run_api():
    result = verify.run(seed=3, length=2, names=["gla", "longhorn"])
    assert [r["mechanism"] for r in result["rows"]] == ["gla", "longhorn"] and result["ok"]


def test_module_entry_point_runs_its_subcommand(capsys):
    """``python -m fastweight.verify ARGS`` is ``fastweight verify ARGS``."""
    assert verify.main(["--length", "2", "--mechanism", "gla"]) == 0
    assert "gla" in capsys.readouterr().out


def test_train_resume_needs_a_checkpoint_and_says_so_in_help(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--help"])
    assert done.value.code == 0
    help = " ".join(capsys.readouterr().out.split())
    assert "--resume, --no-resume continue from out_dir/checkpoint.pt; an error when there is none" in help
    assert "--resume-if-present" in help and "else start at step 0" in help
    assert cli.main(["train", "--resume", "--out-dir", str(tmp_path), "--steps", "1", "--no-progress"]) == 2
    assert str(tmp_path / "checkpoint.pt") in capsys.readouterr().err


def test_a_bad_value_is_one_line_not_a_traceback(capsys, monkeypatch):
    """A typo'd mixer or task: `fastweight <command>: error: ...` naming it, exit status 2; FASTWEIGHT_TRACEBACK=1
    raises instead."""
    from fastweight import cli
    assert cli.main(["train", "--mixer", "gdnx", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastweight train: error:") and "gdnx" in err and "Traceback" not in err
    assert cli.main(["train", "--task", "mqarx", "--steps", "1"]) == 2
    assert "mqarx" in capsys.readouterr().err
    monkeypatch.setenv("FASTWEIGHT_TRACEBACK", "1")
    with pytest.raises(ValueError, match="gdnx"):
        cli.main(["train", "--mixer", "gdnx", "--steps", "1"])
