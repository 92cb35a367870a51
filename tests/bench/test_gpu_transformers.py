"""The transformers benchmark's CPU smoke run: both tables print a row per recurrence without an
error, fastweight's layer output and model logits match transformers' PyTorch recurrence, and the
greedy tokens agree (the timings themselves need the GPU)."""

import json

import pytest

pytest.importorskip("transformers")

from fastweight.bench import gpu_transformers  # noqa: E402


def test_cpu_smoke_run(tmp_path, capsys):
    gpu_transformers.main(["--device", "cpu", "--T", "48", "--B", "1", "--decode-batch", "2", "--layers", "4",
                           "--hidden", "64", "--heads", "2", "--head-dim", "16", "--new-tokens", "4",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| recurrence")]
    assert [r.split(" | ")[0] for r in rows] == ["| fastweight", "| transformers PyTorch"] * 2
    result = json.loads((tmp_path / "gpu_transformers.json").read_text())
    for section in ("layer", "model"):
        assert set(result[section]) == {"fastweight", "transformers PyTorch"}
        assert not any("error" in r or "decode_error" in r for r in result[section].values()), result[section]
    # fp32, tiny sizes: the two recurrences agree to rounding, the greedy run token for token
    assert result["layer"]["transformers PyTorch"]["err"] < 1e-5
    assert result["model"]["transformers PyTorch"]["logits_err"] < 1e-5
    assert result["model"]["transformers PyTorch"]["tokens_agree"] == 1.0
    assert result["model"]["fastweight"]["generate_tok_s"] > 0
