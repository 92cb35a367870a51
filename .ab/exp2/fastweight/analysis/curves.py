"""Accuracy against context length and against model width, read from a ``fastweight eval`` result
(``suite.json``)."""

from __future__ import annotations

from fastweight.tasks import from_spec


def accuracy_by_length(results: list[dict], prefix: str = "s_niah") -> dict:
    """``{task name: {label: [(length, acc), ...]}}`` (sorted by length) for the scored tasks
    whose name starts with ``prefix``; ``results`` is ``suite.json``'s ``"results"`` list."""
    curves: dict = {}
    for res in results:
        for r in res["eval"]:
            task = from_spec(r["task"])
            if task.name.startswith(prefix):
                curves.setdefault(task.name, {}).setdefault(res["label"], []).append((task.seq_len, r["acc"]))
    return {name: {label: sorted(points) for label, points in by_label.items()}
            for name, by_label in sorted(curves.items())}


def accuracy_by_width(results: list[dict], group: str = "zoology") -> dict:
    """``{seq_len: {mixer: [(d_model, mean, min, max), ...]}}`` (sorted) for a group's runs, the layout
    of Zoology's Fig. 2: each point the runs (every seed) of the learning rate whose mean accuracy at
    the run's first scored task is best, as the paper plots the best rate of each width and length."""
    cells: dict = {}
    for res in results:
        cfg = res.get("config", {})
        if res["group"] == group and res["eval"]:
            key = (from_spec(cfg["task"]).seq_len, cfg["mixer"], cfg["d_model"])
            cells.setdefault(key, {}).setdefault(cfg["lr"], []).append(res["eval"][0]["acc"])
    out: dict = {}
    for (seq_len, mixer, d), rates in sorted(cells.items()):
        accs = max(rates.values(), key=lambda a: sum(a) / len(a))
        out.setdefault(seq_len, {}).setdefault(mixer, []).append((d, sum(accs) / len(accs), min(accs), max(accs)))
    return out
