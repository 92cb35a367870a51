"""``fastweight train``: train the library's language model on a synthetic task.

One loop for every task and mixer: a task (``fastweight.tasks``) yields
``Batch(input_ids, targets, loss_mask)``; the loss is the cross entropy of the
model's logits against ``targets`` where ``loss_mask``. The batch of step ``s`` is
drawn from the seed ``(seed, 0, s)``, so a resumed run sees exactly the data it
would have seen, and under ``torchrun`` each of ``world`` ranks draws its slice of
the global batch (examples ``rank * B / world ...``) and DDP averages the
gradients: two ranks with batch B/2 each take the same step as one process with B.
``--parallel fsdp`` shards instead (FSDP2 ``fully_shard`` on each block, then the root:
parameters, gradients and AdamW state split over the ranks; NCCL or gloo), the same steps.
``--context-parallel`` splits every sequence instead of the batch: each rank takes the whole
batch's tokens ``rank * T / world ...`` and the layers pass the recurrence, short convolutions
and token shift across ranks (``fastweight.context_parallel``, on a process group of its own;
linear mixers only): long sequences, the same steps.
Several ``;``-separated task specs (one vocabulary) take turns, one per step; a
``curriculum`` (specs of the same vocabulary, e.g. the task at a shorter length) is
trained on instead during the first ``curriculum_steps`` steps (the learning-rate
schedule runs over all ``steps``). With ``data_workers`` the batches are drawn ahead in
that many processes (a ``torch.utils.data.DataLoader``; the same batches): on a GPU, where
a small model's step is bound by the Python launching its kernels, that takes the data
off the critical path.

    fastweight train --task mqar:seq_len=64,n_pairs=8 --mixer gdn --steps 300
    torchrun --nproc-per-node 2 -m fastweight.train --task s5:seq_len=32 --mixer rwkv7
    torchrun --nproc-per-node 2 -m fastweight.train --task s5:seq_len=32 --parallel fsdp

Writes ``out_dir/checkpoint.pt`` every ``checkpoint_every`` steps and at the end and
``out_dir/results.json``: the config, the loss curve, throughput and the held-out scores
(:func:`score`) on ``eval_tasks``. The checkpoint holds tensors and plain containers only
(model and optimizer state, step, loss curve, configs) and is read with ``weights_only=True``
(:func:`load_checkpoint`), so a checkpoint from elsewhere cannot run code. Under FSDP the full
state is gathered to rank 0 and written in the same format, so a run resumes at any world size
and with either ``parallel``. ``--resume``
continues from it and is an error when there is none; ``--resume-if-present`` continues
when there is one and starts at step 0 otherwise (a job restarted after preemption).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pickle
import sys
import time
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from fastweight.optim import decays, learning_rate, make_optimizer  # noqa: F401  (this module's API too)
from fastweight.tasks import Batch, Task, from_spec

TRAIN_STREAM, EVAL_STREAM = 0, 1
PARALLEL = ("ddp", "fsdp")


def arg(default, help: str):
    """A config field with its command-line help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    task: str = arg("mqar:seq_len=64,n_pairs=8",
                    "task spec name[:field=value,...] (fastweight.tasks); several, ';'-separated, take turns")
    mixer: str = arg("gdn", "mixer pattern, e.g. gdn, 'gdn,swa', rwkv7")
    preset: str = arg("tiny", "LMConfig preset")
    d_model: int = arg(0, "model width (0: the preset's)")
    n_layers: int = arg(0, "layers (0: the preset's)")
    n_heads: int = arg(0, "heads (0: the preset's)")
    allow_neg_eigval: bool = arg(False, "delta-rule beta in (0, 2): negative transition eigenvalues")
    model_args: str = arg("", "other LMConfig fields, 'field=value,...'")
    steps: int = arg(300, "optimizer steps")
    batch_size: int = arg(32, "global batch (split over data-parallel ranks)")
    lr: float = arg(3e-3, "peak learning rate (AdamW)")
    weight_decay: float = arg(0.1, "AdamW weight decay")
    weight_decay_1d: bool = arg(False, "decay every parameter, the 1-D and gate ones too (biases, norm weights, "
                                       "A_log, dt_bias, D, RWKV's decay and mixing vectors); default: matrices only, "
                                       "as Mamba, fla and RWKV-LM train")
    warmup: int = arg(20, "linear warm-up steps, then cosine decay to lr / 10")
    grad_clip: float = arg(1.0, "gradient norm clip (0: off)")
    seed: int = arg(0, "seed of the initialisation and of the data streams")
    device: str = arg("auto", "auto, cpu, cuda")
    amp: bool = arg(True, "bf16 autocast on CUDA")
    threads: int = arg(0, "torch CPU threads (0: leave as is)")
    parallel: str = arg("ddp", "under torchrun: ddp (each rank holds the whole model) or fsdp (FSDP2: parameters, "
                               "gradients and optimizer state sharded over the ranks); one process: neither")
    context_parallel: bool = arg(False, "under torchrun: split every sequence over the ranks (long sequences; "
                                        "T a multiple of the world size; linear mixers only)")
    out_dir: str = arg("runs/train", "checkpoint and results.json go here")
    checkpoint_every: int = arg(100, "steps between checkpoints (0: only at the end)")
    resume: bool = arg(False, "continue from out_dir/checkpoint.pt; an error when there is none")
    resume_if_present: bool = arg(False, "continue from out_dir/checkpoint.pt when there is one, else start at "
                                         "step 0 (the same command for a first start and for a restart)")
    stop_at: int = arg(0, "stop after this step, as if interrupted (0: run all steps)")
    overfit_batches: int = arg(0, "cycle through this many batches (0: a fresh batch every step)")
    curriculum: str = arg("", "';'-separated task specs trained on first, in turns, for curriculum_steps steps")
    curriculum_steps: int = arg(0, "the first steps (of `steps`) train on `curriculum` instead of `task`")
    data_workers: int = arg(0, "processes that draw the batches ahead of the steps (0: the training process)")
    eval_tasks: str = arg("", "';'-separated task specs scored at the end (default: the train task)")
    eval_examples: int = arg(256, "held-out examples per eval task")
    log_every: int = arg(10, "steps between loss-curve points")
    progress: bool = arg(True, "tqdm progress bar")

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_examples", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("d_model", "n_layers", "n_heads", "warmup", "checkpoint_every", "stop_at", "threads",
                     "overfit_batches", "curriculum_steps", "data_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.resume and self.resume_if_present:
            raise ValueError("TrainConfig.resume (a checkpoint is required) and resume_if_present (it is optional) "
                             "exclude each other; give one")
        if self.parallel not in PARALLEL:
            raise ValueError(f"TrainConfig.parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"TrainConfig.device must be auto, cpu or cuda[:i], got {self.device!r}")
        sizes = {from_spec(s).vocab_size for s in self.train_specs}
        if len(sizes) != 1:
            raise ValueError(f"TrainConfig.task: the tasks of {self.task!r} must share one vocabulary, "
                             f"got sizes {sizes}")
        if bool(self.curriculum_specs) != bool(self.curriculum_steps) or self.curriculum_steps > self.steps:
            raise ValueError(f"TrainConfig.curriculum_steps must be in [1, steps = {self.steps}] with a curriculum "
                             f"and 0 without one, got {self.curriculum_steps} with curriculum {self.curriculum!r}")
        for spec in self.curriculum_specs:
            if from_spec(spec).vocab_size not in sizes:
                raise ValueError(f"TrainConfig.curriculum: {spec!r} has another vocabulary than the train task")
        for spec in self.eval_specs:
            if from_spec(spec).vocab_size not in sizes:
                raise ValueError(f"TrainConfig.eval_tasks: {spec!r} has another vocabulary than the train task")

    @property
    def train_specs(self) -> list[str]:
        return [s.strip() for s in self.task.split(";") if s.strip()] or [""]

    @property
    def curriculum_specs(self) -> list[str]:
        return [s.strip() for s in self.curriculum.split(";") if s.strip()]

    @property
    def eval_specs(self) -> list[str]:
        return [s.strip() for s in self.eval_tasks.split(";") if s.strip()] or self.train_specs


def lm_config(cfg: TrainConfig, vocab_size: int):
    """The model's LMConfig: the preset, the mixer, the sizes given, and ``model_args``."""
    from fastweight.models import LMConfig
    overrides = {n: getattr(cfg, n) for n in ("d_model", "n_layers", "n_heads") if getattr(cfg, n)}
    types = {f.name: f.default for f in fields(LMConfig)}
    for item in filter(None, cfg.model_args.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in types:
            raise ValueError(f"`model_args`: bad item {item!r}; LMConfig fields are {sorted(types)}")
        default = types[key]
        try:
            if isinstance(default, bool):
                overrides[key] = {"1": True, "true": True, "yes": True, "0": False, "false": False,
                                  "no": False}[value.lower()]
            elif isinstance(default, (int, float)):
                overrides[key] = type(default)(value)
            elif default is None:
                overrides[key] = int(value)
            else:
                overrides[key] = value
        except (KeyError, ValueError):
            raise ValueError(f"`model_args`: bad value in {item!r} (LMConfig.{key} takes "
                             f"{'true/false' if isinstance(default, bool) else type(default or 0).__name__})") from None
    return LMConfig.preset(cfg.preset, mixer=cfg.mixer, vocab_size=vocab_size,
                           allow_neg_eigval=cfg.allow_neg_eigval, **overrides)


def build_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    from fastweight.models import LanguageModel
    return LanguageModel(lm_config(cfg, vocab_size))


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids)
    return getattr(out, "logits", out)


def masked_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean cross entropy over the scored positions: logits [B, T, V]."""
    return F.cross_entropy(logits[batch.loss_mask].float(), batch.targets[batch.loss_mask])


@torch.no_grad()
def score(model, task: Task, *, n_examples: int = 256, batch_size: int = 32, seed: int = 0,
          device="cpu") -> dict:
    """Held-out scores of ``model`` on ``task`` (examples from the stream ``(seed, 1)``).

    ``token_acc``: fraction of scored tokens whose argmax is the target; ``seq_acc``: fraction
    of examples with every scored token right; ``acc``: the one the task is judged by
    (``task.metric``); ``loss``: mean masked cross entropy; ``position_acc``: the token accuracy
    of each example's j-th scored token, j = 0, 1, ... (a needle's j-th answer token, MQAR's j-th
    query), over the examples that have one: where along an answer a model goes wrong.
    """
    if not isinstance(n_examples, int) or n_examples < 1:
        raise ValueError(f"`n_examples` must be a positive int, got {n_examples!r}")
    was_training = model.training
    model.eval()
    right_tokens = n_tokens = right_seqs = 0
    loss_sum = 0.0
    right_at, seen_at = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    for start in range(0, n_examples, batch_size):
        batch = task.batch(min(batch_size, n_examples - start), seed=(seed, EVAL_STREAM), start=start).to(device)
        logits = logits_of(model, batch.input_ids).float()
        correct = (logits.argmax(-1) == batch.targets) | ~batch.loss_mask
        loss_sum += F.cross_entropy(logits[batch.loss_mask], batch.targets[batch.loss_mask],
                                    reduction="sum").item()
        n_tokens += int(batch.loss_mask.sum())
        right_tokens += int((correct & batch.loss_mask).sum())
        right_seqs += int(correct.all(dim=1).sum())
        mask = batch.loss_mask.cpu()
        at = (mask.cumsum(1) - 1)[mask]  # each scored token's index among its example's
        width = max(len(seen_at), int(at.max()) + 1 if at.numel() else 0)
        right_at, seen_at = (F.pad(x, (0, width - len(x))) for x in (right_at, seen_at))
        right_at.index_add_(0, at, correct.cpu()[mask].long())
        seen_at.index_add_(0, at, torch.ones_like(at))
    model.train(was_training)
    if n_tokens == 0:
        raise ValueError(f"task {task.spec()!r} scored no token in {n_examples} examples: nothing to score")
    result = dict(task=task.spec(), loss=loss_sum / n_tokens, token_acc=right_tokens / n_tokens,
                  seq_acc=right_seqs / n_examples, n_examples=n_examples,
                  position_acc=(right_at.double() / seen_at).tolist())
    result["acc"] = result["seq_acc"] if task.metric == "sequence" else result["token_acc"]
    return result


def _context_parallel_loss(net, batch: Batch, group, rank: int, world: int) -> torch.Tensor:
    """This rank's share of the batch's mean loss, times ``world`` (DDP averages the ranks'
    gradients): its tokens' summed cross entropy over the count of scored tokens in the batch."""
    T = batch.input_ids.shape[1]
    if T % world:
        raise ValueError(f"`context_parallel`: the sequence length ({T}) must be a multiple of the world size ({world})")
    span = slice(rank * T // world, (rank + 1) * T // world)
    out = net(batch.input_ids[:, span], context_parallel=group)
    logits, mask = getattr(out, "logits", out), batch.loss_mask[:, span]
    total = F.cross_entropy(logits[mask].float(), batch.targets[:, span][mask], reduction="sum")
    return total * world / batch.loss_mask.sum().clamp_min(1)


def _distributed(device: torch.device):
    """(rank, world) under torchrun (initialising the process group once: NCCL for CUDA devices,
    gloo for the CPU), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _global_mean(x: torch.Tensor, world: int) -> float:
    if world > 1:
        x = x.clone()
        torch.distributed.all_reduce(x)
        x /= world
    return x.item()


def _device(cfg: TrainConfig) -> torch.device:
    """``auto``: CUDA when there is one; a bare ``cuda`` is the rank's own GPU (``LOCAL_RANK``)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if cfg.device == "auto":
        return torch.device("cpu")
    return torch.device(cfg.device)


def _checkpoint_path(cfg: TrainConfig) -> str:
    return os.path.join(cfg.out_dir, "checkpoint.pt")


def _save(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)


CHECKPOINT_KEYS = ("model", "optimizer", "step", "curve", "config", "model_config")


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """A checkpoint written by :func:`train`: ``model`` and ``optimizer`` (state dicts), ``step``,
    ``curve``, ``config`` (the TrainConfig's fields) and ``model_config`` (the LMConfig's).

    Read with ``torch.load(weights_only=True)``: tensors and plain containers only, so unpickling
    cannot run code. A file that holds other objects, or that is truncated or corrupt, raises a
    ValueError naming it."""
    path = os.fspath(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise  # missing, unreadable: the error names the file
    except pickle.UnpicklingError as e:
        if "weights_only" not in str(e):
            raise ValueError(f"cannot read the checkpoint {path}: truncated or corrupt ({e})") from e
        found = next((line for line in str(e).splitlines() if "GLOBAL" in line), "")
        raise ValueError(f"the checkpoint {path} holds objects other than tensors and plain containers; it is not "
                         f"loaded, as unpickling them could run code. {found}".strip()) from e
    except Exception as e:  # torch reports a damaged file as RuntimeError, EOFError, KeyError, ...
        raise ValueError(f"cannot read the checkpoint {path}: truncated or corrupt ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from e
    missing = [k for k in CHECKPOINT_KEYS if k not in state] if isinstance(state, dict) else list(CHECKPOINT_KEYS)
    if missing:
        raise ValueError(f"{path} is not a `fastweight train` checkpoint: it lacks {missing}")
    return state


def _shard(model: torch.nn.Module, device: torch.device, world: int) -> None:
    """FSDP2 in place: each block its own unit (gathered for its forward and backward only), then
    the root (embedding, final norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each param group's parameters, in the optimizer's order (that of the ids of
    ``optimizer.state_dict()``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _full_state(model, optimizer, sharded: bool) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts as one process's ``state_dict()`` would give
    them (optimizer ids 0, 1, ...). Sharded: gathered (every rank must call it) to CPU on rank 0,
    ``({}, {})`` on the others."""
    if not sharded:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    named = get_optimizer_state_dict(model, optimizer, options=options)      # keyed by parameter name
    if not named:
        return model_state, {}
    ids = {n: i for i, n in enumerate(n for group in _param_names(model, optimizer) for n in group)}
    return model_state, dict(state={ids[n]: v for n, v in named["state"].items()},
                             param_groups=[{**g, "params": [ids[n] for n in g["params"]]}
                                           for g in named["param_groups"]])


def _load_optimizer(model, optimizer, state: dict, sharded: bool) -> None:
    """Load a state dict in ``optimizer.state_dict()``'s format; sharded, each rank keeps its
    shards of the full tensors (every rank holds ``state`` and must call it)."""
    if not sharded:
        return optimizer.load_state_dict(state)
    names = _param_names(model, optimizer)
    groups = state["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g) for g in names]:
        raise ValueError(f"its param groups hold {[len(g['params']) for g in groups]} parameters, the optimizer's "
                         f"{[len(g) for g in names]}")
    by_id = {i: n for g, group_names in zip(groups, names) for i, n in zip(g["params"], group_names)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, dict(state={by_id[i]: v for i, v in state["state"].items()},
                                                    param_groups=[{**g, "params": [by_id[i] for i in g["params"]]}
                                                                  for g in groups]),
                             options=StateDictOptions(full_state_dict=True))
    for group, saved in zip(optimizer.param_groups, groups):  # as saved (the loader's round trip makes tuples lists)
        group.update((k, v) for k, v in saved.items() if k != "params")


def train(cfg: TrainConfig) -> dict:
    """Run ``cfg``; returns the results dict (also written to ``out_dir/results.json`` on rank 0)."""
    device = _device(cfg)
    rank, world = _distributed(device)
    cp = world > 1 and cfg.context_parallel
    if cfg.batch_size % world and not cp:
        raise ValueError(f"`batch_size` ({cfg.batch_size}) must be a multiple of the world size ({world})")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    sharded = world > 1 and cfg.parallel == "fsdp"
    vocab_size = from_spec(cfg.train_specs[0]).vocab_size
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, vocab_size).to(device)
    model_config = lm_config(cfg, vocab_size).to_dict()
    start_step, curve, state = 0, [], None
    path = _checkpoint_path(cfg)
    if cfg.resume and not os.path.exists(path):
        raise FileNotFoundError(f"`resume`: no checkpoint at {path} (out_dir {cfg.out_dir!r}); run without "
                                "--resume to start at step 0, or with --resume-if-present to do so when there is none")
    if cfg.resume or (cfg.resume_if_present and os.path.exists(path)):
        state = load_checkpoint(path, map_location="cpu" if sharded else device)
        # compared as configs: a field added since the checkpoint was written takes its default there
        from fastweight.models import LMConfig
        if LMConfig.from_dict(state["model_config"]) != LMConfig.from_dict(model_config):
            raise ValueError(f"`resume`: {path} holds a different model; use another out_dir")
        start_step, curve = state["step"], state["curve"]

    def fit(load, *args):
        try:
            load(*args)
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"`resume`: the state in {path} does not fit this run's model and optimizer "
                             f"(e.g. another weight_decay_1d): {e}") from e

    if state is not None:
        fit(model.load_state_dict, state["model"])               # whole, before any sharding
    net = model
    if sharded:
        _shard(model, device, world)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel
        # find_unused_parameters: a mixer may hold parameters its first layer does not use (RWKV-7's
        # value-residual mix in layer 0), which DDP otherwise waits for forever at the next step
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      find_unused_parameters=True)
    optimizer = make_optimizer(model, cfg)                       # after sharding: over the shards
    if state is not None:
        fit(_load_optimizer, model, optimizer, state["optimizer"], sharded)
        del state
    local = cfg.batch_size if cp else cfg.batch_size // world
    cp_group = torch.distributed.new_group(list(range(world))) if cp else None
    use_amp = cfg.amp and device.type == "cuda"
    end_step = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    bar = _progress(cfg, rank, start_step, end_step)
    t0, tokens, loss_value = time.perf_counter(), 0, float("nan")

    def checkpoint(step):
        model_state, optimizer_state = _full_state(model, optimizer, sharded)
        if rank == 0:
            _save(path, dict(model=model_state, optimizer=optimizer_state, step=step, curve=curve,
                             config=dataclasses.asdict(cfg), model_config=model_config))

    batches = _batches(cfg, start_step, end_step, 0, 1) if cp else _batches(cfg, start_step, end_step, rank, world)
    net.train()
    for step in range(start_step, end_step):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        batch = next(batches).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            if cp:
                loss = _context_parallel_loss(net, batch, cp_group, rank, world)
            else:
                loss = masked_loss(logits_of(net, batch.input_ids), batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        loss_value = _global_mean(loss.detach(), world)
        tokens += batch.input_ids.numel() * (1 if cp else world)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            curve.append((step, loss_value))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            checkpoint(step + 1)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    checkpoint(end_step)
    results = dict(config=dataclasses.asdict(cfg), model_config=model_config,
                   steps_done=end_step, final_loss=loss_value, curve=curve, world_size=world,
                   parallel=("fsdp" if sharded else "ddp" if world > 1 else "none") + ("+cp" if cp else ""),
                   seconds=seconds, tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                   n_params=sum(p.numel() for p in model.parameters()), device=str(device), eval=[])
    if end_step == cfg.steps and (rank == 0 or sharded):          # sharded: every rank takes part
        results["eval"] = [score(model, from_spec(s), n_examples=cfg.eval_examples, batch_size=local,
                                 seed=cfg.seed, device=device) for s in cfg.eval_specs]
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    if world > 1:
        torch.distributed.barrier()
    return results


class _Steps(torch.utils.data.IterableDataset):
    """The training batches of steps ``start .. end - 1`` for one rank, in order; with several
    data workers, worker ``i`` draws the steps ``start + i, start + i + n, ...`` (the loader
    takes them round robin, so the order is kept)."""

    def __init__(self, cfg: TrainConfig, start: int, end: int, rank: int, world: int):
        super().__init__()
        self.cfg, self.start, self.end, self.rank, self.local = cfg, start, end, rank, cfg.batch_size // world

    def batch(self, step: int) -> Batch:
        cfg = self.cfg
        data_step = step % cfg.overfit_batches if cfg.overfit_batches else step
        phase = cfg.curriculum_specs if step < cfg.curriculum_steps else cfg.train_specs
        task = _task(phase[data_step % len(phase)])
        return task.batch(self.local, seed=(cfg.seed, TRAIN_STREAM, data_step), start=self.rank * self.local)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, stride = (0, 1) if info is None else (info.id, info.num_workers)
        return (self.batch(step) for step in range(self.start + first, self.end, stride))


_task = functools.lru_cache(maxsize=None)(from_spec)


def _batches(cfg: TrainConfig, start: int, end: int, rank: int, world: int):
    """An iterator over the batches of steps ``start .. end - 1`` (the same with or without workers)."""
    steps = _Steps(cfg, start, end, rank, world)
    if not cfg.data_workers or end <= start:
        return iter(steps)
    return iter(torch.utils.data.DataLoader(steps, batch_size=None, num_workers=cfg.data_workers,
                                            prefetch_factor=4, persistent_workers=False))


def _progress(cfg: TrainConfig, rank: int, start: int, end: int):
    if not cfg.progress or rank != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=end, initial=start, desc=f"{cfg.mixer} {cfg.task.split(':')[0]}", dynamic_ncols=True,
                file=sys.stderr)


def add_config_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One ``--field-name`` option per dataclass field, typed by its default."""
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata.get("help", "") + f" (default: {f.default})"
        if isinstance(f.default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            parser.add_argument(flag, dest=f.name, type=type(f.default), default=f.default, help=help)


def config_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def chance(spec: str, examples: int = 256) -> float:
    """The score of always answering the most frequent scored target: the yardstick below which
    a run has learnt nothing (per token, or per example for the sequence-scored needle tasks)."""
    task = from_spec(spec)
    b = task.batch(examples, seed=(2 ** 31 - 1, 7))       # a stream no training or eval run draws
    targets = b.targets[b.loss_mask]
    top = torch.bincount(targets).argmax()
    if task.metric == "token":
        return float((targets == top).float().mean())
    hit = ((b.targets == top) | ~b.loss_mask).all(dim=1)
    return float(hit.float().mean())


def _run(args: argparse.Namespace) -> int:
    results = train(config_from_args(TrainConfig, args))
    for r in results["eval"]:
        print(f"{r['task']}: acc {r['acc']:.3f} (token {r['token_acc']:.3f}, sequence {r['seq_acc']:.3f}), "
              f"loss {r['loss']:.3f}; chance {chance(r['task']):.3f}, solved 1.000")
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="train the language model on a synthetic task",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, TrainConfig)
    parser.set_defaults(func=_run)
    return parser


def main(argv=None) -> int:
    from fastweight.cli import run_subcommand
    return run_subcommand(register, "train", argv)


if __name__ == "__main__":
    sys.exit(main())
