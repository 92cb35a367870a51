"""The attention map of a trained recurrent model, layer by layer (seed section 2.4).

From a zero state every layer's recurrence is linear in its values,
``o_i = sum_{j <= i} A_ij v_j`` with ``A_ij = scale q_i^T P_i ... P_{j+1} k_j``. To get
``A`` of a layer inside a model, :func:`recorded_recurrences` records the tensors the
layer hands to its op during a forward pass; :func:`layer_attention_maps` runs the same op
again with the values replaced by the identity (``v_j = e_j``, V = T), which returns
``A`` itself: the parallel form of :mod:`fastweight.chunk.parallel`, evaluated by the
layer's own op, so it holds for every mixer (gates, bonus terms and all). Attention and
SWA layers have no recurrence and are skipped.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fastweight.layers import base as layer_base
from fastweight.layers.linear_op import linear_op


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

    def recur(self, op, cache, *, scale, **tensors):
        o = original(self, op, cache, scale=scale, **tensors)
        records.append(Recurrence(self, op, scale, {n: t for n, t in tensors.items()}, o.detach()))
        return o

    layer_base.Mixer.recur = recur
    try:
        yield records
    finally:
        layer_base.Mixer.recur = original


def recurrence_attention_map(record: Recurrence) -> torch.Tensor:
    """A [B, H, T, T] of one recorded call: its op run on identity values from a zero state."""
    v = record.tensors["v"]
    B, T, H = v.shape[:3]
    eye = torch.eye(T, dtype=torch.float32, device=v.device)[None, :, None, :].expand(B, T, H, T).contiguous()
    tensors = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
               for n, t in record.tensors.items()}
    tensors["v"] = eye
    A, _ = linear_op(record.op, "chunk", scale=record.scale, initial_state=None, output_final_state=False,
                     **tensors)
    return A.transpose(1, 2)


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
