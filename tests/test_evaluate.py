import io
import json

import pytest

from fastweight.cli import main as cli_main
from fastweight.evaluate import RETRIEVAL_MIXERS, column, report, suite, table


def test_suite_covers_the_brief():
    exps = suite("tiny")
    retrieval = [e for e in exps if e.group == "retrieval"]
    state = [e for e in exps if e.group == "state tracking"]
    assert sorted({e.config.mixer for e in retrieval}) == sorted(RETRIEVAL_MIXERS)
    assert {e.config.task.split(":")[0] for e in retrieval} == {"s_niah_1", "mqar"}
    niah = next(e for e in retrieval if e.config.task.startswith("s_niah"))
    assert {column(s) for s in niah.config.eval_specs} >= {"S-NIAH-3 64", "S-NIAH-3 256", "S-NIAH-2 128"}
    assert niah.config.curriculum.startswith("s_niah_1:") and 0 < niah.config.curriculum_steps < niah.config.steps
    assert {(e.label, e.config.task.split(":")[0]) for e in state} == {
        (m, t) for m in ("deltanet", "deltanet (neg. eig.)", "rwkv7", "mamba2") for t in ("parity", "s5")}
    assert all(e.config.n_layers == 1 for e in state)
    assert [e.config.allow_neg_eigval for e in state if e.label.startswith("deltanet")] == [False, False, True, True]
    assert len(suite("full")) == len(exps)
    short = next(e for e in suite("full", steps=12) if e.config.task.startswith("s_niah"))
    assert short.config.steps == 12 and short.config.curriculum_steps == 3  # the curriculum's share is kept
    with pytest.raises(ValueError, match="scale"):
        suite("huge")


def test_eval_tiny_smoke(tmp_path, capsys):
    out = tmp_path / "eval"
    assert cli_main(["eval", "--tiny", "--steps", "2", "--eval-examples", "2", "--mixers", "deltanet,rwkv7",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| retrieval | S-NIAH-1 64 |" in printed and "| deltanet (neg. eig.) |" in printed
    saved = json.load(open(out / "suite.json"))
    assert saved["scale"] == "tiny" and len(saved["results"]) == saved["planned_runs"] == 2 * 2 + 3 * 2
    for res in saved["results"]:
        assert res["steps_done"] == 2 and all(0 <= r["acc"] <= 1 for r in res["eval"])
    assert (out / "table.md").read_text().strip() in printed


def test_partial_results_are_saved_after_each_run(monkeypatch):
    from fastweight import evaluate
    monkeypatch.setattr(evaluate, "train", lambda cfg: dict(final_loss=0.0, eval=[dict(task=cfg.task, acc=0.5)]))
    seen, log = [], io.StringIO()
    evaluate.run(suite("tiny", groups=("state tracking",))[:3], on_result=lambda r: seen.append(len(r)), log=log)
    assert seen == [1, 2, 3]
    # progress: a line as each run starts, its result and the time left as it ends
    lines = log.getvalue().splitlines()
    assert len(lines) == 6 and lines[0].startswith("[1/3]") and "training" in lines[0]
    assert "s to go" in lines[1] and "s to go" not in lines[5]
    assert report([dict(group="state tracking", label="x", eval=[dict(task="parity", acc=1.0)])], 5.0, "full",
                  planned=18).startswith("fastweight eval --full: 1 of 18 runs in 5 s")


def test_table_layout():
    results = [dict(group="retrieval", label="gdn", eval=[dict(task="mqar", acc=0.25),
                                                            dict(task="s_niah_1:context_len=128", acc=1.0),
                                                            dict(task="s_niah_1:context_len=64", acc=0.5)])]
    assert table(results, "retrieval").splitlines() == [
        "| retrieval | S-NIAH-1 64 | S-NIAH-1 128 | MQAR 64 |", "|---|---|---|---|", "| gdn | 50.0 | 100.0 | 25.0 |"]
    assert table(results, "state tracking") == ""
    results.append(dict(group="retrieval", label="gdn", eval=[dict(task="mqar", acc=0.75)]))
    assert table(results, "retrieval").splitlines()[-1] == "| gdn | 50.0 | 100.0 | 50.0 (25-75) |"


def test_seeds_repeat_every_experiment():
    one, three = suite("tiny", groups=("state tracking",)), suite("tiny", groups=("state tracking",), seeds=3, seed=5)
    assert len(three) == 3 * len(one)
    assert sorted({e.config.seed for e in three}) == [5, 6, 7]
    assert len({e.config.out_dir for e in three}) == len(three)


@pytest.mark.parametrize("kw, name", [(dict(mixers=["gdnn"]), "mixers"), (dict(steps=0), "steps"),
                                      (dict(eval_examples=0), "eval_examples")])
def test_bad_suite_arguments_name_them(kw, name):
    with pytest.raises(ValueError, match=name):
        suite("tiny", **kw)


def test_eval_with_no_matching_run_is_an_error(tmp_path, capsys):
    assert cli_main(["eval", "--tiny", "--tasks", "bogus", "--out", str(tmp_path)]) == 2
    assert "tasks" in capsys.readouterr().err
