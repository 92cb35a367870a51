"""Formal-language tasks of Deletang et al. (2023) as the xLSTM paper's code generates them
(NX-AI/xlstm, ``experiments/data/formal_language/tasks/``), the setting Grazzi et al. (2024)
reuse for parity and modular arithmetic: a sequence of ``L`` tokens, ``L`` uniform in
``[min_len, max_len]``, whose last token is the answer; the model reads the first ``L - 1`` and
is scored once, at the last of them (xLSTM's masked answer after its shift by one). The rest
of the ``max_len - 1`` positions is padding (token 0), after the scored one, so a causal model
never reads it. Train on 3..40 and score on 40..256 to measure length generalisation.

- parity_check: ``L - 1`` bits (tokens 1, 2 for 0, 1); the answer is their parity (token
  1 + parity). Two classes.
- modular_arithmetic (Deletang's "modular arithmetic", without brackets): ``n op n op ... n =``
  with numbers ``0 .. modulus - 1`` (tokens ``5 + n``) and operators ``+ - *`` (tokens 1, 2, 3;
  ``*`` binds first), ``=`` (token 4); the answer is the value mod ``modulus`` (token
  ``5 + value``). ``L`` is odd. ``modulus`` classes.

``n_classes`` is the number of answers, for the chance-corrected ("scaled") accuracy these
papers report: ``(acc - 1 / n_classes) / (1 - 1 / n_classes)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fastweight.tasks.base import Task, check_int

PAD, PLUS, MINUS, TIMES, EQUALS, FIRST_NUMBER = 0, 1, 2, 3, 4, 5


class _VariableLength(Task):
    min_len: int
    max_len: int
    shortest: ClassVar[int] = 2

    def __post_init__(self):
        check_int("min_len", self.min_len, self.shortest)
        check_int("max_len", self.max_len, self.min_len)

    @property
    def seq_len(self) -> int:
        return self.max_len - 1

    def answer_at(self, tokens: np.ndarray, answer: int):
        """``tokens``: the ``L - 1`` inputs -> (inputs, targets, mask) padded to ``seq_len``."""
        inputs = np.full(self.seq_len, PAD, dtype=np.int64)
        inputs[:len(tokens)] = tokens
        targets = np.zeros(self.seq_len, dtype=np.int64)
        mask = np.zeros(self.seq_len, dtype=bool)
        targets[len(tokens) - 1], mask[len(tokens) - 1] = answer, True
        return inputs, targets, mask


@dataclass(frozen=True)
class ParityCheck(_VariableLength):
    name: ClassVar[str] = "parity_check"
    min_len: int = 3
    max_len: int = 40

    @property
    def vocab_size(self) -> int:
        return 3

    @property
    def n_classes(self) -> int:
        return 2

    def example(self, rng):
        bits = rng.integers(0, 2, size=int(rng.integers(self.min_len, self.max_len + 1)) - 1)
        return self.answer_at(1 + bits, 1 + int(bits.sum()) % 2)


@dataclass(frozen=True)
class ModularArithmetic(_VariableLength):
    name: ClassVar[str] = "modular_arithmetic"
    min_len: int = 3
    max_len: int = 40
    modulus: int = 5
    shortest: ClassVar[int] = 3

    def __post_init__(self):
        super().__post_init__()
        check_int("modulus", self.modulus, 2)

    @property
    def vocab_size(self) -> int:
        return FIRST_NUMBER + self.modulus

    @property
    def n_classes(self) -> int:
        return self.modulus

    def example(self, rng):
        # L odd in [min_len, max_len] (xLSTM's draw): L - 2 expression tokens, "=", the answer
        n_numbers = int(rng.integers((self.min_len + 1) // 2, (self.max_len + 1) // 2 + 1)) - 1
        numbers = rng.integers(0, self.modulus, size=n_numbers)
        ops = rng.integers(PLUS, TIMES + 1, size=n_numbers - 1)
        total, term, sign = 0, int(numbers[0]), 1
        for op, n in zip(ops, numbers[1:]):
            if op == TIMES:
                term *= int(n)
            else:
                total, term, sign = total + sign * term, int(n), 1 if op == PLUS else -1
        value = (total + sign * term) % self.modulus
        tokens = np.empty(2 * n_numbers, dtype=np.int64)
        tokens[0:-1:2], tokens[1:-1:2], tokens[-1] = FIRST_NUMBER + numbers, ops, EQUALS
        return self.answer_at(tokens, FIRST_NUMBER + value)
