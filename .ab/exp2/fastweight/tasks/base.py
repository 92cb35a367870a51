"""What a task is: a seeded generator of ``(input_ids, targets, loss_mask)``.

Every task is a frozen dataclass whose fields are its parameters; ``example(rng)``
draws one sequence, ``batch(batch_size, seed)`` stacks examples. Example ``i`` of a
batch is drawn from ``numpy.random.default_rng([*seed, start + i])``, so a batch is
the same on every machine, and a data-parallel rank can draw its slice of a global
batch (``start``) without drawing the rest. The trainer needs nothing else: it
minimises the cross entropy of ``logits[b, t]`` against ``targets[b, t]`` where
``loss_mask[b, t]``; a language task puts the next token in ``targets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np
import torch


@dataclass(frozen=True)
class Batch:
    """input_ids, targets: [B, T] int64; loss_mask: [B, T] bool (positions that are scored)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.targets.to(device), self.loss_mask.to(device))


def as_seed(seed) -> list[int]:
    """An int or a tuple of ints as the entropy list of ``numpy.random.default_rng``."""
    seed = [seed] if isinstance(seed, int) else list(seed)
    if not seed or any(not isinstance(s, (int, np.integer)) or s < 0 for s in seed):
        raise ValueError(f"`seed` must be a non-negative int or a tuple of them, got {seed!r}")
    return [int(s) for s in seed]


class Task:
    """Base of the task dataclasses. Subclasses set ``name`` and define ``vocab_size``,
    ``seq_len`` and ``example(rng) -> (inputs [T], targets [T], loss_mask [T])`` as numpy arrays.

    ``metric`` says how the evaluation scores it: ``"sequence"`` (an example counts when every
    scored token is right: the needle tasks) or ``"token"`` (the fraction of scored tokens that
    are right: MQAR, parity, S5). Both are always reported.
    """

    name: ClassVar[str] = ""
    metric: ClassVar[str] = "token"

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        raise NotImplementedError

    def example(self, rng: np.random.Generator):
        raise NotImplementedError

    def batch(self, batch_size: int, seed=0, start: int = 0) -> Batch:
        """Examples ``start .. start + batch_size - 1`` of the stream named by ``seed``."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}")
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"`start` must be a non-negative int, got {start!r}")
        seed = as_seed(seed)
        rows = [self.example(np.random.default_rng(seed + [start + i])) for i in range(batch_size)]
        inputs, targets, mask = (np.stack(col) for col in zip(*rows))
        return Batch(torch.from_numpy(inputs).long(), torch.from_numpy(targets).long(),
                     torch.from_numpy(mask).bool())

    def spec(self) -> str:
        """The string that :func:`fastweight.tasks.from_spec` turns back into this task. A field declared
        with :func:`optional_field` is left out at its default (the specs written before it existed,
        and the run folders that record them, stay the same)."""
        args = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if not (f.metadata.get("optional") and getattr(self, f.name) == f.default))
        return f"{self.name}:{args}" if args else self.name


def optional_field(default):
    """A task field that :meth:`Task.spec` writes only when it is not ``default``."""
    return field(default=default, metadata={"optional": True})


def check_int(name: str, value, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
