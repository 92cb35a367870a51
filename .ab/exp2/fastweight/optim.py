"""The trainer's optimiser and schedule: AdamW with weight decay on the weight matrices only, and
linear warm-up then cosine decay to a tenth of the peak rate (``fastweight.train`` uses them)."""

from __future__ import annotations

import math

import torch


def learning_rate(cfg, step: int) -> float:
    """The rate of ``step``: ``cfg.lr`` (step + 1) / warmup during the warm-up, then a cosine from
    ``cfg.lr`` down to ``cfg.lr / 10`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def decays(module: torch.nn.Module, name: str, p: torch.Tensor) -> bool:
    """Whether AdamW's weight decay applies to ``module``'s own parameter ``name``: the matrices
    (2-D and up: projections, embeddings, LoRA factors, convolution filters) do, except those a
    module lists in its ``no_weight_decay`` (RWKV's per-channel token-shift mixes and key scales
    are [H, K] or [6, D] vectors, not weights); 1-D parameters never do (biases, norm weights and
    the gates' parameters: A_log, dt_bias, D, RWKV's w0 / a0 / v0)."""
    return p.dim() >= 2 and name not in getattr(module, "no_weight_decay", ())


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) with ``cfg.weight_decay`` on the parameters :func:`decays` names
    and none on the others, as Mamba (``_no_weight_decay`` on A_log, D), fla and RWKV-LM (decay on
    ``.weight`` matrices only) train: decay would pull a gate's parameters toward 0, which for
    dt_bias means dt -> softplus(0) = 0.69, a fast forget, and for RWKV-7's w0 a log decay of
    -e^-0.5 / 2 = -0.30 a token. On the full suite's MQAR, Mamba-2 reached 77% instead of 56% in 3000
    steps without decay on them (docs/results/full.md). ``weight_decay_1d=True``: one group, every
    parameter decayed (the trainer's former default). Grouped by module, so it holds after FSDP
    sharding (which keeps the modules and their parameter names)."""
    if cfg.weight_decay_1d:
        groups = [dict(params=[p for p in model.parameters() if p.requires_grad], weight_decay=cfg.weight_decay)]
    else:
        decayed, kept, seen = [], [], set()
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:    # a tied weight counts once
                    seen.add(id(p))
                    (decayed if decays(module, name, p) else kept).append(p)
        groups = [dict(params=decayed, weight_decay=cfg.weight_decay), dict(params=kept, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
