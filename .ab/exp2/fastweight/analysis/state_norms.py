"""How large the state grows over a long input: ``||S_t||_F`` for t = 1..T.

A transition whose eigenvalues sit near 1 in some direction lets every write along it
pile up: with slow channels and writes that share a direction (as a trained model's do),
``||S_t||`` grows like the number of tokens written, up to ``1 / (1 - w)`` (RWKV-6, GLA).
RWKV-7's delta term removes the value stored along ``kappa-hat`` before writing the new
one, so its state stays bounded (RWKV-7 paper: RWKV-6's state values reach thousands).
"""

from __future__ import annotations

import torch

from fastweight.mechanisms import get
from fastweight.reference.recurrence import run_recurrence


def _column_norms(S_prev, S, x, scale):
    return S.norm(dim=-2)  # [B, H, V]


def state_norms(mechanism, inputs: dict) -> torch.Tensor:
    """``||S_t||_F`` after every step of the mechanism's own recurrence: [B, T, H].

    mechanism: a registry name or a Mechanism; inputs: as its ``sample`` returns them.
    """
    mech = get(mechanism) if isinstance(mechanism, str) else mechanism
    K = inputs["k"].shape[-1]
    cols, _ = run_recurrence(mech.step, inputs, key_dim=K, value_dim=inputs["v"].shape[-1], scale=1.0,
                             readout=_column_norms, out_dtype=torch.float64)
    return cols.norm(dim=-1)


def trained_like(inputs: dict, decay_factor: float = 1.0, write_bias: float = 0.0) -> dict:
    """Random inputs made to look like a trained model's: every log decay (``g``, ``w``, ``gk``)
    scaled by ``decay_factor`` (< 1: the slow channels, decay close to 1) and a constant
    ``write_bias`` added to the values (``write_bias / sqrt(K)`` to the keys): features shared
    by all tokens, so that successive writes add up instead of cancelling."""
    out = {n: (t * decay_factor if n in ("g", "w", "gk") else t) for n, t in inputs.items()}
    out["v"] = out["v"] + write_bias
    out["k"] = out["k"] + write_bias * out["k"].shape[-1] ** -0.5
    return out


def sample_state_norms(mechanism, *, T: int = 2048, H: int = 1, K: int = 16, seed: int = 0,
                       decay_factor: float = 1.0, write_bias: float = 0.0) -> torch.Tensor:
    """:func:`state_norms` on the mechanism's random inputs (B = 1, float64), passed through
    :func:`trained_like`: [T, H]."""
    mech = get(mechanism) if isinstance(mechanism, str) else mechanism
    g = torch.Generator().manual_seed(seed)
    inputs = mech.sample(1, T, H, K, K, dtype=torch.float64, device="cpu", generator=g)
    return state_norms(mech, trained_like(inputs, decay_factor, write_bias))[0]


@torch.no_grad()
def model_state_norms(model, input_ids: torch.Tensor, every: int = 64) -> torch.Tensor:
    """``||S||_F`` of every recurrent layer of a :class:`fastweight.models.LanguageModel` after
    each ``every`` tokens of ``input_ids`` [B, T], read from its decode cache: [n_points, n_layers]
    (averaged over B and heads; NaN for layers without a state)."""
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache()
        points = []
        for start in range(0, input_ids.shape[1], every):
            model(input_ids[:, start:start + every], cache=cache)
            points.append([float("nan") if layer.get("state") is None else
                           layer["state"].float().norm(dim=(-2, -1)).mean().item() for layer in cache.layers])
        return torch.tensor(points)
    finally:
        model.train(was_training)
