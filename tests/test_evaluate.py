import io
import json
import os

import pytest

from fastweight import evaluate, published
from fastweight.cli import main as cli_main
from fastweight.evaluate import RECALL_MIXERS, RETRIEVAL_MIXERS, SCALES, column, finished, report, suite, table


def test_suite_covers_the_brief():
    exps = suite("tiny")
    retrieval = [e for e in exps if e.group == "retrieval"]
    recall = [e for e in exps if e.group == "recall"]
    state = [e for e in exps if e.group == "state tracking"]
    assert sorted({e.config.mixer for e in retrieval}) == sorted(RETRIEVAL_MIXERS)
    assert {e.config.task.split(":")[0] for e in retrieval} == {"s_niah_1"}
    # MQAR: every mixer of the brief (attention, Mamba-2, GLA, DeltaNet, GDN, KDA, RWKV-7) at every rate
    assert set(RECALL_MIXERS) == {"attn", "mamba2", "gla", "deltanet", "gdn", "kda", "rwkv7"}
    assert sorted((e.config.mixer, e.config.lr) for e in recall) == sorted(
        (m, lr) for m in RECALL_MIXERS for lr in SCALES["tiny"].mqar_lrs)
    assert len(SCALES["tiny"].mqar_lrs) >= 3 and {e.config.task.split(":")[0] for e in recall} == {"mqar"}
    assert len({e.config.out_dir for e in recall}) == len(recall)
    niah = next(e for e in retrieval if e.config.task.startswith("s_niah"))
    assert {column(s) for s in niah.config.eval_specs} >= {"S-NIAH-3 64", "S-NIAH-3 256", "S-NIAH-2 128"}
    assert niah.config.curriculum.startswith("s_niah_1:") and 0 < niah.config.curriculum_steps < niah.config.steps
    assert {(e.label, e.config.task.split(":")[0]) for e in state} == {
        (m, t) for m in ("deltanet", "deltanet (neg. eig.)", "rwkv7", "mamba2") for t in ("parity", "s5")}
    assert all(e.config.n_layers == 1 for e in state)
    assert [e.config.allow_neg_eigval for e in state if e.label.startswith("deltanet")] == [False, False, True, True]
    assert len(suite("full")) == len(exps) - len(RECALL_MIXERS) * (len(SCALES["tiny"].mqar_lrs)
                                                                   - len(SCALES["full"].mqar_lrs))
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
    lrs = len(SCALES["tiny"].mqar_lrs)
    assert saved["scale"] == "tiny" and len(saved["results"]) == saved["planned_runs"] == 2 + 2 * lrs + 3 * 2
    assert "| recall | MQAR 32 | MQAR 64 | MQAR 128 | lr | MQAR 32 at each lr |" in printed
    for res in saved["results"]:
        assert res["steps_done"] == 2 and all(0 <= r["acc"] <= 1 for r in res["eval"])
    assert (out / "table.md").read_text().strip() in printed


def test_partial_results_are_saved_after_each_run(monkeypatch, tmp_path):
    from fastweight import evaluate
    monkeypatch.setattr(evaluate, "train", lambda cfg: dict(final_loss=0.0, eval=[dict(task=cfg.task, acc=0.5)]))
    seen, log = [], io.StringIO()
    evaluate.run(suite("tiny", groups=("state tracking",), out_dir=str(tmp_path))[:3],
                 on_result=lambda r: seen.append(len(r)), log=log)
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


def test_a_sweep_row_is_its_best_rate_with_every_rate_beside_it():
    """A label trained at several learning rates shows the runs of the rate with the best mean score
    at the first task (over its seeds), that rate, and each rate's mean there."""
    def res(lr, *accs):
        return dict(group="recall", label="gdn", config=dict(lr=lr),
                    eval=[dict(task="mqar:seq_len=32", acc=accs[0]), dict(task="mqar:seq_len=64", acc=accs[1])])
    results = [res(1e-2, 0.1, 0.1), res(3e-3, 0.5, 0.4), res(3e-3, 0.7, 0.6), res(1e-3, 0.55, 0.9)]
    assert table(results, "recall").splitlines() == [
        "| recall | MQAR 32 | MQAR 64 | lr | MQAR 32 at each lr |", "|---|---|---|---|---|",
        "| gdn | 60.0 (50-70) | 50.0 (40-60) | 3e-3 | 1e-2: 10.0, 3e-3: 60.0, 1e-3: 55.0 |"]


def test_finished_runs_are_reused_and_changed_ones_retrained(tmp_path, monkeypatch):
    """A run whose out_dir holds its finished results with the same settings is read back (a stopped
    sweep resumes); another setting, fewer steps done or a missing score trains again."""
    from dataclasses import asdict, replace
    from fastweight import evaluate
    exp = suite("tiny", groups=("recall",), mixers=["deltanet"], out_dir=str(tmp_path))[0]
    trained = []

    def fake_train(cfg):
        trained.append(cfg.out_dir)
        out = dict(config=asdict(cfg), steps_done=cfg.steps, final_loss=0.5, eval=[dict(task=cfg.task, acc=0.5)])
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
            json.dump(out, f)
        return out
    monkeypatch.setattr(evaluate, "train", fake_train)
    log = io.StringIO()
    evaluate.run([exp], log=log)
    evaluate.run([replace(exp, config=replace(exp.config, threads=2, progress=True))], log=log)
    assert len(trained) == 1 and "reusing" in log.getvalue()
    assert finished(replace(exp.config, lr=0.5)) is None and finished(replace(exp.config, steps=7)) is None
    evaluate.run([exp], log=log, reuse=False)
    assert len(trained) == 2


def test_seeds_repeat_every_experiment():
    one, three = suite("tiny", groups=("state tracking",)), suite("tiny", groups=("state tracking",), seeds=3, seed=5)
    assert len(three) == 3 * len(one)
    assert sorted({e.config.seed for e in three}) == [5, 6, 7]
    assert len({e.config.out_dir for e in three}) == len(three)


def test_mixers_select_a_zoology_variant_row_by_name():
    """``gla`` takes both GLA rows (fla's layer and +conv); ``gla+conv`` that row alone, whose model
    has the short convolutions."""
    both = suite("tiny", groups=("zoology",), mixers=["gla"])
    conv = suite("tiny", groups=("zoology",), mixers=["gla+conv"])
    assert {e.label.split()[0] for e in both} == {"gla", "gla+conv"}
    assert {e.label.split()[0] for e in conv} == {"gla+conv"} and 2 * len(conv) == len(both)
    assert {e.config.model_args for e in conv} == {"use_mlp=false,gla_short_conv=true"}


@pytest.mark.parametrize("kw, name", [(dict(mixers=["gdnn"]), "mixers"), (dict(steps=0), "steps"),
                                      (dict(eval_examples=0), "eval_examples")])
def test_bad_suite_arguments_name_them(kw, name):
    with pytest.raises(ValueError, match=name):
        suite("tiny", **kw)


def test_unknown_group_and_bad_rates_name_them():
    with pytest.raises(ValueError, match="zoology"):
        suite("tiny", groups=("zoo",))
    with pytest.raises(ValueError, match="lrs"):
        suite("tiny", groups=("recall",), lrs=(0.0,))
    assert {e.config.lr for e in suite("tiny", groups=("recall", "zoology"), lrs=(5e-4,))} == {5e-4}


def test_eval_with_no_matching_run_is_an_error(tmp_path, capsys):
    assert cli_main(["eval", "--tiny", "--tasks", "bogus", "--out", str(tmp_path)]) == 2
    assert "tasks" in capsys.readouterr().err


def test_published_groups_run_tiny_and_resume(tmp_path, capsys, monkeypatch):
    """The three published groups train (2 steps each), print their tables, and a second run of the
    same command reads every run back."""
    out = tmp_path / "pub"
    argv = ["eval", "--tiny", "--groups", "zoology,grazzi,deltaproduct", "--steps", "2", "--eval-examples", "2",
            "--mixers", "deltanet,gdp", "--widths", "16", "--lengths", "32", "--out", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr()
    assert "| zoology | MQAR 32 |" in printed.out and "| deltanet d16 |" in printed.out
    assert "| grazzi | parity 10-20 | mod. arith. 10-20 |" in printed.out and "| deltanet [-1,1] |" in printed.out
    assert "| deltaproduct | S3 8 | S3 16 | S5 8 | S5 16 | S5 swaps 8 | S5 swaps 16 |" in printed.out
    assert "| gdp (n_h 2) [-1,1] |" in printed.out and "| gdp (n_h 4) [-1,1] |" in printed.out and "not found" in printed.out
    saved = json.load(open(out / "suite.json"))
    assert saved["planned_runs"] == len(saved["results"]) == 2 + 4 + 12   # deltaproduct: 3 tasks x (deltanet, gdp at n_h 2, 3, 4)
    assert saved["arguments"]["groups"] == "zoology,grazzi,deltaproduct"
    assert all(r["config"]["resume_if_present"] and r["config"]["checkpoint_every"] for r in saved["results"])
    monkeypatch.setattr(evaluate, "train", lambda cfg: pytest.fail(f"{cfg.out_dir} trained again"))
    assert cli_main(argv) == 0 and "18 runs" in capsys.readouterr().out


def test_published_table_picks_a_rate_per_cell_and_prints_the_papers():
    def res(label, spec, lr, acc, group="grazzi"):
        return dict(group=group, label=label, config=dict(lr=lr), eval=[dict(task=spec, acc=acc, seq_acc=acc)])
    parity = "parity_check:min_len=40,max_len=256"
    results = [res("deltanet [-1,1]", parity, 1e-3, 0.99), res("deltanet [-1,1]", parity, 1e-3, 1.0),
               res("gdn [-1,1]", parity, 1e-3, 0.75)]
    lines = evaluate.published_table(results, "grazzi").splitlines()
    assert lines[0] == "| grazzi | parity 40-256 | parity 40-256 (paper) |"
    assert lines[2] == "| deltanet [-1,1] | 0.990 (0.980-1.000) | 1.000 |"   # scaled: 2 acc - 1
    assert lines[3] == "| gdn [-1,1] | 0.500 | not found |"
    mqar = [res("gdn d64", f"mqar:seq_len={n},n_pairs=4,vocab_size=256", lr, acc, "zoology")
            for n, lr, acc in ((64, 1e-3, 0.2), (64, 1e-2, 0.9), (128, 1e-3, 0.7), (128, 1e-2, 0.1))]
    assert evaluate.published_table(mqar, "zoology").splitlines()[2] == "| gdn d64 | 90.0 @1e-2 | 70.0 @1e-3 |"
    assert evaluate.published_table(mqar, "grazzi") == ""


def test_estimate_and_time_limit(tmp_path, monkeypatch, capsys):
    def fail(cfg):
        raise AssertionError("--estimate trains nothing")
    monkeypatch.setattr(evaluate, "train", fail)
    assert cli_main(["eval", "--full", "--groups", "grazzi", "--estimate", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("grazzi / ") == 8 and "8 runs, ~" in printed and "H200" in printed
    clock = [0.0]
    monkeypatch.setattr(evaluate.time, "perf_counter", lambda: clock[0])

    def fake_train(cfg):
        clock[0] += 10
        return dict(final_loss=0.0, eval=[dict(task=cfg.eval_specs[0], acc=0.5)])
    monkeypatch.setattr(evaluate, "train", fake_train)
    log = io.StringIO()
    done = evaluate.run(suite("tiny", groups=("grazzi",), out_dir=str(tmp_path)), log=log, time_limit=15)
    assert len(done) == 2 and "time limit" in log.getvalue() and "6 runs not started" in log.getvalue()


def test_shards_partition_the_runs():
    """``--jobs``' shards: disjoint, together every run, each in the suite's order, balanced by estimate."""
    runs = suite("full")
    parts = [evaluate.shard(runs, i, 4) for i in range(4)]
    assert sorted(id(e) for p in parts for e in p) == sorted(id(e) for e in runs)
    for p in parts:
        assert [runs.index(e) for e in p] == sorted(runs.index(e) for e in p)
    loads = [sum(published.estimate_seconds(e.config) for e in p) for p in parts]
    assert max(loads) - min(loads) <= max(published.estimate_seconds(e.config) for e in runs)
    with pytest.raises(ValueError, match="shard"):
        evaluate.shard(runs, 4, 4)


def test_jobs_train_in_processes_and_read_back(tmp_path, capsys, monkeypatch):
    """``--jobs 2``: two processes train the runs into one --out, this one writes the table of all of them
    (training none itself), and the same command again reads them back."""
    def fail(cfg):
        raise AssertionError("the --jobs processes train; this one only reads back")
    monkeypatch.setattr(evaluate, "train", fail)
    args = ["eval", "--tiny", "--groups", "state-tracking", "--mixers", "deltanet", "--steps", "2",
            "--eval-examples", "4", "--out", str(tmp_path)]
    assert cli_main(args + ["--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("| deltanet |") == 1 and "| deltanet (neg. eig.) |" in out
    assert sorted(p.name for p in tmp_path.glob("job*.log")) == ["job0.log", "job1.log"]
    done = json.loads((tmp_path / "suite.json").read_text())["results"]
    assert len(done) == 4 and all(r["eval"] for r in done)
    assert cli_main(args) == 0
    assert capsys.readouterr().out.split("\n")[1:] == out.split("\n")[1:]  # all but the line with the seconds
    assert cli_main(args + ["--jobs", "0"]) == 2
    assert "`--jobs` must be >= 1" in capsys.readouterr().err
