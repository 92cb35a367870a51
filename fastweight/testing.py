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


# (layout of o's cotangent, of the final state's) for the ops' backward tests; None leaves that
# output out of the loss (a loss on the state alone)
COTANGENTS = (("expanded", "contiguous"), ("transposed_outer", "contiguous"), ("sliced", "sliced"),
              ("contiguous", "expanded"), ("contiguous", "transposed"), (None, "transposed"), (None, "sliced"))


def check_gradients(outs, leaves: dict, ref_outs, ref_leaves: dict, g_ref, cotangents, tol: float, what: str = "",
                    tols: dict | None = None):
    """Asserts that every leaf's gradient for ``cotangents`` (of each of ``outs``; None: that output is
    not in the loss), handed to the backward as they are (any strides), is within ``tol`` (relative) of
    the reference's (``ref_outs``, ``ref_leaves`` of the same names; cotangents in float64 there).
    ``tols``: a tolerance for some leaves by name, in place of ``tol``.

    ``g_ref``: the reference's log gate when ``A_log`` and ``dt_bias`` form it (Mamba-2's gate), else
    None. Their gradients are sums over tokens of dL/dg_t dg_t/dtheta: the error is the per-token error
    times sum |dL/dg_t dg_t/dtheta|, which can exceed |dtheta| a lot (cancellation in the sum), so their
    tolerance is scaled by that ratio, computed from the reference.
    """
    used = [i for i, c in enumerate(cotangents) if c is not None]
    names = list(leaves)
    got = torch.autograd.grad([outs[i] for i in used], [leaves[n] for n in names], [cotangents[i] for i in used],
                              retain_graph=True, allow_unused=True)
    targets = [ref_leaves[n] for n in names] + ([g_ref] if g_ref is not None else [])
    want = torch.autograd.grad([ref_outs[i] for i in used], targets, [cotangents[i].double() for i in used],
                               retain_graph=True, allow_unused=True)
    want = [torch.zeros_like(t) if w is None else w for w, t in zip(want, targets)]
    magnitude = {}
    if g_ref is not None:
        params = [ref_leaves["A_log"], ref_leaves["dt_bias"]]
        magnitude = dict(zip(("A_log", "dt_bias"),
                             torch.autograd.grad((g_ref * want[-1].abs()).sum(), params, retain_graph=True)))
    for n, a, b in zip(names, got, want):
        assert a is not None, f"{what}d{n}: no gradient"
        assert a.dtype == leaves[n].dtype, f"{what}d{n}: {a.dtype}"
        t = (tols or {}).get(n, tol)
        t *= max(1.0, magnitude[n].norm().item() / (b.norm().item() or 1.0)) if n in magnitude else 1.0
        assert rel_err(a, b) < t, f"{what}d{n}: {rel_err(a, b):.3g} (tolerance {t:.3g})"
