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


def test_loss_curves_plot_the_best_rate_of_each_mixer(tmp_path, monkeypatch):
    """loss-curves: one line per label at the rate its table row reports (the others are not drawn)."""
    from fastweight import plot
    def run(label, lr, seed, loss):
        return dict(group="recall", label=label, config=dict(lr=lr, seed=seed, task="mqar:seq_len=32,vocab_size=64"),
                    curve=[[0, 4.2], [5, loss]], eval=[dict(task="mqar:seq_len=32", acc=1 / loss)])
    results = [run("gdn", 1e-2, 0, 3.4), run("gdn", 1e-3, 0, 1.0), run("gdn", 1e-3, 1, 2.0), run("attn", 3e-3, 0, 0.5)]
    (tmp_path / "suite.json").write_text(json.dumps(dict(results=results)))
    drawn = []
    monkeypatch.setattr(plot, "_save", lambda fig, out: drawn.extend(
        (line.get_label(), list(line.get_ydata())) for line in fig.axes[0].get_lines()) or out)
    plot.plot_loss_curves(str(tmp_path / "suite.json"), str(tmp_path / "curves.png"))
    assert drawn[0] == ("gdn (lr 1e-03, 2 seeds)", [4.2, 1.5]) and drawn[1] == ("attn (lr 3e-03, 1 seeds)", [4.2, 0.5])
    assert drawn[2][0].startswith("chance") and drawn[2][1][0] == pytest.approx(3.4657, abs=1e-4)   # ln 32
    monkeypatch.undo()
    assert cli_main(["plot", "loss-curves", "--suite", str(tmp_path / "suite.json"),
                     "--out", str(tmp_path / "curves.png")]) == 0
    _png(tmp_path / "curves.png")
    with pytest.raises(ValueError, match="retrieval"):
        plot.plot_loss_curves(str(tmp_path / "suite.json"), str(tmp_path / "c.png"), group="retrieval")


def test_negative_length_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plot", "spectra", "--length", "-3"])
    assert "--length" in capsys.readouterr().err


def test_zoology_plot_has_a_panel_per_length_and_a_line_per_mixer(tmp_path, monkeypatch):
    from fastweight import plot
    def run(mixer, d, T, acc):
        return dict(group="zoology", label=f"{mixer} d{d}", config=dict(mixer=mixer, d_model=d, lr=1e-3,
                    task=f"mqar:seq_len={T},n_pairs=4"), eval=[dict(task=f"mqar:seq_len={T},n_pairs=4", acc=acc)])
    results = [run(m, d, T, 0.5) for m in ("attn", "gdn") for d in (64, 128) for T in (64, 128)]
    (tmp_path / "suite.json").write_text(json.dumps(dict(results=results)))
    drawn = []
    monkeypatch.setattr(plot, "_save", lambda fig, out: drawn.extend(
        (ax.get_title(), [line.get_label() for line in ax.get_lines()]) for ax in fig.axes) or out)
    plot.plot_zoology(str(tmp_path / "suite.json"), str(tmp_path / "z.png"))
    assert drawn == [(f"MQAR, sequence length {T}", ["attn", "gdn"]) for T in (64, 128)]
    monkeypatch.undo()
    assert cli_main(["plot", "zoology", "--suite", str(tmp_path / "suite.json"), "--out", str(tmp_path / "z.png")]) == 0
    _png(tmp_path / "z.png")
    (tmp_path / "empty.json").write_text(json.dumps(dict(results=[])))
    with pytest.raises(ValueError, match="zoology"):
        plot.plot_zoology(str(tmp_path / "empty.json"), str(tmp_path / "e.png"))
