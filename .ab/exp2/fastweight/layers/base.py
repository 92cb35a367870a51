"""What every token mixer shares: the call convention, the mode switch and the cache.

A mixer maps ``x [B, T, D] -> y [B, T, D]``. ``forward(x, cache=None, shared=None)``:

- ``cache`` is None (training: nothing kept) or a dict the layer reads its past from and
  writes its new past into, in place: the recurrent state ``"state"`` ``[B, H, K, V]``
  (fp32), the short-conv inputs ``"conv_*"``, the last token ``"shift"``, the SWA window.
  Its size does not grow with the sequence for any linear mixer.
- ``shared`` is a per-call dict the model passes through all layers: ``"offset"`` (tokens
  already in the cache, for rotary positions), for packed sequences (B = 1; with a cache, one
  state and one convolution tail per sequence, where the layer supports it) ``"cu_seqlens"`` [N+1]
  and ``"positions"`` [T] (each token's index in its own sequence),
  and values one layer hands to later ones (RWKV-7's value residual ``"v_first"``); under
  context parallelism ``"context_parallel"`` (a :class:`fastweight.context_parallel.ContextGroup`:
  the recurrence, the short convolutions and the token shift then reach across ranks).

The recurrence runs in ``chunk`` mode (training, prefill) or ``fused_recurrent`` mode
(decoding: not training and T <= ``cfg.recurrent_threshold``), chosen per call.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fastweight.layers.linear_op import linear_op


class Mixer(nn.Module):
    """Base class of all token mixers (see the module docstring for the call convention)."""

    recurrent_threshold = 64

    def mode(self, T: int) -> str:
        return "fused_recurrent" if (not self.training and T <= self.recurrent_threshold) else "chunk"

    def recur(self, op: str, cache: dict | None, shared: dict | None, *, scale: float, **tensors) -> torch.Tensor:
        """Run the layer's recurrence from ``cache["state"]`` and store the final state back."""
        T = next(t for t in tensors.values() if isinstance(t, torch.Tensor)).shape[1]
        ctx = packed(shared, "context_parallel")
        if ctx is not None:
            from fastweight.context_parallel import context_parallel
            mode = self.mode(T)

            def run(scale, initial_state=None, output_final_state=False, cu_seqlens=None, **tensors):
                return linear_op(op, mode, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, **tensors)
            run.__name__ = f"{mode}_{op}"   # names the mechanism (its transition's structure)
            return context_parallel(run, scale=scale, group=ctx, **tensors)[0]
        initial = None if cache is None else cache.get("state")
        o, final = linear_op(op, self.mode(T), scale=scale, initial_state=initial,
                             output_final_state=cache is not None, cu_seqlens=packed(shared, "cu_seqlens"),
                             **tensors)
        if cache is not None:
            cache["state"] = final
        return o

    @staticmethod
    def conv(conv: nn.Module, x: torch.Tensor, cache: dict | None, name: str, shared: dict | None) -> torch.Tensor:
        """Apply a ShortConv, keeping its last inputs in ``cache[name]``; under context parallelism
        its history is the previous rank's last inputs."""
        ctx = packed(shared, "context_parallel")
        if ctx is not None and conv.kernel_size > 1:
            from fastweight.context_parallel import halo
            return conv(x, halo(x, conv.kernel_size - 1, ctx))[0]
        # packed sequences with a cache: per-sequence histories (cu_seqlens); without one, none kept
        cu = packed(shared, "cu_seqlens") if cache is not None else None
        y, tail = conv(x, None if cache is None else cache.get(name), packed(shared, "positions"), cu)
        if cache is not None:
            cache[name] = tail
        return y

    @staticmethod
    def shift(shift: nn.Module, x: torch.Tensor, cache: dict | None, shared: dict | None,
              name: str = "shift") -> torch.Tensor:
        """RWKV's token shift x_{t-1}, keeping the last token in ``cache[name]`` (under context
        parallelism the first token's predecessor is the previous rank's last)."""
        ctx = packed(shared, "context_parallel")
        if ctx is not None:
            from fastweight.context_parallel import halo
            return shift(x, halo(x, 1, ctx))[0]
        cu = packed(shared, "cu_seqlens") if cache is not None else None
        prev, last = shift(x, None if cache is None else cache.get(name), packed(shared, "positions"), cu)
        if cache is not None:
            cache[name] = last
        return prev


def sequence_positions(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """Each of T packed tokens' index in its own sequence ([T], int64)."""
    cu = cu_seqlens.to(device)
    t = torch.arange(T, device=device)
    return t - cu[torch.searchsorted(cu[1:], t, right=True)]


def packed(shared: dict | None, name: str):
    """``shared[name]`` for packed sequences (``"cu_seqlens"``, ``"positions"``), else None."""
    return None if shared is None else shared.get(name)


def positions(shared: dict | None):
    """Rotary positions: the in-sequence positions [T] of packed sequences, else the cache offset."""
    if shared is None:
        return 0
    return shared["positions"] if shared.get("positions") is not None else shared.get("offset", 0)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H * D] -> [B, T, H, D]."""
    return x.unflatten(-1, (n_heads, -1))
