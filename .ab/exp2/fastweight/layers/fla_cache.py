"""fla's cache protocol for the fla-named layers (``fastweight.layers.fla_layers``): a layer given
fla 0.6.0's ``fla.models.utils.Cache`` (or any object with the same methods) as ``past_key_values``
reads its past from it and writes its new past back, in fla's layouts, so that our layers and fla's
can share one cache (an fla model's prefill, our layer's decode, and back).

The protocol, as fla's layers use it (``fla.layers.utils.get_layer_cache``/``update_layer_cache``):

    len(cache)                      layers that have a slot
    cache[layer_idx]                None, or a dict 'recurrent_state', 'attn_state', 'conv_state', 'ffn_state'
                                    (an entry None: not yet written)
    cache.update(recurrent_state=..., conv_state=..., layer_idx=i, offset=T)
                                    stores the entries given (None keeps the old one), counts T tokens

Layouts (N sequences, H heads; ours: ``fastweight.layers.base``), per layer class (:class:`FlaLayout`):

| entry                      | fla                                          | ours                     |
|----------------------------|----------------------------------------------|--------------------------|
| recurrent_state            | [N, H, K, V]; [N, H, V, K] where ``v_first`` | ``"state"`` [N, H, K, V] |
| conv_state (a conv)        | [N, D, W]: the last W inputs, newest last    | ``"conv_*"`` [N, W, D]   |
| conv_state (a token shift) | [N, D]: the last token (RWKV-7)              | ``"shift"`` [N, 1, D]    |

``v_first``: where fla's layer passes ``state_v_first=True`` to its op (GatedDeltaNet, KDA, GLA,
HGRN2), and Mamba-2's ssm_state [N, H, head_dim, state_size] (mamba's layout); DeltaNet, Comba and
RWKV-7 keep [N, H, K, V], as we do. For the V-first ones the transpose costs one copy of the state
on the way in and one on the way out, per call (our ops take [N, H, K, V]).

conv_state is one tensor for a layer with one convolution (Mamba-2) or token shift (RWKV-7), and a
tuple in the layer's order for several (q, k, v). The conversions are exact (a transpose, a
reshape): fla keeps W inputs where a width-W causal convolution reads W-1 (its decode step rolls the
oldest column out unread), and the fla-named layers' convolutions keep W as well
(``ShortConv.tail_width``), so the entry written is the one fla's layer writes. A cache is advanced
whenever one is passed (``use_cache`` or not), as this library's dict is.

:class:`LayerCache` is the protocol without fla or transformers: a stack of fla-named layers (distinct
``layer_idx``) shares one, as fla's models share their ``Cache``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

ENTRIES = ("recurrent_state", "attn_state", "conv_state", "ffn_state")


@dataclass(frozen=True)
class FlaLayout:
    """Where one fla layer class keeps its state in fla's cache (module docstring's table).

    ``v_first``: fla's recurrent state is [N, H, V, K] (ours [N, H, K, V]: transposed at the boundary).
    ``conv``: our cache keys of fla's ``conv_state``, in fla's order (``"shift"``: a token shift;
    another key: a short convolution); one key: a tensor, several: a tuple, none: None."""

    v_first: bool
    conv: tuple[str, ...] = ()


def is_protocol_cache(cache) -> bool:
    """Whether ``cache`` (not a dict) speaks fla's protocol: ``len``, ``[layer_idx]`` and an
    ``update`` taking ``recurrent_state`` (transformers' attention caches take key/value states
    and are not this protocol)."""
    if isinstance(cache, dict) or not all(hasattr(cache, n) for n in ("__len__", "__getitem__", "update")):
        return False
    kind = type(cache)
    if kind not in _PROTOCOL_TYPES:
        try:
            params = inspect.signature(cache.update).parameters
        except (TypeError, ValueError):
            params = {}
        _PROTOCOL_TYPES[kind] = "recurrent_state" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return _PROTOCOL_TYPES[kind]


# type -> whether its update takes fla's keywords (the signature is read once per type)
_PROTOCOL_TYPES: dict[type, bool] = {}


def read_layer(cache, layer_idx: int, layout: FlaLayout) -> dict:
    """Our per-layer cache dict from fla's entry ``cache[layer_idx]`` (empty where the layer has none yet)."""
    entry = cache[layer_idx] if len(cache) > layer_idx else None
    ours = {}
    if entry is None:
        return ours
    state = entry.get("recurrent_state")
    if state is not None:
        ours["state"] = state.transpose(-1, -2).contiguous() if layout.v_first else state
    conv = entry.get("conv_state")
    if conv is not None and layout.conv:
        one = len(layout.conv) == 1
        convs = (conv,) if one and isinstance(conv, torch.Tensor) else tuple(conv) if not one and isinstance(
            conv, (tuple, list)) else None
        if convs is None or len(convs) != len(layout.conv):
            held = f"a {type(conv).__name__}" if convs is None else f"{len(convs)} states"
            raise ValueError(f"`past_key_values[{layer_idx}]['conv_state']` holds {held}, the layer keeps "
                             f"{'one tensor' if one else f'a tuple of {len(layout.conv)}'} (another layer's entry?)")
        for key, value in zip(layout.conv, convs):
            if value is not None:
                # [N, D] -> [N, 1, D];  [N, D, W] -> [N, W, D]
                ours[key] = value[:, None] if key == "shift" else value.transpose(1, 2)
    return ours


def write_layer(cache, layer_idx: int, layout: FlaLayout, ours: dict, T: int) -> None:
    """Store our per-layer dict ``ours`` (after a call over T tokens) as fla's entry: ``cache.update``."""
    state = ours.get("state")
    if state is not None and layout.v_first:
        state = state.transpose(-1, -2).contiguous()
    convs = []
    for key in layout.conv:
        value = ours.get(key)
        if value is not None:
            # [N, 1, D] -> [N, D] and [N, W, D] -> [N, D, W], in their own memory (fla's decode kernels
            # update their cache in place)
            value = value[:, 0].clone() if key == "shift" else value.transpose(1, 2).contiguous()
        convs.append(value)
    conv = None if not convs or all(c is None for c in convs) else convs[0] if len(convs) == 1 else tuple(convs)
    cache.update(recurrent_state=state, conv_state=conv, layer_idx=layer_idx, offset=T)


class LayerCache:
    """fla's cache protocol in plain Python (no fla, no transformers): one entry per ``layer_idx``
    (module docstring), the tokens each layer has seen. ``attn_state`` (key and value [N, T, ...])
    is appended along time, to the last ``cache_kwargs["window_size"]`` where given, as fla does."""

    def __init__(self):
        self.states: list[dict | None] = []
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, layer_idx: int) -> dict | None:
        if layer_idx >= len(self.states):
            raise KeyError(f"LayerCache holds {len(self.states)} layers, asked for layer {layer_idx}")
        return self.states[layer_idx]

    def __iter__(self):
        return iter(self.states)

    def update(self, recurrent_state=None, attn_state=None, conv_state=None, ffn_state=None, layer_idx: int = 0,
               offset: int | None = 1, cache_kwargs: dict | None = None) -> dict:
        """Store the entries given for layer ``layer_idx`` (None keeps the old one); count ``offset`` tokens."""
        while len(self.states) <= layer_idx:
            self.states.append(None)
            self.seen.append(0)
        if self.states[layer_idx] is None:
            self.states[layer_idx] = dict.fromkeys(ENTRIES)
        entry = self.states[layer_idx]
        if attn_state is not None:
            window = (cache_kwargs or {}).get("window_size")
            old = entry["attn_state"]
            new = attn_state if old is None else [torch.cat([a, b], 1) for a, b in zip(old, attn_state)]
            entry["attn_state"] = tuple(t if window is None else t[:, -window:] for t in new)
        for name, value in (("recurrent_state", recurrent_state), ("conv_state", conv_state),
                            ("ffn_state", ffn_state)):
            if value is not None:
                entry[name] = value
        self.seen[layer_idx] += 1 if offset is None else offset
        return entry

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens layer ``layer_idx`` has seen (0 before its first call)."""
        layer_idx = layer_idx or 0
        return self.seen[layer_idx] if layer_idx < len(self.seen) else 0

    def _map(self, function) -> None:
        """``function`` applied to every tensor of every entry (tuples and lists kept as such)."""
        def apply(value):
            if isinstance(value, torch.Tensor):
                return function(value)
            return type(value)(apply(v) for v in value) if isinstance(value, (tuple, list)) else value
        self.states = [None if e is None else {n: apply(v) for n, v in e.items()} for e in self.states]

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Keep the sequences ``beam_idx`` (beam search), in every tensor of every entry."""
        self._map(lambda value: value.index_select(0, beam_idx.to(value.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (transformers' contrastive search): :meth:`reorder_cache`."""
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence ``repeats`` times in a row (transformers expands a prompt's cache so)."""
        self._map(lambda value: value.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        """Forget the tokens past ``max_length`` (negative: that many from the end), as fla's cache
        does: only an attention-only entry can roll back (its key/value along time, not cut by a
        window); a recurrent state, a convolution tail or a token shift cannot (NotImplementedError:
        the states before those tokens are not kept), and nothing changes then."""
        lengths = []
        for i, (entry, seen) in enumerate(zip(self.states, self.seen)):
            length = max(0, seen + max_length) if max_length < 0 else max_length
            if length < seen and entry is not None:
                if any(entry.get(n) is not None for n in ("recurrent_state", "conv_state", "ffn_state")):
                    raise NotImplementedError(f"LayerCache.crop({max_length}): layer {i} holds a recurrent state "
                                              f"after {seen} tokens; rolling it back needs the states it "
                                              f"does not keep")
                kv = entry.get("attn_state")
                if kv is not None and kv[0].shape[1] < seen:
                    raise NotImplementedError(f"LayerCache.crop({max_length}): layer {i}'s sliding window "
                                              f"dropped its oldest tokens")
            lengths.append(min(length, seen))
        for entry, length in zip(self.states, lengths):
            if entry is not None and entry.get("attn_state") is not None:
                entry["attn_state"] = tuple(t[:, :length] for t in entry["attn_state"])
        self.seen = lengths

    def reset(self) -> None:
        """Every layer back to no past (the slots stay)."""
        self.states = [None] * len(self.states)
        self.seen = [0] * len(self.seen)
