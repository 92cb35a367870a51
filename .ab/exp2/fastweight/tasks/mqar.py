"""Multi-query associative recall (MQAR; Arora et al. 2023, the zoology suite).

A sequence opens with ``n_pairs`` key-value pairs ``k_1 v_1 k_2 v_2 ...`` (keys
distinct, drawn from ``[1, vocab_size // 2)``, values from ``[vocab_size // 2,
vocab_size)``); the rest holds every key once more, in a random order, at random
even offsets, with token 0 everywhere else. At the position of each queried key the
target is its value (scored there only). Layout for ``n_pairs = 2``, ``seq_len = 10``:

    input:  k1 v1 k2 v2 | 0  0  k2 0  k1 0
    target:  .  .  .  . | .  .  v2 .  v1 .

``power_a`` and ``distinct_values`` give zoology's own generator
(``zoology/data/associative_recall.py``, ``_mqar``, behind the paper's Figure 2): the query of
pair i sits at offset ``2 g_i`` of the query region, the gaps ``g_1, g_2, ...`` drawn one after
the other without replacement with ``p(g) ~ (g + 1) ** (power_a - 1)`` (zoology's 0.01 puts most
queries soon after the pairs; 1.0, the default, is uniform: this task's original layout, drawn
the same way as before), and ``distinct_values=1`` draws the values without replacement, as
zoology does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fastweight.tasks.base import Task, check_int, optional_field


@dataclass(frozen=True)
class MQAR(Task):
    name: ClassVar[str] = "mqar"
    seq_len: int = 64
    n_pairs: int = 8
    vocab_size: int = 128
    power_a: float = optional_field(1.0)
    distinct_values: int = optional_field(0)

    def __post_init__(self):
        check_int("n_pairs", self.n_pairs, 1)
        check_int("vocab_size", self.vocab_size, 4)
        check_int("seq_len", self.seq_len, 4 * self.n_pairs)
        if self.n_pairs > self.vocab_size // 2 - 1:
            raise ValueError(f"`n_pairs` must be at most vocab_size // 2 - 1 = {self.vocab_size // 2 - 1} "
                             f"(distinct keys), got {self.n_pairs}")
        if not isinstance(self.power_a, (int, float)) or isinstance(self.power_a, bool) or not 0 < self.power_a <= 1:
            raise ValueError(f"`power_a` must be in (0, 1] (1: uniform query positions), got {self.power_a!r}")
        if self.distinct_values not in (0, 1):
            raise ValueError(f"`distinct_values` must be 0 or 1, got {self.distinct_values!r}")

    def example(self, rng):
        P, T, half = self.n_pairs, self.seq_len, self.vocab_size // 2
        keys = rng.choice(np.arange(1, half), size=P, replace=False)
        if self.distinct_values:
            values = rng.choice(np.arange(half, self.vocab_size), size=P, replace=False)
        else:
            values = rng.integers(half, self.vocab_size, size=P)
        inputs = np.zeros(T, dtype=np.int64)
        targets = np.zeros(T, dtype=np.int64)
        mask = np.zeros(T, dtype=bool)
        inputs[0:2 * P:2], inputs[1:2 * P:2] = keys, values
        space = (T - 2 * P) // 2
        if self.power_a == 1.0:
            slots = 2 * P + 2 * rng.choice(space, size=P, replace=False)
            order = rng.permutation(P)
        else:   # zoology's: pair i queried at gap i, the gaps drawn one after the other
            p = np.arange(1, space + 1, dtype=np.float64) ** (self.power_a - 1)
            slots, order = 2 * P + 2 * rng.choice(space, size=P, replace=False, p=p / p.sum()), np.arange(P)
        inputs[slots], targets[slots], mask[slots] = keys[order], values[order], True
        return inputs, targets, mask
