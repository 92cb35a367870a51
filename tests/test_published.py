import numpy as np
import pytest

from fastweight import published
from fastweight.evaluate import column, suite
from fastweight.tasks import from_spec
from fastweight.train import TrainConfig


def test_zoology_full_is_the_papers_grid():
    """Fig. 2 of Arora et al. 2023 as zoology's config has it: (length, pairs) 64/4 .. 512/64, widths
    64..512, two layers, vocabulary 8192, zoology's generator, its batch per length, its rate grid."""
    runs = published.runs("zoology", "full")
    tasks = {from_spec(r.fields["task"]) for r in runs}
    assert {(t.seq_len, t.n_pairs) for t in tasks} == {(64, 4), (128, 8), (256, 16), (512, 64)}
    assert {(t.vocab_size, t.power_a, t.distinct_values) for t in tasks} == {(8192, 0.01, 1)}
    assert {r.fields["d_model"] for r in runs} == {64, 128, 256, 512} and {r.fields["n_layers"] for r in runs} == {2}
    # state_mixer: Identity; the extra GLA row with fla's short convolutions
    assert {(r.label.split()[0], r.fields["model_args"]) for r in runs} == {
        *((m, "use_mlp=false") for m in ("attn", "mamba2", "gla", "deltanet", "gdn", "kda", "rwkv7")),
        ("gla+conv", "use_mlp=false,gla_short_conv=true")}
    assert {r.fields["mixer"] for r in runs} == {"attn", "mamba2", "gla", "deltanet", "gdn", "kda", "rwkv7"}
    assert {(from_spec(r.fields["task"]).seq_len, r.fields["batch_size"]) for r in runs} == {
        (64, 512), (128, 512), (256, 256), (512, 128)}
    np.testing.assert_allclose(runs[0].lrs, np.logspace(-4, -2, 4), rtol=1e-4)
    assert len(runs) == 4 * 4 * 8 and len({r.name for r in runs}) == len(runs)
    # our budget: 4 passes over zoology's 100k examples (the paper: 64)
    assert {r.fields["steps"] * r.fields["batch_size"] // 1000 for r in runs} == {399, 400}


def test_grazzi_and_deltaproduct_settings():
    grazzi = published.runs("grazzi", "full")
    assert {(r.fields["task"], r.fields["eval_tasks"]) for r in grazzi} == {
        (f"{t}:min_len=3,max_len=40", f"{t}:min_len=40,max_len=256") for t in ("parity_check", "modular_arithmetic")}
    assert {(r.fields["mixer"], r.fields["allow_neg_eigval"]) for r in grazzi} == {
        ("mamba2", False), ("mamba2", True), ("deltanet", False), ("deltanet", True)}
    assert {(r.fields["batch_size"], r.fields["steps"], r.fields["warmup"], r.lrs) for r in grazzi} == {
        (256, 20_000, 2000, (1e-3,))}
    words = published.runs("deltaproduct", "full")
    assert {r.fields["task"] for r in words} == {"s3:seq_len=32", "s5:seq_len=32", "s5:seq_len=32,max_moved=2"}
    assert {r.fields["n_layers"] for r in words} == {1}
    assert {r.fields["mixer"] for r in words if r.fields["allow_neg_eigval"]} == {"deltanet", "gdn", "gdp"}
    assert {r.fields["model_args"] for r in words if r.fields["mixer"] == "gdp"} == {
        f"use_short_conv=false,num_householder={n}" for n in (2, 3, 4)}
    assert all("use_short_conv=false" in r.fields["model_args"] for r in words)
    with pytest.raises(ValueError, match="group"):
        published.runs("nope", "full")
    with pytest.raises(ValueError, match="scale"):
        published.runs("grazzi", "huge")


def test_every_paper_figure_has_a_cell_of_the_full_suite():
    """A figure keyed by a row or column the full setting does not produce would never print."""
    exps = suite("full", groups=published.GROUPS)
    cells = {(e.group, e.label, column(spec)) for e in exps for spec in e.config.eval_specs}
    for group, figures in published.PAPER.items():
        for (label, col), figure in figures.items():
            assert (group, label, col) in cells, (group, label, col)
            assert figure.source and 0 <= figure.value <= 1
    assert set(published.NOTES) == set(published.METRIC) == set(published.GROUPS)


def test_estimate_follows_the_h200_record():
    """docs/results/full.md: an 800-step MQAR run of d_model 128 at 256 tokens, batch 32: ~10 s."""
    cfg = TrainConfig(task="mqar:seq_len=256,n_pairs=16,vocab_size=1024", d_model=128, n_layers=2, steps=800,
                      batch_size=32)
    assert 12 < published.estimate_seconds(cfg) < 30
    big = TrainConfig(task="mqar:seq_len=512,n_pairs=64,vocab_size=8192", d_model=512, n_layers=2, steps=800,
                      batch_size=128)
    assert published.estimate_seconds(big) > 2 * published.estimate_seconds(cfg)
    # docs/bench/runs-2026-12-03-s14.md: Zoology T 128 d 128 (781 steps x 512) took 67-80 s a run, Grazzi
    # parity (6,000 steps x 256) 112-116 s
    zoology = [r for r in published.runs("zoology", "full", widths=(128,), lengths=(128,)) if r.label.startswith("gdn")]
    seconds = published.estimate_seconds(TrainConfig(**{**zoology[0].fields, "lr": zoology[0].lrs[0]}))
    assert 55 < seconds < 95
    grazzi = TrainConfig(task="parity_check:min_len=3,max_len=40", mixer="deltanet", d_model=64, n_layers=2,
                         steps=6000, batch_size=256)
    assert 90 < published.estimate_seconds(grazzi) < 140
