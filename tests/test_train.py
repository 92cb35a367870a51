import json
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from fastweight.tasks.base import Task
from fastweight.testing import rel_err
from fastweight.train import (TrainConfig, add_config_arguments, config_from_args, lm_config, load_checkpoint,
                              train)


def tiny(tmp_path, **kw):
    base = dict(task="parity:seq_len=16", mixer="gdn", d_model=32, n_layers=1, n_heads=2, steps=6, batch_size=4,
                lr=1e-2, warmup=2, out_dir=str(tmp_path), eval_examples=8, progress=False, log_every=1, threads=1)
    return TrainConfig(**{**base, **kw})


def test_loss_falls_on_an_overfit_batch(tmp_path):
    res = train(tiny(tmp_path, task="mqar:seq_len=16,n_pairs=2,vocab_size=16", steps=60, overfit_batches=1,
                     lr=3e-2, weight_decay=0.0))
    first, last = res["curve"][0][1], res["curve"][-1][1]
    assert last < 0.3 * first, res["curve"]
    saved = json.load(open(tmp_path / "results.json"))
    assert saved["steps_done"] == 60 and saved["eval"][0]["task"].startswith("mqar")
    assert 0 <= saved["eval"][0]["acc"] <= 1 and saved["tokens_per_second"] > 0


@pytest.mark.parametrize("flag", ["resume", "resume_if_present"])
def test_resume_continues_exactly(tmp_path, flag):
    straight = train(tiny(tmp_path / "a"))
    train(tiny(tmp_path / "b", stop_at=3, resume_if_present=flag == "resume_if_present"))  # none yet: step 0
    assert load_checkpoint(tmp_path / "b" / "checkpoint.pt")["step"] == 3
    resumed = train(tiny(tmp_path / "b", **{flag: True}))
    a = load_checkpoint(tmp_path / "a" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "b" / "checkpoint.pt")["model"]
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert straight["curve"] == resumed["curve"]
    assert straight["eval"] == resumed["eval"]


def test_checkpoint_holds_only_tensors_and_plain_containers(tmp_path):
    """The file loads with weights_only=True (no unpickled code), as it is, with every field."""
    train(tiny(tmp_path, steps=2))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 2 and state["config"]["steps"] == 2 and state["model_config"]["n_layers"] == 1
    assert state["optimizer"]["state"] and all(isinstance(t, torch.Tensor) for t in state["model"].values())


def test_resume_a_checkpoint_written_before_a_model_field_existed(tmp_path):
    """A checkpoint whose model_config lacks a field added later (``n_v_heads``) resumes when the
    field has its default; a different model is still refused."""
    train(tiny(tmp_path, steps=2))
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    del state["model_config"]["n_v_heads"]
    torch.save(state, tmp_path / "checkpoint.pt")
    assert train(tiny(tmp_path, steps=3, resume=True))["curve"][:len(state["curve"])] == state["curve"]
    with pytest.raises(ValueError, match="holds a different model"):
        train(tiny(tmp_path, steps=4, resume=True, n_layers=2))


def test_resume_without_a_checkpoint_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none" / "checkpoint.pt")):
        train(tiny(tmp_path / "none", resume=True))
    assert not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="resume_if_present"):
        tiny(tmp_path, resume=True, resume_if_present=True)


def test_a_checkpoint_that_would_run_code_is_not_loaded(tmp_path):
    """A pickled object that calls a function when unpickled: refused, and the call never happens."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (marker.touch, ())

    train(tiny(tmp_path, steps=2))
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    torch.save({**state, "curve": Payload()}, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match=f"{tmp_path / 'checkpoint.pt'} holds objects other than tensors"):
        train(tiny(tmp_path, steps=4, resume=True))
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "not torch", "another dict"])
def test_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path, damage):
    train(tiny(tmp_path, steps=2))
    path = tmp_path / "checkpoint.pt"
    data = path.read_bytes()
    if damage == "another dict":
        torch.save({"model": {}}, path)
    else:
        path.write_bytes({"truncated": data[:len(data) // 2], "empty": b"", "not torch": b"hello world"}[damage])
    report = "lacks" if damage == "another dict" else "truncated or corrupt"
    with pytest.raises(ValueError, match=f"{path}.*{report}"):
        train(tiny(tmp_path, steps=4, resume=True))


def test_resume_into_another_optimizer_layout_names_the_file(tmp_path):
    train(tiny(tmp_path, steps=2))
    with pytest.raises(ValueError, match=f"{tmp_path / 'checkpoint.pt'} does not fit"):
        train(tiny(tmp_path, steps=4, resume=True, weight_decay_1d=True))


def _ddp_worker(rank, world, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    train(tiny(out_dir, device="cpu", steps=3))
    torch.distributed.destroy_process_group()


def test_ddp_two_ranks_match_one_process(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path / "ddp")), nprocs=2, join=True)
    single = train(tiny(tmp_path / "one", steps=3))
    ddp = json.load(open(tmp_path / "ddp" / "results.json"))
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    a = load_checkpoint(tmp_path / "one" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "ddp" / "checkpoint.pt")["model"]
    for name in a:
        assert rel_err(b[name], a[name]) < 1e-5, name
    assert [l for _, l in ddp["curve"]] == pytest.approx([l for _, l in single["curve"]], rel=1e-5)


def test_cli_is_generated_from_the_fields():
    import argparse
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, TrainConfig)
    cfg = config_from_args(TrainConfig, parser.parse_args(["--steps", "5", "--no-progress", "--lr", "0.5",
                                                           "--task", "s5:seq_len=8", "--allow-neg-eigval"]))
    assert cfg == TrainConfig(steps=5, progress=False, lr=0.5, task="s5:seq_len=8", allow_neg_eigval=True)


def test_tasks_take_turns(tmp_path):
    res = train(tiny(tmp_path, task="s_niah_1:context_len=40,value_len=2;s_niah_2:context_len=40,value_len=2",
                     steps=2))
    assert [r["task"].split(":")[0] for r in res["eval"]] == ["s_niah_1", "s_niah_2"]
    with pytest.raises(ValueError, match="vocabulary"):
        TrainConfig(task="s5;parity")


def test_data_workers_draw_the_same_batches(tmp_path):
    kw = dict(curriculum="parity:seq_len=8", curriculum_steps=2, steps=5)
    inline = train(tiny(tmp_path / "a", **kw))
    ahead = train(tiny(tmp_path / "b", data_workers=2, **kw))  # worker 0: steps 0, 2, 4; worker 1: 1, 3
    assert ahead["curve"] == inline["curve"] and ahead["eval"] == inline["eval"]


def test_curriculum_comes_first(tmp_path, monkeypatch):
    from fastweight.tasks import SNiah1, SNiah2
    seen = []
    for cls in (SNiah1, SNiah2):
        monkeypatch.setattr(cls, "batch", lambda self, *a, _f=cls.batch, **k: seen.append(self.spec()) or _f(self, *a, **k))
    cur, main = "s_niah_1:context_len=32,value_len=2", "s_niah_2:context_len=40,value_len=2"
    res = train(tiny(tmp_path, task=main, curriculum=cur, curriculum_steps=2, steps=3, eval_examples=1))
    assert seen == [cur, cur, main, main] and res["eval"][0]["task"] == main  # the last: scoring
    with pytest.raises(ValueError, match="curriculum_steps"):
        TrainConfig(curriculum=cur, curriculum_steps=0)
    with pytest.raises(ValueError, match="curriculum_steps"):
        TrainConfig(task=main, curriculum=cur, curriculum_steps=301)
    with pytest.raises(ValueError, match="curriculum"):
        TrainConfig(task=main, curriculum="parity", curriculum_steps=1)


@pytest.mark.parametrize("kw, name", [(dict(steps=0), "steps"), (dict(task="mqar:n_pairs=x"), "n_pairs"),
                                      (dict(device="tpu"), "device"), (dict(eval_tasks="mqar;bogus"), "bogus"),
                                      (dict(eval_tasks="s5"), "vocabulary"), (dict(lr=-1.0), "lr"),
                                      (dict(grad_clip=-1.0), "grad_clip")])
def test_bad_config_names_the_field(kw, name):
    with pytest.raises(ValueError, match=name):
        TrainConfig(**kw)


@pytest.mark.parametrize("model_args", ["head_dim=abc", "expand_v=x", "tie_embeddings=maybe"])
def test_bad_model_args_name_the_field(model_args):
    with pytest.raises(ValueError, match=model_args.split("=")[0]):
        lm_config(TrainConfig(model_args=model_args), 64)


def test_chance_is_the_yardstick_train_prints():
    """`fastweight train` ends with each task's chance level (the most frequent answer) beside its score."""
    from fastweight.train import chance
    assert 0.45 < chance("parity") < 0.55                   # two answers
    assert chance("mqar") < 0.1 and chance("s5") < 0.05     # many answers
    assert chance("s_niah_1") == 0.0                        # a whole needle per example


class Constant(torch.nn.Module):
    """A model whose logits over ``vocab`` tokens are the same at every position: 1 at ``token`` (its argmax),
    0 elsewhere; all 0 without one."""

    def __init__(self, vocab: int, token: int | None = None):
        super().__init__()
        self.vocab, self.token = vocab, token

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, self.vocab)
        if self.token is not None:
            logits[..., self.token] = 1.0
        return logits


def test_score_gives_the_accuracy_of_each_answer_position():
    """``score``'s ``position_acc``: the accuracy of each example's j-th scored token. A model whose argmax is
    always the dash scores 1 at the UUID's dash (the ninth of 12 characters, 13 answer tokens) and 0 elsewhere;
    the token accuracy is their mean."""
    from fastweight.tasks import from_spec
    from fastweight.tasks.text import tokenizer
    from fastweight.train import score

    task = from_spec("s_niah_3:context_len=96,value_len=12")
    dash = tokenizer().ids["-"]

    res = score(Constant(task.vocab_size, dash), task, n_examples=10, batch_size=4, seed=5)
    assert res["position_acc"] == [0.0] * 8 + [1.0] + [0.0] * 4
    assert res["token_acc"] == pytest.approx(1 / 13) and res["seq_acc"] == 0.0


def test_position_acc_counts_each_position_over_the_examples_that_reach_it():
    """Examples with 1, 2 or 3 scored tokens: position j's accuracy is over the examples with a j-th token only
    (a model right on every first token and wrong on every later one scores [1, 0, 0], not diluted by padding)."""
    from fastweight.train import score

    @dataclass(frozen=True)
    class Answers(Task):
        name = "answers"
        vocab_size = 4
        seq_len = 6

        def example(self, rng):
            n = int(rng.integers(1, 4))  # scored tokens: the last n positions
            mask = np.arange(6) >= 6 - n
            targets = np.where(np.arange(6) == 6 - n, 1, 2)  # first answer token 1, later ones 2
            return np.zeros(6), targets, mask

    task = Answers()
    batch = task.batch(40, seed=(0, 1))
    lengths = batch.loss_mask.sum(1)
    assert set(lengths.tolist()) == {1, 2, 3}  # the stream has every length
    res = score(Constant(4, 1), task, n_examples=40, batch_size=7)
    assert res["position_acc"] == [1.0, 0.0, 0.0]
    assert res["token_acc"] == pytest.approx(40 / int(lengths.sum()))
    assert res["seq_acc"] == pytest.approx(float((lengths == 1).float().mean()))


def test_score_refuses_nothing_to_score():
    """No examples, or examples with no scored token, are an error naming the cause, not a division by zero."""
    from fastweight.tasks import from_spec
    from fastweight.train import score

    @dataclass(frozen=True)
    class Unscored(Task):
        name = "unscored"
        vocab_size = 4
        seq_len = 5

        def example(self, rng):
            return np.zeros(5), np.zeros(5), np.zeros(5, dtype=bool)

    zeros = Constant(4)
    with pytest.raises(ValueError, match="n_examples"):
        score(zeros, from_spec("parity:seq_len=8"), n_examples=0)
    with pytest.raises(ValueError, match="scored no token"):
        score(zeros, Unscored(), n_examples=3)
