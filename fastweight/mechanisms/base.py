"""What a mechanism is: a small spec over the one DPLR core.

A mechanism file defines, for its own paper's recurrence:

- ``step(S, x) -> S_new``: the update as the paper writes it. ``S`` is the state
  ``[B, H, K, V]``; ``x`` holds the inputs at one time step (``[B, H, ...]``), plus
  time-invariant parameters under names starting with ``_``.
- ``readout(S_prev, S_new, x, scale) -> o_t [B, H, V]`` (default ``S_new^T (scale q)``).
- ``to_dplr(inputs) -> dict(q, k, v, a, b, gk[, u])``: the map onto
  ``S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T`` (whole ``[B, T, H, ...]`` tensors).
- ``objective(S, x) -> (S_anchor, [(lr, loss_fn), ...], implicit)``: the online-learning
  view. The explicit step is ``S_anchor - sum_j lr_j * grad loss_fn_j(S_anchor)`` (``lr`` None
  means 1; a tensor broadcasts against ``[B, H, K, V]``: a row-wise learning rate). The anchor
  is ``S`` itself, or the decayed state for decay-then-step mechanisms (GDN, KDA). With
  ``implicit=True`` the step is the proximal one, ``argmin_X 1/2 ||X - S_anchor||^2 + sum_j lr_j
  loss_fn_j(X)``, solved numerically by the checker.
- ``sample(B, T, H, K, V, *, dtype, device, generator) -> inputs``: valid random inputs
  (keys normalised where the mechanism expects it, gates in range).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fastweight.reference.recurrence import default_readout, run_recurrence

KERNEL_PATHS = ("scalar_decay", "vector_decay", "delta", "dplr")


@dataclass(frozen=True)
class Mechanism:
    name: str
    title: str
    paper: str
    kernel_path: str
    dplr_in_words: str
    input_names: tuple
    sample: Callable
    step: Callable
    to_dplr: Callable
    objective: Callable | None = None
    readout: Callable = default_readout
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kernel_path not in KERNEL_PATHS:
            raise ValueError(f"kernel_path must be one of {KERNEL_PATHS}, got {self.kernel_path!r}")

    def recurrent(self, inputs: dict, scale: float | None = None, initial_state=None,
                  output_final_state: bool = False, cu_seqlens=None):
        """Run the mechanism's own recurrence: returns (o [B, T, H, V], final state or None)."""
        K = inputs["q"].shape[-1] if "q" in inputs else inputs["k"].shape[-1]
        scale = K ** -0.5 if scale is None else scale
        return run_recurrence(self.step, inputs, key_dim=K, value_dim=inputs["v"].shape[-1],
                              scale=scale, readout=self.readout, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens)


REGISTRY: dict[str, Mechanism] = {}


def register(mechanism: Mechanism) -> Mechanism:
    if mechanism.name in REGISTRY:
        raise ValueError(f"mechanism {mechanism.name!r} registered twice")
    REGISTRY[mechanism.name] = mechanism
    return mechanism


def get(name: str) -> Mechanism:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown mechanism {name!r}; known: {', '.join(REGISTRY)}") from None


def randn(shape, *, dtype, device, generator):
    return torch.randn(*shape, dtype=dtype, device=device, generator=generator)


def rand(shape, *, dtype, device, generator):
    return torch.rand(*shape, dtype=dtype, device=device, generator=generator)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + eps)


def outer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k v^T for batched vectors: [..., K], [..., V] -> [..., K, V]."""
    return k[..., None] * v[..., None, :]


def kT_S(k: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """S^T k: [B, H, K], [B, H, K, V] -> [B, H, V]."""
    return torch.einsum("bhk,bhkv->bhv", k, S)
