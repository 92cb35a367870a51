"""Single needle in a haystack (S-NIAH-1/2/3, the RULER tasks of Gated DeltaNet's Table 2).

One sequence is ``haystack[:i] + needle + haystack[i:] + query + answer``, cut to
exactly ``context_len + 1`` tokens; the model reads the first ``context_len`` and
is scored on the answer tokens only (next-token targets, teacher forced, so an
example is right when every answer token is the argmax: greedy decoding's answer).
The needle goes in at a sentence boundary at a uniformly random depth.

- S-NIAH-1: a pass key (``value_len`` digits) in a repeated filler sentence set:
  retention only, nothing to filter.
- S-NIAH-2: a number (``value_len`` digits) under a key word, in essay text.
- S-NIAH-3: a UUID (``value_len`` hex characters, dashed like a UUID) under a key
  word, in essay text: the value is a long, complex pattern to memorise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import numpy as np

from fastweight.tasks.base import Task, check_int
from fastweight.tasks.text import essay_ids, tokenizer

FILLER = "the hills are quiet . the road runs on . the clouds drift by . we walk on and then we rest ."
KEYS = ("lantern", "harbor", "violet", "compass", "meadow", "copper", "falcon", "orchard",
        "pebble", "thistle", "anchor", "ember", "quill", "saffron", "glacier", "walnut")
PASS_KEY_NEEDLE = "the pass key is {value} . remember it . {value} is the pass key ."
PASS_KEY_QUERY = "what is the pass key ? the pass key is"
NUMBER_NEEDLE = "the special number for {key} is {value} ."
NUMBER_QUERY = "what is the special number for {key} ? the special number for {key} is"
CODE_NEEDLE = "the special code for {key} is {value} ."
CODE_QUERY = "what is the special code for {key} ? the special code for {key} is"
TEMPLATE_TEXT = " ".join((FILLER, PASS_KEY_NEEDLE, PASS_KEY_QUERY, NUMBER_NEEDLE, NUMBER_QUERY,
                          CODE_NEEDLE, CODE_QUERY, " ".join(KEYS))).replace("{value}", "").replace("{key}", "")
UUID_DASHES = (8, 12, 16, 20)


def digits(rng: np.random.Generator, n: int) -> str:
    return " ".join(str(d) for d in rng.integers(0, 10, size=n))


def uuid_like(rng: np.random.Generator, n: int) -> str:
    """``n`` hex characters, with dashes where a UUID has them (8-4-4-4-12 for n = 32)."""
    chars = []
    for i, c in enumerate(rng.integers(0, 16, size=n)):
        if i in UUID_DASHES:
            chars.append("-")
        chars.append("0123456789abcdef"[c])
    return " ".join(chars)


@lru_cache(maxsize=None)
def period_id() -> int:
    return tokenizer().ids["."]


def sentence_starts(ids) -> list[int]:
    """Positions where a sentence starts in ``ids``: 0 and every position after a period."""
    return [0] + [i + 1 for i, t in enumerate(ids[:-1]) if t == period_id()]


@lru_cache(maxsize=None)
def haystack_arrays(source: tuple) -> tuple:
    """``source`` as an int64 array and its sentence starts (where a cyclic haystack run begins)."""
    return np.array(source, dtype=np.int64), np.array(sentence_starts(source), dtype=np.int64)


class NeedleTask(Task):
    """Shared by the three S-NIAH tasks; subclasses define ``parts(rng)`` and ``haystack_ids()``."""

    metric: ClassVar[str] = "sequence"
    context_len: int
    value_len: int

    def __post_init__(self):
        check_int("context_len", self.context_len, 1)
        check_int("value_len", self.value_len, 1)
        fixed = sum(len(p) for p in self.parts(np.random.default_rng(0)))
        if self.context_len + 1 - fixed < 0:
            raise ValueError(f"`context_len` must be at least {fixed - 1} for {self.name} with "
                             f"value_len={self.value_len}, got {self.context_len}")

    @property
    def vocab_size(self) -> int:
        return len(tokenizer())

    @property
    def seq_len(self) -> int:
        return self.context_len

    def parts(self, rng):
        """(needle ids, query ids, answer ids)."""
        raise NotImplementedError

    def haystack_ids(self) -> tuple:
        raise NotImplementedError

    def example(self, rng):
        needle, query, answer = self.parts(rng)
        n_hay = self.context_len + 1 - len(needle) - len(query) - len(answer)
        source, starts = haystack_arrays(self.haystack_ids())
        hay = source[(int(rng.choice(starts)) + np.arange(n_hay)) % len(source)]
        cut = int(rng.choice(np.concatenate(([0], np.flatnonzero(hay[:-1] == period_id()) + 1, [n_hay])))) \
            if n_hay else 0
        seq = np.concatenate((hay[:cut], needle, hay[cut:], query, answer)).astype(np.int64)
        mask = np.zeros(len(seq), dtype=bool)
        mask[len(seq) - len(answer):] = True
        return seq[:-1], seq[1:], mask[1:]


def _encode(text: str) -> list[int]:
    return tokenizer().encode(text)


@dataclass(frozen=True)
class SNiah1(NeedleTask):
    """Pass key in repeated filler."""

    name: ClassVar[str] = "s_niah_1"
    context_len: int = 256
    value_len: int = 5

    def parts(self, rng):
        value = digits(rng, self.value_len)
        return _encode(PASS_KEY_NEEDLE.format(value=value)), _encode(PASS_KEY_QUERY), _encode(value)

    def haystack_ids(self):
        return tuple(_encode(FILLER))


@dataclass(frozen=True)
class SNiah2(NeedleTask):
    """A number under a key word, in essay text."""

    name: ClassVar[str] = "s_niah_2"
    context_len: int = 256
    value_len: int = 7

    def parts(self, rng):
        key, value = KEYS[int(rng.integers(len(KEYS)))], digits(rng, self.value_len)
        return (_encode(NUMBER_NEEDLE.format(key=key, value=value)),
                _encode(NUMBER_QUERY.format(key=key)), _encode(value))

    def haystack_ids(self):
        return essay_ids()


@dataclass(frozen=True)
class SNiah3(NeedleTask):
    """A UUID under a key word, in essay text."""

    name: ClassVar[str] = "s_niah_3"
    context_len: int = 256
    value_len: int = 32

    def parts(self, rng):
        key, value = KEYS[int(rng.integers(len(KEYS)))], uuid_like(rng, self.value_len)
        return (_encode(CODE_NEEDLE.format(key=key, value=value)),
                _encode(CODE_QUERY.format(key=key)), _encode(value))

    def haystack_ids(self):
        return essay_ids()

