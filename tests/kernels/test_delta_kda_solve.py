"""KDA's solve formed in its intra kernel: which key dims and launches take it (``delta.INTRA_SOLVE_MAX_K``,
``SOLVE_WU_KDA``); the op against float64 on each side of the limit."""

import torch

import fastweight.kernels as kernels
import fastweight.reference.ops as reference
from fastweight.testing import rel_err

from delta_cases import TOL, sample


def test_kda_solve_in_the_intra_kernel_up_to_max_k(monkeypatch):
    """The fused solve is launched for key dims up to ``delta.INTRA_SOLVE_MAX_K`` only (at K 128 the fused kernel
    spills and is slower), and not with ``SOLVE_WU_KDA``; otherwise KDA's forward takes Ai from ``solve``; all
    match float64."""
    from fastweight.kernels import delta
    monkeypatch.setattr(delta, "INTRA_SOLVE_DTYPES", (torch.float32,))
    monkeypatch.setattr(delta, "INTRA_SOLVE_MAX_K", 16)
    solves = []
    real = delta.solve
    monkeypatch.setattr(delta, "solve", lambda *a, **kw: solves.append(1) or real(*a, **kw))
    for K, fused, wu_kda in ((16, True, False), (24, False, False), (16, False, True)):
        monkeypatch.setattr(delta, "SOLVE_WU_KDA", wu_kda)  # the solve's own W and U keep the solve's kernel
        solves.clear()
        x = {n: t.float() for n, t in sample("kda", 1, 40, 2, K, 16).items()}
        o, _ = kernels.chunk_kda(**x, scale=0.25)
        assert (not solves) == fused
        assert rel_err(o, reference.kda(**{n: t.double() for n, t in x.items()}, scale=0.25)[0]) < TOL[torch.float32]
