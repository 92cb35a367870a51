import json

import pytest

from fastweight.cli import main as cli_main
from fastweight.train import TrainConfig, train


def _png(path):
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_plots_are_written(tmp_path, capsys):
    assert cli_main(["plot", "spectra", "--mechanisms", "deltanet,rwkv7,gla", "--length", "8",
                     "--out", str(tmp_path / "spectra.png")]) == 0
    _png(tmp_path / "spectra.png")
    assert cli_main(["plot", "state-norm", "--length", "64", "--out", str(tmp_path / "norm.png")]) == 0
    _png(tmp_path / "norm.png")
    train(TrainConfig(task="mqar:seq_len=24,n_pairs=3,vocab_size=32", mixer="gdn,rwkv7", d_model=32, n_layers=2,
                      steps=2, batch_size=2, eval_examples=2, progress=False, out_dir=str(tmp_path / "run")))
    assert cli_main(["plot", "attention", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"),
                     "--out", str(tmp_path / "att.png")]) == 0
    _png(tmp_path / "att.png")
    assert cli_main(["plot", "trained-spectra", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"),
                     "--out", str(tmp_path / "ts.png")]) == 0
    _png(tmp_path / "ts.png")
    assert cli_main(["plot", "state-norm", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"), "--length", "40",
                     "--out", str(tmp_path / "msn.png")]) == 0
    _png(tmp_path / "msn.png")
    suite = dict(results=[dict(label=m, group="retrieval", eval=[
        dict(task=f"s_niah_{i}:context_len={n}", acc=a) for i in (1, 2) for n, a in ((64, 1.0), (128, 0.5))])
        for m in ("gdn", "mamba2")])
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    assert cli_main(["plot", "niah-length", "--suite", str(tmp_path / "suite.json"),
                     "--out", str(tmp_path / "niah.png")]) == 0
    _png(tmp_path / "niah.png")
    assert str(tmp_path / "niah.png") in capsys.readouterr().out


def test_negative_length_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plot", "spectra", "--length", "-3"])
    assert "--length" in capsys.readouterr().err
