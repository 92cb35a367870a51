"""Eigenvalues of a mechanism's transition over a sequence.

The transition at step t is ``P_t = Diag(exp gk_t) + a_t b_t^T`` (the DPLR map, see
:func:`fastweight.theory.transition_matrix`). Its spectrum says what the state can do:
eigenvalues in (0, 1] only decay (LA, RetNet, Mamba-2, GLA, RWKV-6: diagonal, real,
positive), the delta rule has K-1 eigenvalues at 1 and one at ``1 - beta`` (negative
with ``allow_neg_eigval``), RWKV-7 keeps all of them in [-1, 1] and below one in every
direction.
"""

from __future__ import annotations

import torch

from fastweight.analysis.attention import recurrence_dplr
from fastweight.mechanisms import get
from fastweight.theory import transition_eigenvalues


def transition_spectra(mechanism, inputs: dict) -> torch.Tensor:
    """Eigenvalues of every step's transition: [T, B, H, K] complex.

    mechanism: a registry name or a Mechanism; inputs: as its ``sample`` returns them.
    """
    mech = get(mechanism) if isinstance(mechanism, str) else mechanism
    T = inputs["v"].shape[1]
    return torch.stack([transition_eigenvalues(mech, inputs, t) for t in range(T)])


def sample_spectra(mechanism, *, T: int = 32, H: int = 2, K: int = 16, seed: int = 0) -> torch.Tensor:
    """:func:`transition_spectra` on the mechanism's own random inputs (B = 1, float64): [T, H, K]."""
    mech = get(mechanism) if isinstance(mechanism, str) else mechanism
    g = torch.Generator().manual_seed(seed)
    inputs = mech.sample(1, T, H, K, K, dtype=torch.float64, device="cpu", generator=g)
    return transition_spectra(mech, inputs)[:, 0]


def recurrence_transitions(record) -> torch.Tensor:
    """The transitions ``Diag(exp gk_t) + a_t b_t^T`` of one recorded layer call
    (:func:`fastweight.analysis.attention.recorded_recurrences`, mapped by
    :func:`fastweight.analysis.attention.recurrence_dplr`): [B, T, H, K, K]."""
    d = recurrence_dplr(record)
    q, gk = d["q"].float(), d["gk"]
    if gk is not None and gk.dim() == q.dim() - 1:  # a scalar decay per head
        gk = gk[..., None]
    w = torch.ones_like(q) if gk is None else gk.float().exp().expand_as(q)
    P = torch.diag_embed(w)
    if d["a"] is not None and d["b"] is not None:
        P = P + d["a"].float()[..., :, None] * d["b"].float()[..., None, :]
    return P


def recurrence_eigenvalues(record) -> torch.Tensor:
    """Eigenvalues of :func:`recurrence_transitions`: [B, T, H, K] complex."""
    return torch.linalg.eigvals(recurrence_transitions(record).double())
