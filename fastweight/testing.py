"""Helpers shared by the tests and the benchmarks (one place, never re-defined in a test)."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are zero). NaN anywhere gives inf."""
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    denom = ref.norm().item()
    num = (x - ref).norm().item()
    return num if denom == 0 else num / denom


def generator(seed: int | None = None, device="cpu") -> torch.Generator:
    """A generator seeded from ``seed`` (fresh random seed when None, printed by pytest on failure)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def nan_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN, so that an unwritten element fails a check."""
    return torch.full_like(x, float("nan"))
