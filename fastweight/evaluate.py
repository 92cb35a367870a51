"""``fastweight eval``: the suite that tests the seed's claims, as a table.

Two groups of experiments, each a model trained from scratch by
:func:`fastweight.train.train` and scored on held-out examples:

- retrieval: mixers {DeltaNet, Mamba-2, Gated DeltaNet, KDA, RWKV-7}, one model per
  mixer trained on S-NIAH-1 alone at a short length, then on S-NIAH-1/2/3 in turns at
  one context length (:class:`Scale`), and scored at
  several (exact match of the whole needle value). The seed's three conclusions (decay hurts
  retention, gating helps filtering, the delta rule helps memorisation) are read off this
  table and the next.
- recall: MQAR (query accuracy) for {attention, Mamba-2, GLA, DeltaNet, GDN, KDA, RWKV-7},
  scored at its training length and longer ones (the same pairs, queried from further away).
  As in Zoology (Arora et al. 2023), each mixer is trained at every learning rate of
  ``Scale.mqar_lrs`` (with every seed) and its row reports the rate of the best mean score at
  the training length, with the other rates' means beside it: one shared rate would measure
  how well each mixer suits that rate.
- state tracking: {DeltaNet, DeltaNet with ``allow_neg_eigval``, RWKV-7, Mamba-2}, one
  layer, on parity and S5 (per-position accuracy of the running product), scored
  at the training length and at twice it.

Published small-scale results reproduced side by side (``fastweight.published``): ``--groups
zoology`` (MQAR against width and length, Arora et al. 2023), ``grazzi`` (parity and modular
arithmetic with and without negative eigenvalues, Grazzi et al. 2024) and ``deltaproduct`` (S3/S5
word problems with one and two Householder steps, and RWKV-7), each printed beside the paper's
figures; ``--estimate`` prints a plan's runs with their estimated H200 seconds instead of training.

``--tiny`` (default) is sized for a 2-core CPU in under 10 minutes; ``--full`` for
one GPU. The table goes to stdout and, with the per-run results, to ``--out``
(``suite.json``, ``table.md``); ``fastweight plot niah-length`` draws its curves. A run stopped
by ``--time-limit`` (or killed) resumes: finished runs are read back, and the published groups'
runs continue from their last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

from fastweight import published
from fastweight.tasks import from_spec
from fastweight.train import TrainConfig, train

RETRIEVAL_MIXERS = ("deltanet", "mamba2", "gdn", "kda", "rwkv7")
RECALL_MIXERS = ("attn", "mamba2", "gla", "deltanet", "gdn", "kda", "rwkv7")
GROUPS = ("retrieval", "recall", "state tracking")
ALL_GROUPS = GROUPS + published.GROUPS
STATE_TRACKING_MIXERS = (("deltanet", False), ("deltanet", True), ("rwkv7", False), ("mamba2", False))
TASK_TITLES = {"s_niah_1": "S-NIAH-1", "s_niah_2": "S-NIAH-2", "s_niah_3": "S-NIAH-3", "mqar": "MQAR",
               "parity": "parity", "s5": "S5", "s3": "S3", "parity_check": "parity",
               "modular_arithmetic": "mod. arith."}
CHECKPOINT_EVERY = 500   # the published groups' runs: steps lost to a kill, at most


@dataclass(frozen=True)
class Scale:
    """The sizes of one setting of the suite.

    The S-NIAH model trains ``niah_steps`` steps in all: first ``niah_warmup_steps`` on S-NIAH-1
    alone at ``niah_warmup_len`` tokens (a curriculum: the mix of the three tasks at the training
    length does not leave chance from scratch at these sizes, see docs/evals.md), then
    S-NIAH-1/2/3 in turns at ``niah_train_len``, at ``niah_lr`` (MQAR at each rate of ``mqar_lrs``,
    the one-layer state-tracking models at ``state_lr``). ``--steps`` scales the S-NIAH warm-up with the total.
    ``data_workers``: processes
    drawing batches ahead (the GPU setting: its steps are bound by the CPU, data included).
    """

    niah_train_len: int
    niah_eval_lens: tuple
    niah_warmup_len: int
    number_digits: int
    uuid_hex: int
    mqar: str
    mqar_eval_lens: tuple
    state_len: int
    d_model: int
    n_layers: int
    n_heads: int
    niah_steps: int
    niah_warmup_steps: int
    mqar_steps: int
    parity_steps: int
    s5_steps: int
    batch_size: int
    mqar_lrs: tuple
    niah_lr: float
    state_lr: float
    eval_examples: int
    data_workers: int


SCALES = {
    "tiny": Scale(niah_train_len=64, niah_eval_lens=(64, 128, 256), niah_warmup_len=64, number_digits=3, uuid_hex=8,
                  mqar="mqar:seq_len=32,n_pairs=4,vocab_size=64", mqar_eval_lens=(32, 64, 128),
                  state_len=16, d_model=32, n_layers=2, n_heads=2, niah_steps=300, niah_warmup_steps=150,
                  mqar_steps=300, parity_steps=200, s5_steps=100, batch_size=16,
                  mqar_lrs=(1e-2, 3e-3, 1e-3), niah_lr=3e-3, state_lr=3e-3, eval_examples=32, data_workers=0),
    "full": Scale(niah_train_len=512, niah_eval_lens=(512, 1024, 2048), niah_warmup_len=128, number_digits=7,
                  uuid_hex=32, mqar="mqar:seq_len=256,n_pairs=16,vocab_size=1024", mqar_eval_lens=(256, 512, 1024),
                  state_len=64, d_model=128, n_layers=2, n_heads=2, niah_steps=1200, niah_warmup_steps=300,
                  mqar_steps=3000, parity_steps=1000, s5_steps=1000, batch_size=32,
                  mqar_lrs=(3e-3, 1e-3), niah_lr=1e-3, state_lr=3e-3, eval_examples=128, data_workers=1),
}


@dataclass(frozen=True)
class Experiment:
    """One model of one table row: trained and scored as ``config`` says (its task, eval tasks, seed)."""

    group: str
    label: str
    config: TrainConfig


def niah_specs(scale: Scale, length: int) -> list[str]:
    return [f"s_niah_1:context_len={length},value_len={scale.number_digits}",
            f"s_niah_2:context_len={length},value_len={scale.number_digits}",
            f"s_niah_3:context_len={length},value_len={scale.uuid_hex}"]


def suite(scale_name: str = "tiny", *, mixers=None, groups=GROUPS, seed: int = 0,
          steps: int | None = None, eval_examples: int | None = None, out_dir: str = "runs/eval",
          progress: bool = False, threads: int = 0, seeds: int = 1, lrs=None, widths=None,
          lengths=None) -> list[Experiment]:
    """The experiments of a setting, optionally restricted to some mixers or groups; with ``seeds``
    > 1 every experiment is repeated with seeds ``seed, seed + 1, ...`` (initialisation and data).
    ``lrs`` replaces the rates of the sweeps (recall and the published groups); ``widths`` and
    ``lengths`` keep only those zoology widths (d_model) and sequence lengths."""
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"`seeds` must be an int >= 1, got {seeds!r}")
    if seeds > 1:
        return [replace(e, config=replace(e.config, seed=seed + i, out_dir=f"{e.config.out_dir}-seed{seed + i}"))
                for i in range(seeds)
                for e in suite(scale_name, mixers=mixers, groups=groups, seed=seed, steps=steps,
                               eval_examples=eval_examples, out_dir=out_dir, progress=progress, threads=threads,
                               lrs=lrs, widths=widths, lengths=lengths)]
    if scale_name not in SCALES:
        raise ValueError(f"`scale` must be one of {sorted(SCALES)}, got {scale_name!r}")
    unknown = set(groups) - set(ALL_GROUPS)
    if unknown:
        raise ValueError(f"`groups` must be among {', '.join(map(repr, ALL_GROUPS))}, got {sorted(unknown)}")
    known = (set(RETRIEVAL_MIXERS) | set(RECALL_MIXERS) | {m for m, _ in STATE_TRACKING_MIXERS}
             | {m[0] for m in published.GRAZZI_MIXERS + published.DELTAPRODUCT_MIXERS}
             | {m + suffix for m, suffix, _ in published.ZOOLOGY_VARIANTS})
    if mixers and set(mixers) - known:
        raise ValueError(f"`mixers` must be among {sorted(known)}, got {sorted(set(mixers) - known)}")
    for name, value in (("steps", steps), ("eval_examples", eval_examples)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` must be None or an int >= 1, got {value!r}")
    if lrs is not None and (not lrs or any(not isinstance(r, (int, float)) or not r > 0 for r in lrs)):
        raise ValueError(f"`lrs` must be None or positive rates, got {lrs!r}")
    s = SCALES[scale_name]
    base = TrainConfig(d_model=s.d_model, n_layers=s.n_layers, n_heads=s.n_heads, batch_size=s.batch_size,
                       eval_examples=eval_examples or s.eval_examples, seed=seed, progress=progress,
                       threads=threads, checkpoint_every=0, log_every=5, data_workers=s.data_workers)

    def sized(n_steps, **kw):
        n_steps = steps or n_steps
        return replace(base, steps=n_steps, warmup=min(20, n_steps // 5), **kw)

    experiments = []
    if "retrieval" in groups:
        niah_eval = ";".join(spec for n in s.niah_eval_lens for spec in niah_specs(s, n))
        for mixer in RETRIEVAL_MIXERS:
            if mixers and mixer not in mixers:
                continue
            niah = sized(s.niah_steps, mixer=mixer, lr=s.niah_lr, task=";".join(niah_specs(s, s.niah_train_len)),
                         eval_tasks=niah_eval, out_dir=os.path.join(out_dir, f"niah-{mixer}"))
            warm = s.niah_warmup_steps * niah.steps // s.niah_steps
            if warm:
                niah = replace(niah, curriculum=niah_specs(s, s.niah_warmup_len)[0], curriculum_steps=warm)
            experiments.append(Experiment("retrieval", mixer, niah))
    if "recall" in groups:
        mqar = from_spec(s.mqar)
        mqar_eval = ";".join(replace(mqar, seq_len=n).spec() for n in s.mqar_eval_lens)
        for mixer in RECALL_MIXERS:
            if mixers and mixer not in mixers:
                continue
            for lr in lrs or s.mqar_lrs:
                experiments.append(Experiment("recall", mixer, sized(
                    s.mqar_steps, mixer=mixer, lr=lr, task=s.mqar, eval_tasks=mqar_eval,
                    out_dir=os.path.join(out_dir, f"mqar-{mixer}-lr{lr:g}"))))
    if "state tracking" in groups:
        for mixer, neg in STATE_TRACKING_MIXERS:
            if mixers and mixer not in mixers:
                continue
            label = mixer + (" (neg. eig.)" if neg else "")
            for task, n_steps in (("parity", s.parity_steps), ("s5", s.s5_steps)):
                experiments.append(Experiment("state tracking", label, sized(
                    n_steps, mixer=mixer, allow_neg_eigval=neg, n_layers=1, lr=s.state_lr,
                    task=f"{task}:seq_len={s.state_len}", eval_tasks=f"{task}:seq_len={s.state_len};"
                    f"{task}:seq_len={2 * s.state_len}",
                    out_dir=os.path.join(out_dir, f"{task}-{mixer}{'-neg' if neg else ''}"))))
    for group in published.GROUPS:
        if group not in groups:
            continue
        for r in published.runs(group, scale_name, widths=widths, lengths=lengths):
            # a mixer's name takes its rows; a variant's (``gla+conv``) that row alone
            if mixers and r.fields["mixer"] not in mixers and r.label.split()[0] not in mixers:
                continue
            fields = dict(r.fields)
            if steps:
                fields.update(steps=steps, warmup=min(fields["warmup"], steps // 5))
            if eval_examples:
                fields.update(eval_examples=eval_examples)
            for lr in lrs or r.lrs:
                experiments.append(Experiment(group, r.label, replace(
                    base, **fields, lr=lr, checkpoint_every=CHECKPOINT_EVERY, resume_if_present=True,
                    out_dir=os.path.join(out_dir, group, f"{r.name}-lr{lr:g}-s{fields['steps']}"))))
    return experiments


def column(spec: str) -> str:
    """'s_niah_2:context_len=128,...' -> 'S-NIAH-2 128' (the task and its length; a task of lengths
    min_len..max_len: 'parity 40-256'; S5 of swaps only: 'S5 swaps 32')."""
    task = from_spec(spec)
    title, moved = TASK_TITLES[task.name], getattr(task, "max_moved", None)
    if moved is not None and moved < task.degree:
        title += " swaps" if moved == 2 else f" moving<={moved}"
    if hasattr(task, "min_len"):
        return f"{title} {task.min_len}-{task.max_len}"
    return f"{title} {task.seq_len}"


def finished(cfg: TrainConfig) -> dict | None:
    """The results an earlier run of ``cfg`` left in ``cfg.out_dir`` (all steps done and scored, with
    the same settings but for those that do not change the model: progress bar, threads, data
    workers), else None: what lets a sweep stopped by a time limit resume where it stopped."""
    path = os.path.join(cfg.out_dir, "results.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        return None
    ignored = ("progress", "threads", "data_workers")
    same = {k: v for k, v in asdict(cfg).items() if k not in ignored}
    if ({k: v for k, v in res.get("config", {}).items() if k not in ignored} != same
            or res.get("steps_done") != cfg.steps or not res.get("eval")):
        return None
    return res


def run(experiments: list[Experiment], *, log=sys.stderr, on_result=None, reuse: bool = True,
        time_limit: float = 0) -> list[dict]:
    """Train and score every experiment; one result dict each (the trainer's, plus group and label).
    ``on_result(results)`` is called after each run (the suite saves what it has, so a run cut
    short by a time limit still leaves its table). ``reuse``: an experiment whose out_dir holds its
    finished results (:func:`finished`) is read back instead of trained again. ``time_limit`` (s,
    0: none): no run is started after that long (the same command continues where it stopped)."""
    results, start, n, skipped = [], time.perf_counter(), len(experiments), 0
    for i, exp in enumerate(experiments):
        t0 = time.perf_counter()
        if time_limit and t0 - start > time_limit and not (reuse and finished(exp.config)):
            skipped += 1
            continue
        name = f"{exp.group} / {exp.label} / {exp.config.task.split(':')[0]} / lr {_rate(exp.config.lr)}"
        res = finished(exp.config) if reuse else None
        print(f"[{i + 1}/{n}] {name}: " + (f"training {exp.config.steps} steps ..." if res is None else
              f"reusing {exp.config.out_dir}"), file=log, flush=True)
        if res is None:
            res = train(exp.config)
        res.update(group=exp.group, label=exp.label)
        results.append(res)
        accs = ", ".join(f"{column(r['task'])}: {r['acc']:.2f}" for r in res["eval"])
        done = time.perf_counter() - start
        eta = f", about {done / (i + 1) * (n - i - 1):.0f} s to go" if i + 1 < n else ""
        print(f"[{i + 1}/{n}] {name} ({time.perf_counter() - t0:.0f} s, loss {res['final_loss']:.3f}): {accs}"
              f"{eta}", file=log, flush=True)
        if on_result is not None:
            on_result(results)
    if skipped:
        print(f"time limit of {time_limit:.0f} s reached: {skipped} runs not started; the same command continues "
              "where this one stopped", file=log, flush=True)
    return results


def best_rates(results: list[dict], group: str) -> dict:
    """label -> (the learning rate whose runs score best at the first scored task on average, {lr: mean
    score there}) over a group's runs; a label trained at one rate has that rate (None without a config)."""
    by_rate = {}
    for res in results:
        if res["group"] == group and res["eval"]:
            lr = res.get("config", {}).get("lr")
            by_rate.setdefault(res["label"], {}).setdefault(lr, []).append(res["eval"][0]["acc"])
    means = {label: {lr: sum(a) / len(a) for lr, a in rates.items()} for label, rates in by_rate.items()}
    return {label: (max(m, key=m.get), m) for label, m in means.items()}


def table(results: list[dict], group: str) -> str:
    """A markdown table: one row per label, one column per scored task (accuracy in %; over several
    seeds, the mean and the range). A label trained at several learning rates (a sweep) shows the
    runs of its best rate (:func:`best_rates`), that rate, and every rate's mean at the first task."""
    best = best_rates(results, group)
    sweep = any(len(m) > 1 for _, m in best.values())
    rows, columns = {}, []
    for res in results:
        if res["group"] != group or (sweep and res.get("config", {}).get("lr") != best[res["label"]][0]):
            continue
        for r in res["eval"]:
            col = column(r["task"])
            if col not in columns:
                columns.append(col)
            rows.setdefault(res["label"], {}).setdefault(col, []).append(r["acc"])
    if not rows:
        return ""
    order = list(TASK_TITLES.values())
    columns.sort(key=lambda c: (order.index(c.rsplit(" ", 1)[0]), int(c.rsplit(" ", 1)[1])))
    extra = ["lr", f"{columns[0]} at each lr"] if sweep else []
    lines = ["| " + " | ".join([group] + columns + extra) + " |", "|" + "---|" * (len(columns) + 1 + len(extra))]
    for label, accs in rows.items():
        cells = [_cell(accs[c]) if c in accs else "-" for c in columns]
        if sweep:
            lr, means = best[label]
            cells += [_rate(lr), ", ".join(f"{_rate(r)}: {100 * m:.1f}" for r, m in sorted(means.items(), reverse=True))]
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def _rate(lr: float) -> str:
    """1e-2, 3e-3, ...: a learning rate as the docs write it."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _cell(accs: list) -> str:
    mean = 100 * sum(accs) / len(accs)
    if len(accs) == 1:
        return f"{mean:.1f}"
    return f"{mean:.1f} ({100 * min(accs):.0f}-{100 * max(accs):.0f})"


def score_of(entry: dict, metric: str) -> float:
    """One eval entry of a run read as a published group's table does (``published.METRIC``)."""
    if metric == "scaled":
        chance = 1 / from_spec(entry["task"]).n_classes
        return (entry["acc"] - chance) / (1 - chance)
    return entry[metric]


def published_table(results: list[dict], group: str) -> str:
    """A published group's markdown table: one row per label, one column per scored task, each
    cell the runs of the rate with the best mean at the run's first scored task (per row and
    training task: zoology picks a rate per width and length, as the paper does), with that rate;
    after each column the paper's figures have, a "paper" column ("not found" where it has none)."""
    metric, paper = published.METRIC[group], published.PAPER[group]
    by_rate = {}
    for res in results:
        if res["group"] == group and res["eval"]:
            key = (res["label"], column(res["eval"][0]["task"]))
            lr = res.get("config", {}).get("lr")
            by_rate.setdefault(key, {}).setdefault(lr, []).append(res)
    if not by_rate:
        return ""
    cells, rows, columns = {}, [], []
    for (label, _), rates in by_rate.items():
        mean = {lr: sum(score_of(r["eval"][0], metric) for r in runs) / len(runs) for lr, runs in rates.items()}
        best = max(mean, key=mean.get)
        for res in rates[best]:
            for entry in res["eval"]:
                col = column(entry["task"])
                columns += [col] if col not in columns else []
                rows += [label] if label not in rows else []
                cells.setdefault((label, col), ([], best if len(rates) > 1 else None))[0].append(
                    score_of(entry, metric))
    header = [group]
    for col in columns:
        header += [col] + ([f"{col} (paper)"] if any(c == col for _, c in paper) else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in rows:
        line = [label]
        for col in columns:
            values, lr = cells.get((label, col), ([], None))
            text = "-" if not values else _cell(values) if metric != "scaled" else _fraction(values)
            line.append(text + (f" @{_rate(lr)}" if lr is not None and values else ""))
            if any(c == col for _, c in paper):
                figure = paper.get((label, col))
                line.append("not found" if figure is None else f"{figure.value:.3f}" if metric == "scaled"
                            else f"{figure.value:.1f}")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines + ["", published.NOTES[group]])


def _fraction(values: list) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ({min(values):.3f}-{max(values):.3f})"


def report(results: list[dict], seconds: float, scale: str, planned: int | None = None) -> str:
    done = f"{len(results)} of {planned}" if planned not in (None, len(results)) else f"{len(results)}"
    parts = [f"fastweight eval --{scale}: {done} runs in {seconds:.0f} s"]
    for group in ALL_GROUPS:
        t = table(results, group) if group in GROUPS else published_table(results, group)
        if t:
            parts.append(t)
    return "\n\n".join(parts) + "\n"


def estimate(experiments: list[Experiment]) -> str:
    """The plan: every run with its estimated H200 seconds (``published.estimate_seconds``), the
    runs already finished in their out_dir marked, and the total left."""
    lines, left = [], 0.0
    for exp in experiments:
        seconds = published.estimate_seconds(exp.config)
        done = finished(exp.config) is not None
        left += 0 if done else seconds
        lines.append(f"{exp.group} / {exp.label} / {exp.config.task} / lr {_rate(exp.config.lr)} / "
                     f"{exp.config.steps} steps x {exp.config.batch_size}: {'done' if done else f'~{seconds:.0f} s'}")
    lines.append(f"{len(experiments)} runs, ~{left:.0f} s of H200 time left (estimate)")
    return "\n".join(lines)


def shard(experiments: list[Experiment], index: int, count: int) -> list[Experiment]:
    """Shard ``index`` of ``count`` (``--jobs``): the runs dealt out longest first, each to the shard with the
    least estimated time so far (``published.estimate_seconds``), kept in the suite's order. Deterministic, so
    every process of one call takes a disjoint part and together they take them all."""
    if not 0 <= index < count:
        raise ValueError(f"`shard` must be I/N with 0 <= I < N, got {index}/{count}")
    seconds = [published.estimate_seconds(e.config) for e in experiments]
    load, owner = [0.0] * count, {}
    for i in sorted(range(len(experiments)), key=lambda i: -seconds[i]):
        owner[i] = min(range(count), key=lambda j: (load[j], j))
        load[owner[i]] += seconds[i]
    return [e for i, e in enumerate(experiments) if owner[i] == index]


def _child_argv(args: argparse.Namespace, index: int) -> list[str]:
    """The command line of ``--jobs``' process ``index``: this call's arguments and ``--shard index/jobs``."""
    argv = ["--full" if args.full else "--tiny"]
    for name in ("mixers", "groups", "tasks", "lrs", "widths", "lengths", "time_limit", "steps", "eval_examples",
                 "seed", "seeds", "threads", "out"):
        value = getattr(args, name)
        if value not in (None, ""):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv + ["--rerun"] * args.rerun + ["--progress" if args.progress else "--no-progress",
                                                "--shard", f"{index}/{args.jobs}"]


def _run_jobs(args: argparse.Namespace) -> None:
    """``--jobs N``: N processes of this command, each training its shard into --out (logs: ``job<i>.log``
    there); returns when all have stopped."""
    import subprocess
    os.makedirs(args.out, exist_ok=True)
    procs = []
    for i in range(args.jobs):
        log = open(os.path.join(args.out, f"job{i}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "fastweight.cli", "eval", *_child_argv(args, i)],
                                       stdout=log, stderr=subprocess.STDOUT), log))
    for i, (proc, log) in enumerate(procs):
        if proc.wait():
            print(f"job {i} stopped with status {proc.returncode} (its log: {log.name})", file=sys.stderr)
        log.close()


def _numbers(text: str, kind):
    return tuple(kind(x) for x in text.split(",")) if text else None


def _run(args: argparse.Namespace) -> int:
    scale = "full" if args.full else "tiny"
    experiments = suite(scale, mixers=args.mixers.split(",") if args.mixers else None,
                        groups=tuple(g.replace("-", " ") for g in args.groups.split(",")), seed=args.seed,
                        steps=args.steps, eval_examples=args.eval_examples, out_dir=args.out,
                        progress=args.progress, threads=args.threads, seeds=args.seeds,
                        lrs=_numbers(args.lrs, float), widths=_numbers(args.widths, int),
                        lengths=_numbers(args.lengths, int))
    if args.tasks:
        wanted = args.tasks.split(",")
        experiments = [e for e in experiments if e.config.task.split(":")[0] in wanted]
    if not experiments:
        raise ValueError(f"no run of the suite matches --mixers {args.mixers!r} --groups {args.groups!r} "
                         f"--tasks {args.tasks!r}")
    if args.jobs < 1:
        raise ValueError(f"`--jobs` must be >= 1, got {args.jobs}")
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
        experiments = shard(experiments, index, count)
    if args.estimate:
        print(estimate(experiments))
        return 0
    reuse, time_limit = not args.rerun, args.time_limit
    if args.jobs > 1 and not args.shard:
        # the processes train; this one then reads every finished run back (and trains what they left, within
        # what is left of the time limit)
        started = time.perf_counter()
        _run_jobs(args)
        reuse = True
        if time_limit:
            time_limit = max(time_limit - (time.perf_counter() - started), 1e-9)
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)

    def write(name, text):
        # whole or not at all: a kill mid-write leaves the previous file; the temporary file is the
        # process's own, so calls that share one --out (different --mixers on one GPU) do not collide.
        # Each such call's table holds its own runs: the same command without --mixers reads them all back
        path = os.path.join(args.out, name)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def save(results):
        text = report(results, time.perf_counter() - t0, scale, planned=len(experiments))
        write("suite.json", json.dumps(dict(scale=scale, scale_config=asdict(SCALES[scale]),
                                            seconds=time.perf_counter() - t0, planned_runs=len(experiments),
                                            arguments={k: v for k, v in vars(args).items() if k != "func"},
                                            results=results), indent=1))
        write("table.md", text)
        return text

    print(save(run(experiments, on_result=save, reuse=reuse, time_limit=time_limit)))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval", help="train and score the retrieval and state-tracking suite",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="CPU setting, minutes (the default)")
    size.add_argument("--full", action="store_true", help="one-GPU setting")
    parser.add_argument("--mixers", default="", help="only these mixers (comma-separated; zoology's "
                        "variant rows by name, e.g. gla+conv)")
    parser.add_argument("--groups", default="retrieval,recall,state-tracking",
                        help="retrieval, recall, state-tracking; the published results: zoology, grazzi, deltaproduct")
    parser.add_argument("--tasks", default="", help="only runs trained on these (s_niah_1, mqar, parity, s5, s3, "
                                                    "parity_check, modular_arithmetic)")
    parser.add_argument("--lrs", default="", help="the rates of the sweeps (recall and published groups), "
                                                  "comma-separated (default: each setting's)")
    parser.add_argument("--widths", default="", help="zoology: only these d_model (comma-separated)")
    parser.add_argument("--lengths", default="", help="zoology: only these sequence lengths (comma-separated)")
    parser.add_argument("--estimate", action="store_true",
                        help="print the runs with their estimated H200 seconds (finished ones marked) and stop")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="start no run after this many seconds (0: none); the same command continues")
    parser.add_argument("--rerun", action="store_true",
                        help="train every run again (default: a run whose --out folder holds its finished results "
                             "with the same settings is read back, so a stopped sweep resumes)")
    parser.add_argument("--steps", type=int, default=None, help="override the training steps of every run")
    parser.add_argument("--eval-examples", type=int, default=None, help="override held-out examples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="repeat every run with this many seeds")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False,
                        help="a progress bar per run")
    parser.add_argument("--out", default="runs/eval", help="where suite.json, table.md and each run go")
    parser.add_argument("--jobs", type=int, default=1,
                        help="train the runs in this many processes at once, then read them back into one table "
                             "(the --full runs are launch-bound: nine processes on one GPU ran the suite in 294 s "
                             "where one takes ~1290)")
    parser.add_argument("--shard", default="", help=argparse.SUPPRESS)  # I/N: one --jobs process's runs
    parser.set_defaults(func=_run)
    return parser


def main(argv=None) -> int:
    from fastweight.cli import run_subcommand
    return run_subcommand(register, "eval", argv)


if __name__ == "__main__":
    sys.exit(main())
