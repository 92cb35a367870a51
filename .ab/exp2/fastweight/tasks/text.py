"""A tiny word-level tokenizer and the essay-like text the needle tasks hide things in.

Text is lowercased and split into words (``[a-z]+``), single digits and single
punctuation marks, so a number or a UUID is one token per character. The
vocabulary is fixed: special tokens, the digits, the hex letters, punctuation,
then every word of the shipped essay (``data/essay.txt``, written for this project
and public domain) and of the needle templates, sorted. One vocabulary serves all
three S-NIAH tasks at every length, so one model can be trained on a mix of them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

SPECIALS = ("<pad>", "<unk>")
DIGITS = tuple("0123456789")
HEX_LETTERS = tuple("abcdef")
PUNCTUATION = tuple(".,;:?!'-")
_TOKEN = re.compile(r"[a-z]+|[0-9]|[^\sa-z0-9]")


def split(text: str) -> list[str]:
    """Lowercase and cut into word, digit and punctuation tokens."""
    return _TOKEN.findall(text.lower())


@lru_cache(maxsize=None)
def essay_text() -> str:
    return resources.files("fastweight.tasks").joinpath("data/essay.txt").read_text(encoding="utf-8")


class WordTokenizer:
    """Maps the tokens of :func:`split` to ids; unknown tokens map to ``<unk>``."""

    def __init__(self, words):
        vocab = list(SPECIALS) + list(DIGITS) + list(HEX_LETTERS) + list(PUNCTUATION)
        seen = set(vocab)
        for w in sorted(set(words)):
            if w not in seen:
                vocab.append(w)
                seen.add(w)
        self.vocab = tuple(vocab)
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.unk_id = self.ids["<unk>"]
        self.pad_id = self.ids["<pad>"]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.ids.get(w, self.unk_id) for w in split(text)]

    def decode(self, ids) -> str:
        return " ".join(self.vocab[int(i)] for i in ids)


@lru_cache(maxsize=None)
def tokenizer() -> WordTokenizer:
    """The shared tokenizer: the essay's words plus the needle templates' words."""
    from fastweight.tasks.niah import TEMPLATE_TEXT
    return WordTokenizer(split(essay_text()) + split(TEMPLATE_TEXT))


@lru_cache(maxsize=None)
def essay_ids() -> tuple[int, ...]:
    """The essay as token ids (titles and the dedication included)."""
    return tuple(tokenizer().encode(essay_text()))
