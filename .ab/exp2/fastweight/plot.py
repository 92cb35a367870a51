"""``fastweight plot``: the analysis figures (matplotlib, PNG).

    fastweight plot spectra     [--mechanisms deltanet,rwkv7,...] [--length 32]   eigenvalues of P_t
    fastweight plot state-norm  [--mechanisms rwkv7,rwkv6,gla] [--length 4096]    ||S_t|| over time
    fastweight plot state-norm  --checkpoint a/checkpoint.pt,b/checkpoint.pt       ... of trained models
    fastweight plot attention   --checkpoint runs/eval/mqar-gdn/checkpoint.pt     A of a trained model
    fastweight plot trained-spectra --checkpoint runs/eval/parity-deltanet-neg/checkpoint.pt
    fastweight plot niah-length --suite runs/eval/suite.json                      accuracy vs length
    fastweight plot loss-curves --suite runs/eval/suite.json [--group recall]     training loss per mixer
    fastweight plot zoology     --suite runs/published/suite.json                 MQAR accuracy vs width

Each writes ``--out`` (a PNG) and prints its path. The data come from
:mod:`fastweight.analysis`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from fastweight import analysis


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, out: str) -> str:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return out


def _grid(n: int, size: float = 2.6):
    plt = _pyplot()
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat[:n])


def plot_spectra(mechanisms, out: str, *, length: int = 32, key_dim: int = 16, seed: int = 0) -> str:
    """One panel per mechanism: the eigenvalues of every step's transition in the complex plane
    (colour: time), with the unit circle."""
    fig, axes = _grid(len(mechanisms))
    circle = torch.linspace(0, 2 * math.pi, 200)
    for ax, name in zip(axes, mechanisms):
        ev = analysis.sample_spectra(name, T=length, K=key_dim, seed=seed)  # [T, H, K]
        t = torch.arange(length)[:, None, None].expand(ev.shape).flatten()
        ax.plot(circle.cos().numpy(), circle.sin().numpy(), color="0.8", lw=0.8)
        ax.scatter(ev.real.flatten().numpy(), ev.imag.flatten().numpy(), c=t.numpy(), s=6, cmap="viridis")
        ax.set_title(f"{name}\nmin {ev.real.min():.2f}, max |.| {ev.abs().max():.2f}", fontsize=8)
        ax.set_xlim(-1.15, 1.15)
        ax.set_ylim(-1.15, 1.15)
        ax.set_aspect("equal")
        ax.tick_params(labelsize=6)
    fig.suptitle(f"transition eigenvalues over {length} steps (random inputs, K={key_dim})", fontsize=9)
    return _save(fig, out)


def plot_state_norms(mechanisms, out: str, *, length: int = 4096, decay_factor: float = 0.001,
                     write_bias: float = 0.5, seed: int = 0) -> str:
    """||S_t||_F against t for each mechanism on long random inputs with slow decays and
    coherent writes (:func:`fastweight.analysis.state_norms.trained_like`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, name in enumerate(mechanisms):
        norms = analysis.sample_state_norms(name, T=length, decay_factor=decay_factor, write_bias=write_bias,
                                            seed=seed)[:, 0]
        ax.plot(range(1, length + 1), norms.numpy(), label=name, lw=1.2, ls=("-", "--", ":", "-.")[i % 4])
    ax.set_xlabel("t")
    ax.set_ylabel("||S_t||_F")
    ax.set_yscale("log")
    ax.set_title(f"state norm over time (random inputs, log decays x {decay_factor}, write bias {write_bias})",
                 fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out)


def plot_model_state_norms(checkpoints, out: str, *, length: int = 2048, every: int = 32, seed: int = 0) -> str:
    """||S||_F of every recurrent layer of trained models (mean over heads) while they read
    ``length`` uniformly random tokens of their vocabulary (far past their training length), read
    from the decode cache every ``every`` tokens."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, checkpoint in enumerate(checkpoints):
        model, task = load_trained(checkpoint)
        ids = torch.randint(0, task.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
        norms = analysis.model_state_norms(model, ids, every=every)  # [points, layers]
        x = [min(every * (j + 1), length) for j in range(norms.shape[0])]
        for layer in range(norms.shape[1]):
            if not torch.isnan(norms[:, layer]).all():
                ax.plot(x, norms[:, layer].numpy(), ls=("-", "--", ":", "-.")[i % 4], lw=1.2,
                        label=f"{model.blocks[layer].mixer_name} layer {layer}")
    ax.set_xlabel("tokens read")
    ax.set_ylabel("||S||_F")
    ax.set_yscale("log")
    ax.set_title(f"state norm of trained models over {length} random tokens", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, out)


def load_trained(checkpoint: str):
    """(model, task) of a ``fastweight train`` checkpoint (the first train task)."""
    from fastweight.models import LanguageModel, LMConfig
    from fastweight.tasks import from_spec
    from fastweight.train import TrainConfig, load_checkpoint
    state = load_checkpoint(checkpoint)
    model = LanguageModel(LMConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    cfg = TrainConfig(**state["config"])
    return model, from_spec(cfg.train_specs[0])


def plot_attention(checkpoint: str, out: str, *, seed: int = 0, max_heads: int = 4) -> str:
    """Heat maps of A (rows: output position, columns: source) of every recurrent layer and head of
    a trained model, on one held-out example of its task; scored positions are marked."""
    from fastweight.train import EVAL_STREAM
    model, task = load_trained(checkpoint)
    batch = task.batch(1, seed=(seed, EVAL_STREAM))
    maps = analysis.layer_attention_maps(model, batch.input_ids)
    panels = [(layer, h, A[0, h]) for layer, A in maps for h in range(min(A.shape[1], max_heads))]
    if not panels:
        raise ValueError(f"`checkpoint`: {checkpoint} holds a model without recurrent layers")
    fig, axes = _grid(len(panels), size=3.0)
    scored = batch.loss_mask[0].nonzero().flatten()
    for ax, (layer, h, A) in zip(axes, panels):
        scale = A.abs().max().clamp_min(1e-12)
        ax.imshow(A.numpy(), cmap="RdBu_r", vmin=-scale.item(), vmax=scale.item(), interpolation="nearest")
        ax.scatter([-1.5] * len(scored), scored.tolist(), marker=">", s=6, color="k", clip_on=False)
        ax.set_title(f"layer {layer} ({model.blocks[layer].mixer_name}), head {h}", fontsize=8)
        ax.tick_params(labelsize=6)
    fig.suptitle(f"attention map of a trained model: {task.spec()}", fontsize=9)
    return _save(fig, out)


def plot_trained_spectra(checkpoint: str, out: str, *, seed: int = 0, max_len: int = 32) -> str:
    """Per recurrent layer of a trained model: the real parts of its transitions' eigenvalues at
    every position of one held-out example (dots), the smallest per head (lines), and the input
    tokens on the x axis. A parity model with negative eigenvalues flips its state on the 1s."""
    from fastweight.analysis.spectra import recurrence_eigenvalues
    from fastweight.train import EVAL_STREAM
    model, task = load_trained(checkpoint)
    ids = task.batch(1, seed=(seed, EVAL_STREAM)).input_ids[:, :max_len]
    model.train()
    with torch.no_grad(), analysis.recorded_recurrences() as records:
        model(ids)
    if not records:
        raise ValueError(f"`checkpoint`: {checkpoint} holds a model without recurrent layers")
    fig, axes = _grid(len(records), size=4.0)
    T = ids.shape[1]
    mixers = [block.mixer for block in model.blocks]
    for ax, rec in zip(axes, records):
        with torch.no_grad():  # the gate may be formed from the layer's parameters (A_log, dt_bias)
            ev = recurrence_eigenvalues(rec)[0].real  # [T, H, K]
        t = torch.arange(T)[:, None, None].expand(ev.shape)
        ax.scatter(t.flatten().numpy(), ev.flatten().numpy(), s=4, color="0.6")
        for h in range(ev.shape[1]):
            ax.plot(range(T), ev[:, h].min(dim=-1).values.numpy(), lw=1, label=f"head {h} min")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylim(-1.1, 1.1)
        ax.set_xticks(range(T))
        ax.set_xticklabels([str(i) for i in ids[0].tolist()], fontsize=5)
        layer = mixers.index(rec.layer) if rec.layer in mixers else -1
        ax.set_title(f"layer {layer} ({rec.op}{', neg. eig.' if rec.tensors.get('allow_neg_eigval') else ''})",
                     fontsize=8)
        ax.set_xlabel("input token", fontsize=7)
        ax.legend(fontsize=6)
    fig.suptitle(f"transition eigenvalues of a trained model: {task.spec()}", fontsize=9)
    return _save(fig, out)


def plot_niah_length(suite: str, out: str) -> str:
    """One panel per S-NIAH task: accuracy against context length, one line per mixer."""
    with open(suite) as f:
        results = json.load(f)["results"]
    curves = analysis.accuracy_by_length(results)
    if not curves:
        raise ValueError(f"`suite`: {suite} holds no S-NIAH results")
    fig, axes = _grid(len(curves), size=3.2)
    for ax, (task, by_label) in zip(axes, curves.items()):
        for label, points in by_label.items():
            ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-5, 105)
        ax.set_title(task.replace("s_niah_", "S-NIAH-"), fontsize=9)
        ax.set_xlabel("context length", fontsize=8)
        ax.set_ylabel("exact match (%)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    return _save(fig, out)


def plot_loss_curves(suite: str, out: str, group: str = "recall") -> str:
    """The training loss against the step, one line per label of ``group``: the mean over the seeds of
    the runs the table reports (a sweep: the best rate's, ``evaluate.best_rates``), the band their
    range; the dotted line is chance, ln(number of answers) where the task has one (MQAR's values)."""
    from fastweight.evaluate import best_rates
    with open(suite) as f:
        results = json.load(f)["results"]
    best = best_rates(results, group)
    if not best:
        raise ValueError(f"`suite`: {suite} holds no {group!r} results")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (lr, _) in best.items():
        curves = [dict(r["curve"]) for r in results if r["group"] == group and r["label"] == label
                  and r.get("config", {}).get("lr") == lr]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        loss = torch.tensor([[c[s] for s in steps] for c in curves])
        line, = ax.plot(steps, loss.mean(0).numpy(), label=f"{label} (lr {lr:.0e}, {len(curves)} seeds)")
        ax.fill_between(steps, loss.min(0).values.numpy(), loss.max(0).values.numpy(), color=line.get_color(),
                        alpha=0.15, lw=0)
    task = next(r for r in results if r["group"] == group)["config"]["task"]
    if task.startswith("mqar"):
        from fastweight.tasks import from_spec
        vocab = from_spec(task).vocab_size
        ax.axhline(math.log(vocab - vocab // 2), color="0.5", ls=":", lw=1, label="chance (ln #values)")
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("training loss (answer tokens)", fontsize=8)
    ax.set_title(f"{group}: {task}", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)
    return _save(fig, out)


def plot_zoology(suite: str, out: str) -> str:
    """Zoology's Fig. 2 layout: MQAR accuracy against model width, one panel per sequence length, one
    line per mixer; each point the best rate's mean over the seeds, the band their range."""
    with open(suite) as f:
        panels = analysis.accuracy_by_width(json.load(f)["results"])
    if not panels:
        raise ValueError(f"`suite`: {suite} holds no zoology results")
    fig, axes = _grid(len(panels), size=3.2)
    for ax, (seq_len, by_mixer) in zip(axes, panels.items()):
        for mixer, points in by_mixer.items():
            d, mean, low, high = zip(*points)
            line, = ax.plot(d, [100 * a for a in mean], marker="o", label=mixer)
            ax.fill_between(d, [100 * a for a in low], [100 * a for a in high], color=line.get_color(), alpha=0.15,
                            lw=0)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-5, 105)
        ax.set_title(f"MQAR, sequence length {seq_len}", fontsize=9)
        ax.set_xlabel("model dimension", fontsize=8)
        ax.set_ylabel("accuracy (%)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    return _save(fig, out)


def _run(args: argparse.Namespace) -> int:
    names = lambda s: [m for m in s.split(",") if m]  # noqa: E731
    if args.figure == "spectra":
        from fastweight.mechanisms import REGISTRY
        path = plot_spectra(names(args.mechanisms) or list(REGISTRY), args.out or "spectra.png",
                            length=args.length or 32, seed=args.seed)
    elif args.figure == "state-norm" and args.checkpoint:
        path = plot_model_state_norms(names(args.checkpoint), args.out or "model_state_norm.png",
                                      length=args.length or 2048, seed=args.seed)
    elif args.figure == "state-norm":
        path = plot_state_norms(names(args.mechanisms) or ["rwkv7", "rwkv6", "gla", "gated_deltanet"],
                                args.out or "state_norm.png", length=args.length or 4096,
                                decay_factor=args.decay_factor, write_bias=args.write_bias, seed=args.seed)
    elif args.figure == "trained-spectra":
        if not args.checkpoint:
            raise SystemExit("fastweight plot trained-spectra: --checkpoint is required")
        path = plot_trained_spectra(args.checkpoint, args.out or "trained_spectra.png", seed=args.seed)
    elif args.figure == "attention":
        if not args.checkpoint:
            raise SystemExit("fastweight plot attention: --checkpoint is required")
        path = plot_attention(args.checkpoint, args.out or "attention.png", seed=args.seed)
    elif args.figure == "loss-curves":
        path = plot_loss_curves(args.suite, args.out or "loss_curves.png", group=args.group)
    elif args.figure == "zoology":
        path = plot_zoology(args.suite, args.out or "zoology.png")
    else:
        path = plot_niah_length(args.suite, args.out or "niah_length.png")
    print(path)
    return 0


def _length(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: the figure's default), got {value}")
    return value


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("plot", help="analysis figures (PNG)", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figure", choices=("spectra", "trained-spectra", "state-norm", "attention", "niah-length",
                                           "loss-curves", "zoology"))
    parser.add_argument("--out", default="", help="PNG path (default: <figure>.png)")
    parser.add_argument("--mechanisms", default="", help="comma-separated registry names")
    parser.add_argument("--length", type=_length, default=0,
                        help="sequence length (0: spectra 32, state-norm 4096, or 2048 with --checkpoint)")
    parser.add_argument("--decay-factor", type=float, default=0.001, help="state-norm: log decays scaled by this")
    parser.add_argument("--write-bias", type=float, default=0.5, help="state-norm: constant added to k and v")
    parser.add_argument("--checkpoint", default="", help="attention, trained-spectra: a fastweight train "
                        "checkpoint; state-norm: comma-separated checkpoints (trained models instead of random inputs)")
    parser.add_argument("--suite", default="runs/eval/suite.json",
                        help="niah-length, loss-curves, zoology: a fastweight eval result")
    parser.add_argument("--group", default="recall", help="loss-curves: the suite's group (recall, retrieval, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run)
    return parser


def main(argv=None) -> int:
    from fastweight.cli import run_subcommand
    return run_subcommand(register, "plot", argv)


if __name__ == "__main__":
    sys.exit(main())
