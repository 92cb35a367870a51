"""State tracking: parity and S5 permutation composition (word problems of groups).

At every position the target is the running product of the inputs so far, and
every position is scored. Parity is the word problem of Z2 (solvable by a
diagonal recurrence with a negative eigenvalue); S5 is that of the symmetric group
on five elements, NC1-complete, which no diagonal-transition RNN and no
constant-depth transformer solves at arbitrary length (Merrill et al. 2024;
Grazzi et al. 2024). RWKV-7's paper claims one layer of it suffices for S5.

S5 elements are the 120 permutations of ``(0, 1, 2, 3, 4)`` in lexicographic order
(``itertools.permutations``); the running product is ``p_t = g_t o p_{t-1}``
(apply ``p_{t-1}`` first, then ``g_t``; ``(f o g)(i) = f(g(i))``), ``p_0`` the identity.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from fastweight.tasks.base import Task, check_int


@lru_cache(maxsize=None)
def s5_elements() -> tuple[tuple[int, ...], ...]:
    return tuple(itertools.permutations(range(5)))


@lru_cache(maxsize=None)
def s5_table() -> np.ndarray:
    """``table[f, g]`` = index of ``f o g``: [120, 120] int64."""
    elements = s5_elements()
    index = {p: i for i, p in enumerate(elements)}
    return np.array([[index[tuple(f[g[i]] for i in range(5))] for g in elements] for f in elements])


@dataclass(frozen=True)
class Parity(Task):
    """Inputs are bits; the target at t is their XOR up to t."""

    name: ClassVar[str] = "parity"
    seq_len: int = 64

    def __post_init__(self):
        check_int("seq_len", self.seq_len, 1)

    @property
    def vocab_size(self) -> int:
        return 2

    def example(self, rng):
        bits = rng.integers(0, 2, size=self.seq_len)
        return bits, np.cumsum(bits) % 2, np.ones(self.seq_len, dtype=bool)


@dataclass(frozen=True)
class S5(Task):
    """Inputs are S5 elements (ids 0..119); the target at t is ``g_t o ... o g_1``."""

    name: ClassVar[str] = "s5"
    seq_len: int = 64

    def __post_init__(self):
        check_int("seq_len", self.seq_len, 1)

    @property
    def vocab_size(self) -> int:
        return 120

    def example(self, rng):
        table = s5_table()
        g = rng.integers(0, 120, size=self.seq_len)
        products = np.empty(self.seq_len, dtype=np.int64)
        p = 0
        for t in range(self.seq_len):
            p = table[g[t], p]
            products[t] = p
        return g, products, np.ones(self.seq_len, dtype=bool)
