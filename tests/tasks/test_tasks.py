import itertools

import numpy as np
import pytest
import torch

from fastweight.tasks import (MQAR, S3, S5, TASKS, ModularArithmetic, Parity, ParityCheck, SNiah1, SNiah2, SNiah3,
                              from_spec, tokenizer)
from fastweight.tasks.niah import KEYS
from fastweight.tasks.state_tracking import permutations, s5_elements

SMALL = ["s_niah_1:context_len=63", "s_niah_2:context_len=100", "s_niah_3:context_len=127",
         "mqar:seq_len=63,n_pairs=5,vocab_size=64", "parity:seq_len=63", "s5:seq_len=100",
         "mqar:seq_len=100,n_pairs=12,vocab_size=256,power_a=0.01,distinct_values=1", "s3:seq_len=63",
         "s5:seq_len=31,max_moved=2", "parity_check:min_len=3,max_len=40", "modular_arithmetic:min_len=3,max_len=41"]


@pytest.mark.parametrize("spec", SMALL)
def test_batches_are_deterministic_and_well_formed(spec):
    task = from_spec(spec)
    a, b = task.batch(4, seed=(3, 7)), task.batch(4, seed=(3, 7))
    c = task.batch(4, seed=(3, 8))
    for x, y in [(a.input_ids, b.input_ids), (a.targets, b.targets), (a.loss_mask, b.loss_mask)]:
        assert torch.equal(x, y)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.input_ids.shape == a.targets.shape == a.loss_mask.shape == (4, task.seq_len)
    assert a.input_ids.dtype == a.targets.dtype == torch.int64 and a.loss_mask.dtype == torch.bool
    assert int(a.input_ids.min()) >= 0 and int(a.input_ids.max()) < task.vocab_size
    assert int(a.targets.max()) < task.vocab_size
    assert bool(a.loss_mask.any(dim=1).all())
    # a slice of a global batch is drawn alone (what each data-parallel rank does)
    tail = task.batch(2, seed=(3, 7), start=2)
    assert torch.equal(tail.input_ids, a.input_ids[2:]) and torch.equal(tail.targets, a.targets[2:])
    assert from_spec(task.spec()) == task


@pytest.mark.parametrize("cls", [SNiah1, SNiah2, SNiah3])
def test_needle_answer_is_in_the_context(cls):
    tok = tokenizer()
    task = cls(context_len=150)
    batch = task.batch(8, seed=11)
    for inputs, targets, mask in zip(batch.input_ids, batch.targets, batch.loss_mask):
        answer = targets[mask].tolist()
        assert len(answer) == task.value_len + (4 if cls is SNiah3 and task.value_len == 32 else 0)
        assert mask[-len(answer):].all() and not mask[:-len(answer)].any()
        context = inputs[: len(inputs) - len(answer) + 1].tolist()
        hits = [i for i in range(len(context) - len(answer) + 1) if context[i:i + len(answer)] == answer]
        assert hits, tok.decode(inputs)
        text = tok.decode(context)
        assert tok.unk_id not in context
        if cls is SNiah1:
            assert "pass key is " + tok.decode(answer) in text
        else:
            key = next(k for k in KEYS if f"special {'number' if cls is SNiah2 else 'code'} for {k} is" in text)
            assert f"for {key} ? the special" in text
            assert f"for {key} is {tok.decode(answer)} ." in text


@pytest.mark.parametrize("cls, shortest", [(SNiah1, 37), (SNiah2, 34), (SNiah3, 92)])
def test_shortest_context_has_no_haystack(cls, shortest):
    batch = cls(context_len=shortest).batch(2, seed=0)
    assert batch.input_ids.shape == (2, shortest)
    with pytest.raises(ValueError, match=f"at least {shortest}"):
        cls(context_len=shortest - 1)


def test_uuid_layout_and_needle_depth_varies():
    tok = tokenizer()
    batch = SNiah3(context_len=200).batch(16, seed=0)
    answers = [tok.decode(t[m]).replace(" ", "") for t, m in zip(batch.targets, batch.loss_mask)]
    for a in answers:
        assert [len(g) for g in a.split("-")] == [8, 4, 4, 4, 12]
        assert set(a) <= set("0123456789abcdef-")
    depths = {int(np.argmax((ids == tok.ids["code"]).numpy())) for ids in batch.input_ids}
    assert len(depths) > 4


def test_mqar_answers_from_the_pairs():
    task = MQAR(seq_len=100, n_pairs=12, vocab_size=64)
    batch = task.batch(8, seed=5)
    for inputs, targets, mask in zip(batch.input_ids, batch.targets, batch.loss_mask):
        pairs = dict(zip(inputs[0:24:2].tolist(), inputs[1:24:2].tolist()))
        assert len(pairs) == 12 and all(1 <= k < 32 for k in pairs) and all(32 <= v < 64 for v in pairs.values())
        queried = inputs[mask].tolist()
        assert sorted(queried) == sorted(pairs)
        assert targets[mask].tolist() == [pairs[k] for k in queried]
        assert (inputs[24:][~mask[24:]] == 0).all()


def test_parity_and_s5_running_products():
    batch = Parity(seq_len=63).batch(4, seed=1)
    for bits, target in zip(batch.input_ids.tolist(), batch.targets.tolist()):
        assert target == [sum(bits[:t + 1]) % 2 for t in range(63)]
    elements = list(itertools.permutations(range(5)))
    assert s5_elements() == tuple(elements)
    batch = S5(seq_len=100).batch(4, seed=2)
    for gs, target in zip(batch.input_ids.tolist(), batch.targets.tolist()):
        p = tuple(range(5))
        for g, want in zip(gs, target):
            p = tuple(elements[g][p[i]] for i in range(5))  # apply p first, then g
            assert elements[want] == p
    assert batch.input_ids.unique().numel() > 60


def test_zoology_mqar_generator():
    """zoology's layout (power_a < 1, distinct values): pair i queried at the i-th drawn gap, the gaps
    skewed towards the start of the query region; the default spec reads as it always did."""
    zoo = MQAR(seq_len=256, n_pairs=16, vocab_size=8192, power_a=0.01, distinct_values=1)
    uniform = MQAR(seq_len=256, n_pairs=16, vocab_size=8192)
    assert uniform.spec() == "mqar:seq_len=256,n_pairs=16,vocab_size=8192" and from_spec(zoo.spec()) == zoo
    batch = zoo.batch(32, seed=4)
    for inputs, targets, mask in zip(batch.input_ids, batch.targets, batch.loss_mask):
        keys, values = inputs[0:32:2].tolist(), inputs[1:32:2].tolist()
        assert len(set(values)) == 16 and all(4096 <= v < 8192 for v in values)
        pairs = dict(zip(keys, values))
        assert targets[mask].tolist() == [pairs[k] for k in inputs[mask].tolist()]
    gap = lambda task: float(task.batch(64, seed=1).loss_mask.nonzero()[:, 1].float().mean()) - 32  # noqa: E731
    assert gap(zoo) < 0.6 * gap(uniform)   # measured: 54 against 112


def test_formal_language_answers():
    """parity_check / modular_arithmetic: one scored position, the last input (L - 1 of them), its
    target the parity / the value mod 5 (``*`` first); lengths cover [min_len, max_len]."""
    lengths = set()
    batch = ParityCheck(min_len=3, max_len=12).batch(64, seed=0)
    for inputs, targets, mask in zip(batch.input_ids.tolist(), batch.targets, batch.loss_mask):
        (at,) = mask.nonzero()[:, 0].tolist()
        bits = [b - 1 for b in inputs[:at + 1]]
        assert set(bits) <= {0, 1} and all(x == 0 for x in inputs[at + 1:])
        assert int(targets[at]) == 1 + sum(bits) % 2
        lengths.add(at + 2)
    assert lengths == set(range(3, 13))
    task = ModularArithmetic(min_len=3, max_len=15)
    names = {1: "+", 2: "-", 3: "*"}
    lengths = set()
    for inputs, targets, mask in zip(task.batch(64, seed=1).input_ids.tolist(), task.batch(64, seed=1).targets,
                                     task.batch(64, seed=1).loss_mask):
        (at,) = mask.nonzero()[:, 0].tolist()
        assert inputs[at] == 4 and all(x == 0 for x in inputs[at + 1:])
        text = "".join(str(t - 5) if i % 2 == 0 else names[t] for i, t in enumerate(inputs[:at]))
        assert int(targets[at]) == 5 + eval(text) % 5  # noqa: S307  (digits and + - * only)
        lengths.add(at + 2)
    assert lengths == {3, 5, 7, 9, 11, 13, 15} and task.n_classes == 5 and task.vocab_size == 10


def test_symmetric_groups_and_swaps_only():
    elements = permutations(3)
    batch = S3(seq_len=20).batch(4, seed=3)
    for gs, target in zip(batch.input_ids.tolist(), batch.targets.tolist()):
        p = (0, 1, 2)
        for g, want in zip(gs, target):
            p = tuple(elements[g][p[i]] for i in range(3))
            assert elements[want] == p
    swaps = S5(seq_len=200, max_moved=2).batch(8, seed=0)
    moved = {sum(s5_elements()[g][i] != i for i in range(5)) for g in swaps.input_ids.flatten().tolist()}
    assert moved == {0, 2} and swaps.targets.unique().numel() > 60   # swaps generate S5


@pytest.mark.parametrize("spec, arg", [
    ("s_niah_3:context_len=20", "context_len"), ("mqar:seq_len=10,n_pairs=8", "seq_len"),
    ("mqar:n_pairs=70,seq_len=400,vocab_size=128", "n_pairs"), ("parity:seq_len=0", "seq_len"),
    ("s5:length=3", "length"), ("nope", "nope"), ("mqar:seq_len=x", "seq_len"),
    ("mqar:power_a=0", "power_a"), ("mqar:distinct_values=2", "distinct_values"), ("s5:max_moved=6", "max_moved"),
    ("s3:max_moved=1", "max_moved"), ("parity_check:min_len=1", "min_len"), ("parity_check:max_len=2", "max_len"),
    ("modular_arithmetic:min_len=2", "min_len"), ("modular_arithmetic:modulus=1", "modulus"),
])
def test_bad_specs_name_the_argument(spec, arg):
    with pytest.raises(ValueError, match=arg):
        from_spec(spec)


def test_registry_and_bad_batch_arguments():
    assert set(TASKS) == {"s_niah_1", "s_niah_2", "s_niah_3", "mqar", "parity", "s5", "s3", "parity_check",
                          "modular_arithmetic"}
    with pytest.raises(ValueError, match="batch_size"):
        Parity().batch(0)
    with pytest.raises(ValueError, match="seed"):
        Parity().batch(2, seed=-1)
