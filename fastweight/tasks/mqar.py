"""Multi-query associative recall (MQAR; Arora et al. 2023, the zoology suite).

A sequence opens with ``n_pairs`` key-value pairs ``k_1 v_1 k_2 v_2 ...`` (keys
distinct, drawn from ``[1, vocab_size // 2)``, values from ``[vocab_size // 2,
vocab_size)``); the rest holds every key once more, in a random order, at random
even offsets, with token 0 everywhere else. At the position of each queried key the
target is its value (scored there only). Layout for ``n_pairs = 2``, ``seq_len = 10``:

    input:  k1 v1 k2 v2 | 0  0  k2 0  k1 0
    target:  .  .  .  . | .  .  v2 .  v1 .
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fastweight.tasks.base import Task, check_int


@dataclass(frozen=True)
class MQAR(Task):
    name: ClassVar[str] = "mqar"
    seq_len: int = 64
    n_pairs: int = 8
    vocab_size: int = 128

    def __post_init__(self):
        check_int("n_pairs", self.n_pairs, 1)
        check_int("vocab_size", self.vocab_size, 4)
        check_int("seq_len", self.seq_len, 4 * self.n_pairs)
        if self.n_pairs > self.vocab_size // 2 - 1:
            raise ValueError(f"`n_pairs` must be at most vocab_size // 2 - 1 = {self.vocab_size // 2 - 1} "
                             f"(distinct keys), got {self.n_pairs}")

    def example(self, rng):
        P, T, half = self.n_pairs, self.seq_len, self.vocab_size // 2
        keys = rng.choice(np.arange(1, half), size=P, replace=False)
        values = rng.integers(half, self.vocab_size, size=P)
        inputs = np.zeros(T, dtype=np.int64)
        targets = np.zeros(T, dtype=np.int64)
        mask = np.zeros(T, dtype=bool)
        inputs[0:2 * P:2], inputs[1:2 * P:2] = keys, values
        slots = 2 * P + 2 * rng.choice((T - 2 * P) // 2, size=P, replace=False)
        order = rng.permutation(P)
        inputs[slots], targets[slots], mask[slots] = keys[order], values[order], True
        return inputs, targets, mask
