"""Helpers shared by the tests and the benchmarks (one place, never re-defined in a test)."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (the absolute ||x - ref|| when ref is zero). NaN or Inf in
    ``x`` gives inf."""
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    denom = ref.norm().item()
    num = (x - ref).norm().item()
    return num if denom == 0 else num / denom


# The fresh seeds drawn by ``generator(None)`` during the current test (tests/conftest.py clears
# the list before each test and prints it with a failure).
fresh_seeds: list[int] = []


def generator(seed: int | None = None, device="cpu") -> torch.Generator:
    """A generator seeded from ``seed``; when None, from a fresh random seed, recorded in
    :data:`fresh_seeds` (printed by pytest with a failure: pass it as ``seed`` to reproduce)."""
    g = torch.Generator(device=device)
    if seed is None:
        fresh_seeds.append(g.seed())
    else:
        g.manual_seed(seed)
    return g


def nan_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN, so that an unwritten element fails a check."""
    return torch.full_like(x, float("nan"))
