"""Published small-scale results that ``fastweight eval`` reproduces: each paper's setting, as
runs of the trainer, and the figures it reports, for the table that prints ours beside them.

Three groups (``fastweight eval --groups zoology|grazzi|deltaproduct``), each with a ``tiny``
setting (CPU, seconds a run: what the tests train) and a ``full`` one (one GPU):

- ``zoology``: MQAR accuracy against model width and sequence length (Arora et al. 2023,
  arXiv:2312.04927, Fig. 2), zoology's generator (``mqar:...,power_a=0.01,distinct_values=1``),
  two layers, every width at every rate of zoology's grid, the best rate per cell.
- ``grazzi``: parity and modular arithmetic without brackets, trained on lengths 3..40 and scored
  on 40..256, with and without negative eigenvalues (Grazzi et al. 2024, arXiv:2411.12537,
  Table 3, scaled accuracy).
- ``deltaproduct``: S3, S5 and S5 restricted to swaps (word problems, every prefix's product),
  one layer, with one (DeltaNet, Gated DeltaNet) and two (Gated DeltaProduct, ``gdp``)
  Householder steps a token with ``allow_neg_eigval``, and RWKV-7 (Siems et al. 2025,
  arXiv:2502.10297; Grazzi et al. 2024, Sec. 5.2 and Fig. 4).

Where a setting or a figure could not be read from the sources this project can reach, the
docs (``docs/results/published.md``) say so and the table prints "not found"; no number here is
read off a plot. :func:`estimate_seconds` is the H200 cost model behind ``fastweight eval
--estimate`` (calibrated on ``docs/results/full.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GROUPS = ("zoology", "grazzi", "deltaproduct")
ZOOLOGY_MIXERS = ("attn", "mamba2", "gla", "deltanet", "gdn", "kda", "rwkv7")
# rows beyond each mixer's own layer: (mixer, label and name suffix, model args). GLA with fla's
# optional short convolutions on q, k, v (off in fla's layer and ours by default; without them GLA
# must copy the previous token through its state: docs/results/published.md)
ZOOLOGY_VARIANTS = (("gla", "+conv", "gla_short_conv=true"),)
GRAZZI_MIXERS = (("mamba2", False), ("mamba2", True), ("deltanet", False), ("deltanet", True))
# (mixer, negative eigenvalues, Householder steps a token: the gdp mixer's n_h)
DELTAPRODUCT_MIXERS = (("deltanet", True, 1), ("gdn", True, 1), ("gdp", True, 2), ("gdp", True, 3), ("gdp", True, 4),
                       ("rwkv7", False, 1))


@dataclass(frozen=True)
class Run:
    """One row's run before its rate: ``fields`` are :class:`fastweight.train.TrainConfig` fields
    (sizes, steps, batch, schedule); ``lrs`` the rates it is trained at (the table keeps the best)."""

    group: str
    label: str
    name: str
    lrs: tuple
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Figure:
    """A reported number: ``value`` in the table's unit, ``source`` the table or figure it is from."""

    value: float
    source: str


def _sign(neg: bool) -> str:
    return "[-1,1]" if neg else "[0,1]"


# Zoology's Fig. 2 (HazyResearch/zoology, zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py);
# ``epochs``: passes' worth of fresh examples over zoology's 100k (the paper: ZOOLOGY_PAPER_EPOCHS over a fixed set)
ZOOLOGY = {
    "full": dict(lengths=((64, 4), (128, 8), (256, 16), (512, 64)), widths=(64, 128, 256, 512), vocab=8192,
                 batch={64: 512, 128: 512, 256: 256, 512: 128}, epochs=4, examples=100_000,
                 lrs=(1e-4, 4.6416e-4, 2.1544e-3, 1e-2), eval_examples=1024),
    "tiny": dict(lengths=((32, 2), (64, 4)), widths=(16, 32), vocab=128, batch={32: 16, 64: 16}, epochs=None,
                 steps=30, lrs=(1e-2, 3e-3), eval_examples=32),
}
ZOOLOGY_PAPER_EPOCHS = 64


def zoology(scale: str, widths=None, lengths=None) -> list[Run]:
    s = ZOOLOGY[scale]
    runs = []
    for seq_len, pairs in s["lengths"]:
        if lengths and seq_len not in lengths:
            continue
        batch = s["batch"][seq_len]
        steps = s["steps"] if s["epochs"] is None else s["epochs"] * s["examples"] // batch
        task = f"mqar:seq_len={seq_len},n_pairs={pairs},vocab_size={s['vocab']},power_a=0.01,distinct_values=1"
        for d in s["widths"]:
            if widths and d not in widths:
                continue
            for mixer, suffix, args in [(m, "", "") for m in ZOOLOGY_MIXERS] + list(ZOOLOGY_VARIANTS):
                # no MLP: zoology's blocks are the mixer alone (state_mixer: Identity)
                runs.append(Run("zoology", f"{mixer}{suffix} d{d}", f"{mixer}{suffix}-d{d}-T{seq_len}", s["lrs"], dict(
                    mixer=mixer, task=task, eval_tasks=task, d_model=d, n_layers=2, n_heads=max(1, d // 64),
                    model_args=",".join(filter(None, ("use_mlp=false", args))), batch_size=batch, steps=steps,
                    warmup=max(1, steps // 20), eval_examples=s["eval_examples"])))
    return runs


# Grazzi et al. 2024, Sec. 5.1 / Table 3: the xLSTM formal-language setup (NX-AI/xlstm,
# experiments/parity_xlstm10.yaml: 2 blocks of width 64, batch 256, lr 1e-3, 20000 steps, 2000 warm-up)
GRAZZI = {
    "full": dict(train=(3, 40), test=(40, 256), d_model=64, n_layers=2, n_heads=4, batch=256, steps=20_000,
                 warmup=2000, lr=1e-3, eval_examples=2048),
    "tiny": dict(train=(3, 10), test=(10, 20), d_model=16, n_layers=1, n_heads=2, batch=16, steps=30,
                 warmup=3, lr=3e-3, eval_examples=32),
}
GRAZZI_TASKS = ("parity_check", "modular_arithmetic")


def grazzi(scale: str, widths=None, lengths=None) -> list[Run]:
    s = GRAZZI[scale]
    runs = []
    for task in GRAZZI_TASKS:
        train = f"{task}:min_len={s['train'][0]},max_len={s['train'][1]}"
        test = f"{task}:min_len={s['test'][0]},max_len={s['test'][1]}"
        for mixer, neg in GRAZZI_MIXERS:
            runs.append(Run("grazzi", f"{mixer} {_sign(neg)}", f"{task}-{mixer}{'-neg' if neg else ''}", (s["lr"],),
                            dict(mixer=mixer, allow_neg_eigval=neg, task=train, eval_tasks=test,
                                 d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"],
                                 batch_size=s["batch"], steps=s["steps"], warmup=s["warmup"],
                                 eval_examples=s["eval_examples"])))
    return runs


# Word problems: Grazzi et al. 2024, Sec. 5.2 (S5 trained at 32 tokens; as a third-party
# transcription of their App. E.2 has it: width 128, 4 heads, batch 512, lr 1e-4, weight decay
# 0.01, no short convolutions, 1 or 5 layers); DeltaProduct's own setting was not found
DELTAPRODUCT = {
    "full": dict(train_len=32, eval_lens=(32, 64, 128, 256), d_model=128, n_heads=4, batch=512, steps=10_000,
                 warmup=500, lrs=(1e-4, 1e-3), weight_decay=0.01, eval_examples=1024),
    "tiny": dict(train_len=8, eval_lens=(8, 16), d_model=16, n_heads=2, batch=16, steps=30, warmup=3,
                 lrs=(3e-3,), weight_decay=0.01, eval_examples=32),
}
DELTAPRODUCT_TASKS = (("s3", "s3"), ("s5", "s5"), ("s5 swaps", "s5:max_moved=2"))


def deltaproduct(scale: str, widths=None, lengths=None) -> list[Run]:
    s = DELTAPRODUCT[scale]
    runs = []
    for title, spec in DELTAPRODUCT_TASKS:
        name, _, extra = spec.partition(":")
        extra = f",{extra}" if extra else ""
        train = f"{name}:seq_len={s['train_len']}{extra}"
        tests = ";".join(f"{name}:seq_len={n}{extra}" for n in s["eval_lens"])
        for mixer, neg, n_h in DELTAPRODUCT_MIXERS:
            gdp = mixer == "gdp"
            label = "rwkv7" if mixer == "rwkv7" else f"{mixer}{f' (n_h {n_h})' if gdp else ''} {_sign(neg)}"
            args = "use_short_conv=false" + (f",num_householder={n_h}" if gdp else "")
            runs.append(Run("deltaproduct", label, f"{title.replace(' ', '-')}-{mixer}{n_h if gdp else ''}"
                            f"{'-neg' if neg else ''}",
                            s["lrs"], dict(mixer=mixer, allow_neg_eigval=neg, task=train, eval_tasks=tests,
                                           d_model=s["d_model"], n_layers=1, n_heads=s["n_heads"],
                                           batch_size=s["batch"], steps=s["steps"], warmup=s["warmup"],
                                           weight_decay=s["weight_decay"], model_args=args,
                                           eval_examples=s["eval_examples"])))
    return runs


BUILDERS = {"zoology": zoology, "grazzi": grazzi, "deltaproduct": deltaproduct}

# How each group's table reads a score: "acc" (%), "scaled" ((acc - 1/C) / (1 - 1/C), as a
# fraction, as Grazzi et al. print it), "seq_acc" (% of sequences with every prefix right).
METRIC = {"zoology": "acc", "grazzi": "scaled", "deltaproduct": "seq_acc"}

_GRAZZI_T3 = "Grazzi et al. 2024, Table 3 (best of 3 runs)"
# (row label, column) -> Figure; a column is the one :func:`fastweight.evaluate.column` names
PAPER = {
    "zoology": {},
    "grazzi": {
        ("mamba2 [0,1]", "parity 40-256"): Figure(0.000, _GRAZZI_T3 + ": Mamba-1 [0,1]"),
        ("mamba2 [0,1]", "mod. arith. 40-256"): Figure(0.095, _GRAZZI_T3 + ": Mamba-1 [0,1]"),
        ("mamba2 [-1,1]", "parity 40-256"): Figure(1.000, _GRAZZI_T3 + ": Mamba-1 [-1,1]"),
        ("mamba2 [-1,1]", "mod. arith. 40-256"): Figure(0.241, _GRAZZI_T3 + ": Mamba-1 [-1,1]"),
        ("deltanet [0,1]", "parity 40-256"): Figure(0.017, _GRAZZI_T3),
        ("deltanet [0,1]", "mod. arith. 40-256"): Figure(0.314, _GRAZZI_T3),
        ("deltanet [-1,1]", "parity 40-256"): Figure(1.000, _GRAZZI_T3),
        ("deltanet [-1,1]", "mod. arith. 40-256"): Figure(0.971, _GRAZZI_T3),
    },
    "deltaproduct": {},
}

NOTES = {
    "zoology": "paper: Arora et al. 2023, Fig. 2 plots these cells; no numbers found in the sources reached "
               "(docs/results/published.md)",
    "grazzi": "paper: Table 3 reports best of 3 runs (compare with the top of our range); its Mamba is Mamba-1 "
              "(ours Mamba-2; [-1,1] as theirs: a_t = 2 exp(dt A) - 1)",
    "deltaproduct": "paper: Grazzi et al. 2024, Fig. 4 (text): on S5 restricted to swaps one DeltaNet [-1,1] layer "
                    "learns the task; on full S5 every model has 0 sequence accuracy before length 30. "
                    "DeltaProduct's (arXiv:2502.10297) and RWKV-7's figures: not found",
}


def runs(group: str, scale: str, widths=None, lengths=None) -> list[Run]:
    """The runs of a published group at ``scale`` ("tiny" or "full"), optionally only some zoology
    widths (d_model) and lengths (sequence lengths)."""
    if group not in BUILDERS:
        raise ValueError(f"`group` must be one of {GROUPS}, got {group!r}")
    if scale not in ("tiny", "full"):
        raise ValueError(f"`scale` must be 'tiny' or 'full', got {scale!r}")
    return BUILDERS[group](scale, widths, lengths)


# H200 cost model of one run: a launch-bound floor per step (~17 ms at 2 layers), ~10 s of first-use
# compiling and scoring, and the model's GEMM FLOPs at an effective 16 TFLOP/s in bf16, a rate that
# also covers the mixers' own work (not in the FLOP count); the figures it is fitted to are in
# docs/results/published.md and tests/test_published.py
LAUNCH_S, LAUNCH_PER_LAYER_S, RUN_OVERHEAD_S, FLOPS = 0.007, 0.005, 10.0, 16e12


def estimate_seconds(cfg) -> float:
    """Estimated H200 seconds of one trained and scored run of ``cfg`` (a TrainConfig)."""
    from fastweight.tasks import from_spec
    task = from_spec(cfg.train_specs[0])
    tokens, vocab_size = cfg.batch_size * task.seq_len, task.vocab_size
    d, layers = cfg.d_model or 64, cfg.n_layers or 2
    steps = dict(item.split("=", 1) for item in filter(None, cfg.model_args.split(",")) if "=" in item)
    n_householder = int(steps.get("num_householder", 2)) if cfg.mixer == "gdp" else 1
    flops = 6 * tokens * (12 * layers * d * d * n_householder + 2 * vocab_size * d)
    return cfg.steps * (LAUNCH_S + LAUNCH_PER_LAYER_S * layers + flops / FLOPS) + RUN_OVERHEAD_S
