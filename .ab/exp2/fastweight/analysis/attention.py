"""The attention map of a trained recurrent model, layer by layer (seed section 2.4).

From a zero state every layer's recurrence is linear in its values,
``o_i = sum_{j <= i} A_ij v_j`` with ``A_ij = scale q_i^T P_i ... P_{j+1} k_j``. To get
``A`` of a layer inside a model, :func:`recorded_recurrences` records the tensors the
layer hands to its op during a forward pass, :func:`recurrence_dplr` maps them onto the
DPLR recurrence as the layer package does, and the fully parallel form
(:mod:`fastweight.chunk.parallel`) gives ``A``. Attention and SWA layers have no
recurrence and are skipped.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fastweight.chunk.parallel import dplr_attention_map
from fastweight.layers import base as layer_base
from fastweight.layers.linear_op import generic_factors


@dataclass
class Recurrence:
    """One call of a layer's recurrence: the op, its tensors (fla's names), scale and output."""

    layer: torch.nn.Module
    op: str
    scale: float
    tensors: dict
    output: torch.Tensor


@contextmanager
def recorded_recurrences():
    """Within the block, every ``Mixer.recur`` call is appended to the yielded list."""
    records = []
    original = layer_base.Mixer.recur

    def recur(self, op, *args, scale, **tensors):
        o = original(self, op, *args, scale=scale, **tensors)
        records.append(Recurrence(self, op, scale, {n: t for n, t in tensors.items()}, o.detach()))
        return o

    layer_base.Mixer.recur = recur
    try:
        yield records
    finally:
        layer_base.Mixer.recur = original


def recurrence_dplr(record: Recurrence) -> dict:
    """The DPLR form of one recorded call, in the core's names (``a`` write direction, ``b`` read):
    ``dict(q, k, a, b, gk, u)`` with ``S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T``.

    The layer's op is mapped onto the DPLR op by its own generic form
    (:func:`fastweight.layers.linear_op.generic_factors`, fla's names: read ``a``, write ``b``), so
    every mixer is covered the way it runs (RWKV-6's bonus ``u`` included).
    """
    f = generic_factors(record.op, dict(record.tensors))
    return dict(q=f["q"], k=f["k"], a=f["b"], b=f["a"], gk=f["gk"], u=f["u"])


def recurrence_attention_map(record: Recurrence) -> torch.Tensor:
    """A [B, H, T, T] of one recorded call, from the fully parallel form
    (:func:`fastweight.chunk.parallel.dplr_attention_map` on :func:`recurrence_dplr`); [B, H, T, T * n]
    for an op whose token takes n steps (Gated DeltaProduct: its values at T * n rows; each token
    reads the state after its last step)."""
    d = {n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in recurrence_dplr(record).items()}
    A = dplr_attention_map(d["q"], d["k"], d["a"], d["b"], d["gk"], u=d["u"], scale=record.scale)
    n = d["k"].shape[1] // record.output.shape[1]
    return A if n == 1 else A[:, :, n - 1::n]


@torch.no_grad()
def layer_attention_maps(model, input_ids: torch.Tensor) -> list:
    """``[(layer index, A [B, H, T, T])]`` for every recurrent layer of ``model`` on ``input_ids``."""
    was_training = model.training
    model.train()  # chunk mode: the layers run the whole sequence at once from a zero state
    try:
        with recorded_recurrences() as records:
            model(input_ids)
    finally:
        model.train(was_training)
    mixers = [block.mixer for block in model.blocks]
    return [(mixers.index(r.layer) if r.layer in mixers else -1, recurrence_attention_map(r)) for r in records]
