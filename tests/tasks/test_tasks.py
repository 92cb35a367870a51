import itertools

import numpy as np
import pytest
import torch

from fastweight.tasks import MQAR, S5, TASKS, Parity, SNiah1, SNiah2, SNiah3, from_spec, tokenizer
from fastweight.tasks.niah import KEYS
from fastweight.tasks.state_tracking import s5_elements

SMALL = ["s_niah_1:context_len=63", "s_niah_2:context_len=100", "s_niah_3:context_len=127",
         "mqar:seq_len=63,n_pairs=5,vocab_size=64", "parity:seq_len=63", "s5:seq_len=100"]


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


@pytest.mark.parametrize("spec, arg", [
    ("s_niah_3:context_len=20", "context_len"), ("mqar:seq_len=10,n_pairs=8", "seq_len"),
    ("mqar:n_pairs=70,seq_len=400,vocab_size=128", "n_pairs"), ("parity:seq_len=0", "seq_len"),
    ("s5:length=3", "length"), ("nope", "nope"), ("mqar:seq_len=x", "seq_len"),
])
def test_bad_specs_name_the_argument(spec, arg):
    with pytest.raises(ValueError, match=arg):
        from_spec(spec)


def test_registry_and_bad_batch_arguments():
    assert set(TASKS) == {"s_niah_1", "s_niah_2", "s_niah_3", "mqar", "parity", "s5"}
    with pytest.raises(ValueError, match="batch_size"):
        Parity().batch(0)
    with pytest.raises(ValueError, match="seed"):
        Parity().batch(2, seed=-1)
