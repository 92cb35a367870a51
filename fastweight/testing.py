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


# Non-contiguous layouts of a gradient, as autograd hands them to a backward: a loss through
# ``x.sum()`` or ``x[..., :1]`` gives a stride-0 (expanded) cotangent, one through ``x.mT`` a
# transposed one, one through ``x[..., ::2]`` a sliced one.
LAYOUTS = ("contiguous", "expanded", "transposed", "transposed_outer", "sliced")


def strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` in ``layout`` (one of :data:`LAYOUTS`): "transposed" swaps the last two dims in memory,
    "transposed_outer" dims 1 and 2 (a head-first [B, H, T, V] buffer seen as [B, T, H, V]), "sliced"
    is every other element of a last dim twice as wide (offset 1). "expanded" changes the values: the
    first entry along dim -2 repeated with stride 0 (use the returned tensor's values)."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "expanded":
        return x[..., :1, :].expand(x.shape)
    if layout == "transposed":
        return x.transpose(-2, -1).contiguous().transpose(-2, -1)
    if layout == "transposed_outer":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "sliced":
        return torch.stack([torch.zeros_like(x), x], -1)[..., 1]
    raise ValueError(f"unknown layout {layout!r}, expected one of {LAYOUTS}")
