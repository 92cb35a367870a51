"""More of fla's layer classes of the decay family (beside ``fla_layers.py``, which holds GLA, HGRN2
and Mamba-2), with fla 0.6.0's constructor arguments (in its order,
with its defaults), call convention, return tuple and parameter names (``fla_layers``' module
docstring: padding masks, packed ``cu_seqlens``, this library's cache dict or fla's ``Cache``).
Each computes what fla's layer of that name computes, on ``fastweight.ops``; the options they do
not have raise an error naming them.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight import ops
from fastweight.layers.base import Mixer, packed, split_heads
from fastweight.layers.common import GatedRMSNorm, RMSNorm, at_least_fp32, rotary
from fastweight.layers.fla_cache import FlaLayout, is_protocol_cache
from fastweight.layers.fla_layers import _FlaLayer, _head_dims, _refuse
from fastweight.layers.linear_op import current_backend


def _sizes(d_model: int, n_heads: int, head_dim: int, head_v_dim: int, v_heads: int | None = None):
    """What ``_FlaLayer._fla_setup`` reads of a config."""
    return SimpleNamespace(d_model=d_model, n_heads=n_heads, head_dim=head_dim, head_v_dim=head_v_dim,
                           v_heads=v_heads or n_heads)


class _OwnParameters(Mixer):
    """A mixer whose fla-named class makes its parameters itself (fla's names, no renaming) and
    computes in ``_mix(x, cache, shared)``."""

    def __init__(self, cfg):
        Mixer.__init__(self)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        return self._mix(x, cache, shared)


class HGRNAttention(_FlaLayer, _OwnParameters):
    """fla's ``HGRNAttention`` layer (HGRN, Qin et al., 2023), as fla 0.6.0 computes it:

        i, f, g = W_i x, W_f x, W_g x;  log alpha = logsigmoid(f)
        with ``lower_bound`` (a forward argument, [input_dim] in (0, 1); layers after the first):
            alpha = lower_bound + (1 - lower_bound) sigmoid(f)   (HGRN's forget-gate lower bound)
        h_t = alpha_t * h_{t-1} + (1 - alpha_t) * SiLU(i_t)     (elementwise, ``chunk_hgrn``)
        y = W_o (RMSNorm(h) * SiLU(g))                           (one RMSNorm over ``input_dim``)

    ``input_dim = hidden_size * expand_ratio``; the state is [N, input_dim] (fla's cache layout too).
    Refused by name: ``use_short_conv``, ``elementwise_affine=False``."""

    FLA_NAMES = {}
    FLA_CACHE = FlaLayout(v_first=False)
    MIXER = _OwnParameters

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_ratio: int | None = 1,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 elementwise_affine: bool | None = True, norm_eps: float = 1e-5, layer_idx: int = None, **kwargs):
        _refuse("HGRNAttention", use_short_conv=(use_short_conv, False), elementwise_affine=(elementwise_affine, True))
        width = hidden_size * expand_ratio
        if width != int(width):
            raise ValueError(f"HGRNAttention: `hidden_size * expand_ratio` ({width}) must be an integer")
        D = int(width)
        self._fla_setup(_sizes(hidden_size, 1, D, D), None, mode, layer_idx, kwargs)
        self.expand_ratio, self.input_dim = expand_ratio, D
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.i_proj = nn.Linear(hidden_size, D, bias=False)
        self.f_proj = nn.Linear(hidden_size, D, bias=False)
        self.g_proj = nn.Linear(hidden_size, D, bias=False)
        self.g_norm = GatedRMSNorm(D, norm_eps, "silu")
        self.o_proj = nn.Linear(D, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = False, output_attentions: bool | None = False,
                lower_bound: torch.Tensor | None = None, **kwargs):
        """fla's call, ``lower_bound`` [input_dim] its sixth parameter as in fla; the rest as
        ``_FlaLayer.forward``."""
        return super().forward(hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                               lower_bound=lower_bound, **kwargs)

    def _shared_inputs(self, kwargs: dict) -> dict:
        return {} if kwargs.get("lower_bound") is None else {"lower_bound": kwargs["lower_bound"]}

    def _mix(self, x: torch.Tensor, cache: dict | None, shared: dict | None) -> torch.Tensor:
        f = F.logsigmoid(at_least_fp32(self.f_proj(x)))
        lower_bound = None if shared is None else shared.get("lower_bound")
        if lower_bound is not None and self.layer_idx:
            f = torch.logaddexp(lower_bound.log(), torch.log1p(-lower_bound) + f)
        i = F.silu(self.i_proj(x)) * (1 - f.exp()).to(x.dtype)
        run = ops.chunk_hgrn if self.mode(x.shape[1]) == "chunk" else ops.fused_recurrent_hgrn
        o, state = run(i, f, None if cache is None else cache.get("state"), cache is not None,
                       cu_seqlens=packed(shared, "cu_seqlens"), backend=current_backend())
        if cache is not None:
            cache["state"] = state
        return self.o_proj(self.g_norm(o, self.g_proj(x)))
