"""State tracking: parity and S3 / S5 permutation composition (word problems of groups).

At every position the target is the running product of the inputs so far, and
every position is scored. Parity is the word problem of Z2 (solvable by a
diagonal recurrence with a negative eigenvalue); S5 is that of the symmetric group
on five elements, NC1-complete, which no diagonal-transition RNN and no
constant-depth transformer solves at arbitrary length (Merrill et al. 2024;
Grazzi et al. 2024). RWKV-7's paper claims one layer of it suffices for S5.

S_n elements are the n! permutations of ``(0, ..., n - 1)`` in lexicographic order
(``itertools.permutations``); the running product is ``p_t = g_t o p_{t-1}``
(apply ``p_{t-1}`` first, then ``g_t``; ``(f o g)(i) = f(g(i))``), ``p_0`` the identity.
``max_moved`` restricts the inputs to the permutations that move at most that many elements
(Grazzi et al. 2024, Sec. 5.2: 2 gives the identity and the swaps, which a single
reflection per token can apply; 3 adds the 3-cycles); the running products still cover the
group, since swaps generate it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from fastweight.tasks.base import Task, check_int, optional_field


@lru_cache(maxsize=None)
def permutations(n: int) -> tuple[tuple[int, ...], ...]:
    return tuple(itertools.permutations(range(n)))


@lru_cache(maxsize=None)
def composition_table(n: int) -> np.ndarray:
    """``table[f, g]`` = index of ``f o g`` in :func:`permutations`: [n!, n!] int64."""
    elements = permutations(n)
    index = {p: i for i, p in enumerate(elements)}
    return np.array([[index[tuple(f[g[i]] for i in range(n))] for g in elements] for f in elements])


@lru_cache(maxsize=None)
def moving_at_most(n: int, k: int) -> np.ndarray:
    """Indices of the permutations of n that move at most k elements."""
    return np.array([i for i, p in enumerate(permutations(n)) if sum(p[j] != j for j in range(n)) <= k])


def s5_elements() -> tuple[tuple[int, ...], ...]:
    return permutations(5)


def s5_table() -> np.ndarray:
    """``table[f, g]`` = index of ``f o g``: [120, 120] int64."""
    return composition_table(5)


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


class _SymmetricGroup(Task):
    """Inputs are S_n elements (ids 0 .. n! - 1); the target at t is ``g_t o ... o g_1``."""

    degree: ClassVar[int] = 0
    seq_len: int
    max_moved: int

    def __post_init__(self):
        check_int("seq_len", self.seq_len, 1)
        check_int("max_moved", self.max_moved, 2)
        if self.max_moved > self.degree:
            raise ValueError(f"`max_moved` must be at most {self.degree}, got {self.max_moved}")

    @property
    def vocab_size(self) -> int:
        return len(permutations(self.degree))

    @property
    def n_classes(self) -> int:
        return self.vocab_size

    def example(self, rng):
        table = composition_table(self.degree)
        if self.max_moved == self.degree:
            g = rng.integers(0, self.vocab_size, size=self.seq_len)
        else:
            allowed = moving_at_most(self.degree, self.max_moved)
            g = allowed[rng.integers(0, len(allowed), size=self.seq_len)]
        products = np.empty(self.seq_len, dtype=np.int64)
        p = 0
        for t in range(self.seq_len):
            p = table[g[t], p]
            products[t] = p
        return g, products, np.ones(self.seq_len, dtype=bool)


@dataclass(frozen=True)
class S5(_SymmetricGroup):
    name: ClassVar[str] = "s5"
    degree: ClassVar[int] = 5
    seq_len: int = 64
    max_moved: int = optional_field(5)


@dataclass(frozen=True)
class S3(_SymmetricGroup):
    """S3: the smallest non-abelian group (6 elements), solvable."""

    name: ClassVar[str] = "s3"
    degree: ClassVar[int] = 3
    seq_len: int = 64
    max_moved: int = optional_field(3)
