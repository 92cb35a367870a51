"""Accuracy against context length, read from a ``fastweight eval`` result (``suite.json``)."""

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
