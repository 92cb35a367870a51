"""RULER-style S-NIAH prompts and scoring (fastweight/tasks/ruler.py), with tiny local tokenizers and models."""

import re
from functools import lru_cache

import pytest
import torch

from fastweight.tasks import ruler
from fastweight.tasks.text import tokenizer as word_tokenizer


@lru_cache(maxsize=None)
def bpe_tokenizer():
    """A byte-level BPE tokenizer (1000 tokens) trained here on the haystacks: token counts are not
    additive over words, as with a real model's tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(ruler.haystack_words("essay")[0]), ruler.NOISE], vocab_size=1000,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")


TOKENIZERS = {"word": lambda: ruler.TaskTokenizer(word_tokenizer()), "bpe": lambda: ruler.HFTokenizer(bpe_tokenizer())}


def haystack_of(example):
    """The haystack words of a prompt (between the preamble and the question) and the needle's index."""
    body = example.prompt.split("\n\n")[1]
    before, after = body.split(example.needle)
    return before.split() + after.split(), len(before.split())


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("task", [1, 2, 3])
@pytest.mark.parametrize("length", [300, 777, 2048])
def test_prompt_fills_the_length_in_the_models_tokens(name, task, length):
    tok = TOKENIZERS[name]()
    ex = ruler.make_example(task, length, 1, tok, seed=4)
    assert ex.prompt_ids == tuple(tok.encode(ex.prompt))
    assert ex.max_new_tokens == len(tok.encode_continuation(" " + ex.value)) + 8
    total = len(ex.prompt_ids) + ex.max_new_tokens
    # at most the length (RULER's budget: prompt + generation); short of it by less than one more word
    assert length - (2 if name == "word" else 6) <= total <= length, (total, length)


@pytest.mark.parametrize("task", [1, 2, 3])
def test_needle_is_there_once_at_the_requested_depth(task):
    tok = TOKENIZERS["bpe"]()
    longest = max(len(s.split()) for s in re.split(r"(?<=[.!?])\s", " ".join(ruler.haystack_words("essay")[0])))
    for index, depth in enumerate([0.0, 0.25, 0.5, 0.75, 1.0]):
        ex = ruler.make_example(task, 1500, index, tok, seed=2, depths=5)
        assert ex.depth == depth
        assert ex.prompt.count(ex.value) == 1 and ex.prompt.count(ex.needle) == 1
        assert ex.prompt.count(ex.key) == 3  # the needle, the question, the answer prefix
        words, at = haystack_of(ex)
        assert ex.needle_depth == pytest.approx(at / len(words))
        assert abs(at - depth * len(words)) <= longest / 2 + 1
        assert at in (0, len(words)) or words[at - 1][-1] in ".!?"  # at a sentence boundary
        assert set(words) <= set(ruler.haystack_words("noise" if task == 1 else "essay")[0])


def test_examples_are_deterministic_per_seed_and_index():
    tok = TOKENIZERS["bpe"]()
    a, b = (ruler.make_example(3, 600, 7, tok, seed=1) for _ in range(2))
    assert a == b
    assert ruler.make_example(3, 600, 7, tok, seed=2).value != a.value
    assert ruler.make_example(3, 600, 8, tok, seed=1).value != a.value
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", a.value)
    assert re.fullmatch(r"[1-9][0-9]{6}", ruler.make_example(2, 600, 7, tok, seed=1).value)


@pytest.mark.parametrize("value, output, right", [
    ("4182937", " 4182937.", True), ("4182937", "4 1 8 2 9 3 7 .", True), ("4182937", "The number is 4182937", True),
    ("4182937", " 418293", False), ("4182937", " 4182936.", False), ("4182937", "", False),
    ("0a1b2c3d-aaaa-bbbb-cccc-0123456789ab", "0A1B2C3D-AAAA-BBBB-CCCC-0123456789AB", True),
    ("0a1b2c3d-aaaa-bbbb-cccc-0123456789ab", "0a1b2c3d-aaaa-bbbb-cccc-0123456789a", False)])
def test_string_match_on_hand_made_outputs(value, output, right):
    assert ruler.matches(value, output) is right


class ReadingStub:
    """A "model" that finds the needle in its prompt and answers with its value: right on every
    example, if the harness puts the needle in the prompt and scores what comes back. With
    ``horizon`` it reads only the first fraction of the prompt (an answer beyond it: a wrong number)."""

    def __init__(self, tok, horizon=1.0):
        self.tok, self.horizon = tok, horizon

    def generate(self, input_ids, max_new_tokens):
        ids = input_ids[0].tolist()
        text = self.tok.decode(ids[: int(self.horizon * len(ids))])
        found = re.search(r"the special [\w ]+ for [\w-]+ is ([0-9a-f-]+)\.", text)
        answer = self.tok.encode_continuation(" " + (found.group(1) if found else "1000000") + ".")
        return torch.tensor([ids + answer[:max_new_tokens]])


def test_a_model_that_reads_the_needle_scores_100_and_one_that_cannot_scores_0():
    tok = TOKENIZERS["bpe"]()
    result = ruler.score(ReadingStub(tok), tok, lengths=(300, 700), examples=3)
    assert result.scores() == {t: {300: 100.0, 700: 100.0} for t in (1, 2, 3)}
    assert all(r["output"].strip().rstrip(".") == r["value"] for r in result.records)
    blind = ruler.score(ReadingStub(tok, horizon=0.0), tok, tasks=(2,), lengths=(300,), examples=5)
    assert blind.scores() == {2: {300: 0.0}}


def test_scores_per_depth_follow_where_the_model_can_read():
    tok = TOKENIZERS["bpe"]()
    result = ruler.score(ReadingStub(tok, horizon=0.6), tok, tasks=(1,), lengths=(1200,), examples=10, depths=5)
    assert result.by_depth() == {1: {1200: {0.0: 100.0, 0.25: 100.0, 0.5: 100.0, 0.75: 0.0, 1.0: 0.0}}}
    assert result.scores() == {1: {1200: 60.0}}
    assert result.depth_table().splitlines()[2:] == ["| 0% | 100.0 |", "| 25% | 100.0 |", "| 50% | 100.0 |",
                                                     "| 75% | 0.0 |", "| 100% | 0.0 |"]


def tiny_llama(vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=1024)).eval()


def tiny_fastweight(vocab_size):
    from fastweight.models import LanguageModel, LMConfig
    torch.manual_seed(0)
    return LanguageModel(LMConfig.preset("tiny", mixer="gdn", vocab_size=vocab_size, d_model=32, n_layers=2,
                                         n_heads=2)).eval()


@pytest.mark.parametrize("build, name, tasks, lengths", [(tiny_llama, "bpe", (1, 2, 3), (300, 400)),
                                                        (tiny_fastweight, "word", (1, 2), (160,))])
def test_a_tiny_random_model_scores_end_to_end(build, name, tasks, lengths):
    tok = TOKENIZERS[name]()
    model = build(1024)  # a vocabulary larger than the tokenizer's, as padded ones are: extra ids are dropped
    result = ruler.score(model, tok, tasks=tasks, lengths=lengths, examples=2, depths=2, extra_tokens=1)
    assert len(result.records) == len(tasks) * len(lengths) * 2
    for row in result.scores().values():
        assert set(row) == set(lengths) and all(0.0 <= s <= 100.0 for s in row.values())
    for r in result.records:
        assert r["prompt_tokens"] + r["max_new_tokens"] <= r["length"]
        assert isinstance(r["output"], str) and r["correct"] == ruler.matches(r["value"], r["output"])
    # greedy and seeded: the same prompts and outputs again (here the last task at the first length)
    again = ruler.score(model, tok, tasks=tasks[-1:], lengths=lengths[:1], examples=2, depths=2, extra_tokens=1)
    assert again.records == [r for r in result.records if r["task"] == tasks[-1] and r["length"] == lengths[0]]
    lines = result.table("tiny").splitlines()
    assert len(lines) == 3 + len(ruler.PAPER_TABLE2)
    assert all(line.count("|") == len(tasks) * len(lengths) + 2 for line in lines)
    assert lines[0].startswith(f"| model | S-NIAH-1 {lengths[0]} |")
    assert lines[3] == "| DeltaNet 1.3B (Table 2) |" + " - |" * (len(tasks) * len(lengths))  # no paper column here
    data = result.to_dict()
    assert set(data["scores"]) == set(map(str, tasks)) and data["paper_table2"]["Mamba2 1.3B"]["1"]["4096"] == 65.4


def test_the_table_prints_the_papers_row_at_its_lengths():
    result = ruler.NiahResult((1, 3), (1024, 8192), 1, 0, 1, [
        dict(task=t, length=n, depth=0.5, correct=(t == 1)) for t in (1, 3) for n in (1024, 8192)])
    lines = result.table("m").splitlines()
    assert lines[2] == "| m | 100.0 | 100.0 | 0.0 | 0.0 |"
    assert lines[5] == "| Gated DeltaNet 1.3B (Table 2) | 98.4 | 91.8 | 86.6 | - |"  # S-NIAH-3 has no 8K


@pytest.mark.parametrize("kwargs, message", [
    (dict(tasks=(4,)), "`tasks`"), (dict(tasks=()), "`tasks`"), (dict(lengths=(0,)), "`lengths`"),
    (dict(lengths=()), "`lengths`"), (dict(examples=0), "`examples`"), (dict(depths=0), "`depths`"),
    (dict(extra_tokens=-1), "`extra_tokens`"), (dict(seed=-1), "`seed`"),
    (dict(lengths=(40,)), "`length` 40 is too short for S-NIAH-1")])
def test_bad_arguments_name_the_argument(kwargs, message):
    tok = TOKENIZERS["bpe"]()
    with pytest.raises(ValueError, match=message):
        ruler.score(ReadingStub(tok), tok, **{"examples": 1, **kwargs})


def test_make_example_names_a_bad_task():
    with pytest.raises(ValueError, match="`task` must be one of"):
        ruler.make_example(4, 1000, 0, TOKENIZERS["word"]())


def test_a_tokenizer_of_unknown_kind_is_refused():
    with pytest.raises(TypeError, match="`tokenizer`"):
        ruler.score(ReadingStub(None), object(), examples=1)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_ids_past_the_tokenizers_vocabulary_are_dropped_from_the_output(name):
    tok = TOKENIZERS[name]()
    ids = tok.encode_continuation(" 4182937.")
    mixed = [tok.vocab_size + 5, *ids[:3], tok.vocab_size, *ids[3:], 10 * tok.vocab_size]
    assert tok.decode(mixed) == tok.decode(ids) and ruler.matches("4182937", tok.decode(mixed))
