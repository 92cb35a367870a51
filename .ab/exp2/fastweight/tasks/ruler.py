"""RULER's single-needle tasks (S-NIAH-1/2/3) as text prompts for any causal LM, scored zero-shot.

RULER (Hsieh et al. 2024, arXiv:2404.06654) hides one key-value pair (the needle) in a haystack
and asks for the value; Gated DeltaNet's Table 2 (arXiv:2412.06464) scores 1.3B models on three
variants at 1K-8K tokens (:data:`PAPER_TABLE2`). Here, as there, every key is a word:

- S-NIAH-1: a 7-digit pass key in a repeated filler ("The grass is green. ..."): retention only.
- S-NIAH-2: a 7-digit number in essay text (``data/essay.txt``, cycled when a prompt needs more).
- S-NIAH-3: a UUID (8-4-4-4-12 hex) in essay text: a long value to memorise.

A prompt is a preamble, the haystack with the needle inserted at the sentence boundary nearest to
a relative depth, a question and an answer prefix. Its length is counted in the model's own
tokens, as RULER counts it: the prompt plus ``max_new_tokens`` (the value's tokens plus
``extra_tokens``) is at most ``length``, with as many haystack words as fit (bisection on the word
count). Example ``e`` of (task, length) draws its key, value and essay start from
``numpy.random.default_rng([seed, task, length, e])`` and takes depth ``depths[e % len(depths)]``
(evenly spaced on [0, 1]). Scoring is greedy decoding and RULER's string match: the example is
right when the value appears in the generated text (case and whitespace ignored, so that a
word-level tokenizer's "1 2 3" matches "123").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
import torch

from fastweight.tasks.text import WordTokenizer, essay_text, split

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJECTIVES = ("amber", "brave", "calm", "dusty", "eager", "frozen", "gentle", "hollow", "icy", "jolly",
              "kind", "lively", "misty", "narrow", "olive", "proud")
NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pebble")
PREAMBLE = ("Somewhere in the long text below there is a special {kind}. Read the text carefully and keep "
            "the {kind} in mind: you will be asked for it after the text.")
NEEDLE = "Note this well: the special {kind} for {key} is {value}."
QUESTION = "Question: what is the special {kind} for {key} in the text above?"
ANSWER = "Answer: the special {kind} for {key} is"


@dataclass(frozen=True)
class NeedleTask:
    """One S-NIAH variant: its haystack (``noise`` or ``essay``), value (``number`` or ``uuid``)
    and the words the template calls the value by."""

    number: int
    haystack: str
    value: str
    kind: str

    @property
    def name(self) -> str:
        return f"S-NIAH-{self.number}"


TASKS = {1: NeedleTask(1, "noise", "number", "pass key"), 2: NeedleTask(2, "essay", "number", "number"),
         3: NeedleTask(3, "essay", "uuid", "UUID")}

# Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, arXiv:2412.06464), Table 2: 1.3B models trained
# on 100B FineWeb-Edu tokens at 4K, S-NIAH zero-shot, accuracy in % at 1K/2K/4K/8K (S-NIAH-3: no 8K)
PAPER_LENGTHS = (1024, 2048, 4096, 8192)
PAPER_TABLE2 = {
    "DeltaNet 1.3B": {1: (97.4, 96.8, 99.0, 98.8), 2: (98.4, 45.6, 18.6, 14.4), 3: (85.2, 47.0, 22.4)},
    "Mamba2 1.3B": {1: (99.2, 98.8, 65.4, 30.4), 2: (99.4, 98.8, 56.2, 17.0), 3: (64.4, 47.6, 4.6)},
    "Gated DeltaNet 1.3B": {1: (98.4, 88.4, 91.4, 91.8), 2: (100.0, 99.8, 92.2, 29.6), 3: (86.6, 84.2, 27.6)},
}


class HFTokenizer:
    """A ``transformers`` tokenizer: the prompt with its special tokens (a BOS where it has one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_continuation(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        """The text of ``ids``; ids past the tokenizer's (a model's padded vocabulary) are dropped."""
        return self.tokenizer.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)


class TaskTokenizer:
    """Our word-level task tokenizer (``fastweight.tasks.text``); a word outside its vocabulary
    is spelled in single characters where it has them all (hex runs of a UUID), else ``<unk>``."""

    eos_token_id = None

    def __init__(self, tokenizer: WordTokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        ids, known = [], self.tokenizer.ids
        for word in split(text):
            if word in known:
                ids.append(known[word])
            elif all(c in known for c in word):
                ids.extend(known[c] for c in word)
            else:
                ids.append(self.tokenizer.unk_id)
        return ids

    encode_continuation = encode

    def decode(self, ids) -> str:
        """The text of ``ids``; ids past the vocabulary (a model's larger one) are dropped."""
        return self.tokenizer.decode([i for i in ids if i < self.vocab_size])


def as_tokenizer(tokenizer):
    """``tokenizer`` as one of the adapters above (a ``transformers`` tokenizer, our WordTokenizer)."""
    if isinstance(tokenizer, (HFTokenizer, TaskTokenizer)):
        return tokenizer
    if isinstance(tokenizer, WordTokenizer):
        return TaskTokenizer(tokenizer)
    if callable(tokenizer) and hasattr(tokenizer, "decode") and hasattr(tokenizer, "convert_tokens_to_ids"):
        return HFTokenizer(tokenizer)
    raise TypeError(f"`tokenizer` must be a transformers tokenizer or a fastweight WordTokenizer, got "
                    f"{type(tokenizer).__name__}")


@lru_cache(maxsize=None)
def haystack_words(haystack: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The haystack's words and the indices where a sentence starts (where a cyclic run may begin)."""
    words = tuple((NOISE if haystack == "noise" else essay_text()).split())
    starts = tuple(i for i in range(len(words)) if i == 0 or words[i - 1][-1] in ".!?")
    return words, starts


def draw_value(rng: np.random.Generator, kind: str) -> str:
    if kind == "number":
        return str(int(rng.integers(1_000_000, 10_000_000)))
    hexes = "".join("0123456789abcdef"[i] for i in rng.integers(0, 16, size=32))
    return "-".join((hexes[:8], hexes[8:12], hexes[12:16], hexes[16:20], hexes[20:]))


def depth_grid(depths: int) -> np.ndarray:
    return np.array([0.5]) if depths == 1 else np.linspace(0.0, 1.0, depths)


@dataclass(frozen=True)
class Example:
    """One prompt: ``depth`` as asked, ``needle_depth`` where the needle went (the fraction of
    haystack words before it), ``prompt_ids`` in the model's tokens."""

    task: int
    length: int
    index: int
    depth: float
    needle_depth: float
    key: str
    value: str
    needle: str
    prompt: str
    prompt_ids: tuple
    max_new_tokens: int


def make_example(task: int, length: int, index: int, tokenizer, *, seed: int = 0, depths: int = 5,
                 extra_tokens: int = 8) -> Example:
    """Example ``index`` of S-NIAH-``task`` at ``length`` tokens of ``tokenizer`` (see the module doc)."""
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {sorted(TASKS)}, got {task!r}")
    spec, tok = TASKS[task], as_tokenizer(tokenizer)
    rng = np.random.default_rng([seed, task, length, index])
    key = f"{ADJECTIVES[int(rng.integers(len(ADJECTIVES)))]}-{NOUNS[int(rng.integers(len(NOUNS)))]}"
    value = draw_value(rng, spec.value)
    words, starts = haystack_words(spec.haystack)
    start = starts[int(rng.integers(len(starts)))] if spec.haystack == "essay" else 0
    depth = float(depth_grid(depths)[index % depths])
    needle = NEEDLE.format(kind=spec.kind, key=key, value=value)
    head = PREAMBLE.format(kind=spec.kind)
    tail = QUESTION.format(kind=spec.kind, key=key) + "\n" + ANSWER.format(kind=spec.kind, key=key)
    max_new_tokens = len(tok.encode_continuation(" " + value)) + extra_tokens
    budget = length - max_new_tokens

    def render(n: int) -> tuple[str, float]:
        hay = [words[(start + i) % len(words)] for i in range(n)]
        cuts = [p for p in range(n + 1) if p in (0, n) or hay[p - 1][-1] in ".!?"]
        cut = min(cuts, key=lambda p: (abs(p - depth * n), p))
        body = " ".join(hay[:cut] + [needle] + hay[cut:])
        return f"{head}\n\n{body}\n\n{tail}", cut / n if n else depth

    def count(n: int) -> int:
        return len(tok.encode(render(n)[0]))

    c_lo = count(0)
    if c_lo > budget:
        raise ValueError(f"`length` {length} is too short for {spec.name}: the template and needle take "
                         f"{c_lo} tokens and the answer {max_new_tokens} more")
    # the largest word count that fits: bracketed where tokens-per-word says (counts are nearly
    # linear in the words), then bisection; every word is at least one token, so budget + 1 cannot fit
    lo, hi, c_hi = 0, budget + 1, count(budget + 1)
    while c_hi <= budget:
        lo, hi, c_lo, c_hi = hi, 2 * hi, c_hi, count(2 * hi)
    guess = lo + (budget - c_lo) * (hi - lo) // max(c_hi - c_lo, 1)
    for probe in (guess - 8, guess + 8):
        if lo < probe < hi:
            lo, hi = (probe, hi) if count(probe) <= budget else (lo, probe)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    prompt, needle_depth = render(lo)
    return Example(task, length, index, depth, needle_depth, key, value, needle, prompt,
                   tuple(tok.encode(prompt)), max_new_tokens)


def normalise(text: str) -> str:
    return "".join(text.lower().split())


def matches(value: str, output: str) -> bool:
    """RULER's string match for one needle: ``value`` occurs in ``output`` (case and whitespace ignored)."""
    return normalise(value) in normalise(output)


@torch.no_grad()
def generate_greedy(model, prompt_ids, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """The tokens that ``model`` generates greedily after ``prompt_ids``: our LanguageModel, a
    ``transformers`` model (``generate`` with ``do_sample=False``), or any object whose
    ``generate(input_ids [1, T], max_new_tokens=n)`` returns ``[1, T + new]``."""
    from fastweight.models.lm import LanguageModel
    device = next(iter(model.parameters())).device if hasattr(model, "parameters") else "cpu"
    x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    if isinstance(model, LanguageModel):
        out = model.generate(x, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    elif hasattr(model, "generation_config"):
        config = model.generation_config
        pad = config.pad_token_id if config.pad_token_id is not None else eos_token_id
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             num_beams=1, eos_token_id=eos_token_id, pad_token_id=pad)
    else:
        out = model.generate(x, max_new_tokens=max_new_tokens)
    return [int(t) for t in out[0, x.shape[1]:].tolist()]


def _check_positive(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")


def score(model, tokenizer, *, tasks=(1, 2, 3), lengths=PAPER_LENGTHS, examples: int = 100, seed: int = 0,
          depths: int = 5, extra_tokens: int = 8, progress: bool = False) -> "NiahResult":
    """Score ``model`` zero-shot on S-NIAH-``tasks`` at ``lengths`` tokens, ``examples`` per
    (task, length), greedy decoding; see the module docstring."""
    if not tasks or any(t not in TASKS for t in tasks):
        raise ValueError(f"`tasks` must be a non-empty subset of {sorted(TASKS)}, got {tasks!r}")
    if not lengths:
        raise ValueError("`lengths` must name at least one length")
    for length in lengths:
        _check_positive("lengths", length)
    _check_positive("examples", examples)
    _check_positive("depths", depths)
    if not isinstance(extra_tokens, int) or extra_tokens < 0:
        raise ValueError(f"`extra_tokens` must be an int >= 0, got {extra_tokens!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"`seed` must be an int >= 0, got {seed!r}")
    tok = as_tokenizer(tokenizer)
    jobs = [(t, n, e) for t in tasks for n in lengths for e in range(examples)]
    if progress:
        from tqdm import tqdm
        jobs = tqdm(jobs, desc="S-NIAH", unit="example")
    records = []
    for task, length, index in jobs:
        ex = make_example(task, length, index, tok, seed=seed, depths=depths, extra_tokens=extra_tokens)
        output = tok.decode(generate_greedy(model, ex.prompt_ids, ex.max_new_tokens, tok.eos_token_id))
        records.append(dict(task=task, length=length, index=index, depth=ex.depth,
                            needle_depth=round(ex.needle_depth, 4), prompt_tokens=len(ex.prompt_ids),
                            max_new_tokens=ex.max_new_tokens, key=ex.key, value=ex.value, output=output,
                            correct=matches(ex.value, output)))
    return NiahResult(tuple(tasks), tuple(lengths), examples, seed, depths, records)


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _cell(x) -> str:
    return "-" if x is None else f"{x:.1f}"


@dataclass
class NiahResult:
    """Every example's record (task, length, depth, tokens, value, output, correct) and the tables."""

    tasks: tuple
    lengths: tuple
    examples: int
    seed: int
    depths: int
    records: list

    def scores(self) -> dict:
        """``{task: {length: accuracy in %}}``."""
        return {t: {n: 100.0 * float(np.mean([r["correct"] for r in self.records
                                              if r["task"] == t and r["length"] == n])) for n in self.lengths}
                for t in self.tasks}

    def by_depth(self) -> dict:
        """``{task: {length: {depth: accuracy in %}}}`` (depths with no example left out)."""
        out = {}
        for t in self.tasks:
            for n in self.lengths:
                rows = [r for r in self.records if r["task"] == t and r["length"] == n]
                out.setdefault(t, {})[n] = {float(d): 100.0 * float(np.mean([r["correct"] for r in rows
                                                                             if r["depth"] == d]))
                                            for d in depth_grid(self.depths) if any(r["depth"] == d for r in rows)}
        return out

    def table(self, name: str = "this model") -> str:
        """Markdown: accuracy per task and length, the paper's Table 2 rows beside ours."""
        cols = [(t, n) for t in self.tasks for n in self.lengths]
        head = "| model | " + " | ".join(f"S-NIAH-{t} {length_label(n)}" for t, n in cols) + " |"
        lines = [head, "|---" * (len(cols) + 1) + "|"]
        ours = self.scores()
        lines.append(f"| {name} | " + " | ".join(_cell(ours[t][n]) for t, n in cols) + " |")
        for model, row in PAPER_TABLE2.items():
            cells = [row[t][PAPER_LENGTHS.index(n)] if n in PAPER_LENGTHS and PAPER_LENGTHS.index(n) < len(row[t])
                     else None for t, n in cols]
            lines.append(f"| {model} (Table 2) | " + " | ".join(_cell(c) for c in cells) + " |")
        return "\n".join(lines)

    def depth_table(self) -> str:
        """Markdown: accuracy per needle depth (rows) and task and length (columns)."""
        cols = [(t, n) for t in self.tasks for n in self.lengths]
        deep = self.by_depth()
        lines = ["| depth | " + " | ".join(f"S-NIAH-{t} {length_label(n)}" for t, n in cols) + " |",
                 "|---" * (len(cols) + 1) + "|"]
        for d in depth_grid(self.depths):
            lines.append(f"| {100 * d:.0f}% | " + " | ".join(_cell(deep[t][n].get(float(d))) for t, n in cols) + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["scores"] = {str(t): {str(n): s for n, s in row.items()} for t, row in self.scores().items()}
        data["by_depth"] = {str(t): {str(n): {str(d): s for d, s in c.items()} for n, c in row.items()}
                            for t, row in self.by_depth().items()}
        data["paper_table2"] = {m: {str(t): dict(zip(map(str, PAPER_LENGTHS), v)) for t, v in row.items()}
                                for m, row in PAPER_TABLE2.items()}
        return data
