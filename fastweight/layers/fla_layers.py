"""fla's layer classes, on fastweight's mixers: the same constructor arguments, the same
``forward(hidden_states, attention_mask=None, past_key_values=None, use_cache=False, ...)``
returning ``(o, None, past_key_values)``, and the same parameter names, so that code written
against ``fla.layers`` and the state dicts of fla checkpoints carry over.

    from fastweight.layers import GatedDeltaNet          # in place of: from fla.layers import GatedDeltaNet
                                                          # (and DeltaNet, GatedLinearAttention,
                                                          #  KimiDeltaAttention)
    layer = GatedDeltaNet(hidden_size=1024, head_dim=128, num_heads=8, expand_v=2)
    o, _, _ = layer(x)                                    # x [B, T, hidden_size]

Padding: ``attention_mask`` [B, T] (1 = token, 0 = padding, on either side) packs the tokens into
one varlen batch, as fla does, and the output is zero at padded positions. Packed input:
``cu_seqlens`` [N+1] with B = 1. Caching: ``past_key_values`` is this library's per-layer dict
(``fastweight.layers.base``: the state and the convolutions' tails); fla's ``Cache`` objects are
refused by name. An fla option a class does not implement (its docstring lists them: KDA's
``num_v_heads``, GatedDeltaNet's ``use_gate=False``, GLA's short convolutions, ...) raises an
error naming it, and so does an unknown keyword (fla's layers ignore those).
"""

from __future__ import annotations

import torch

from fastweight.layers.base import sequence_positions
from fastweight.layers.delta import DeltaRuleMixer
from fastweight.layers.gated import DecayMixer

# our submodule name -> fla's, in the state dict
CONVS = {"q_conv.": "q_conv1d.", "k_conv.": "k_conv1d.", "v_conv.": "v_conv1d."}


def _refuse(layer: str, **given):
    """NotImplementedError naming the first fla argument (name=(value, the one supported)) that differs."""
    for name, (value, ours) in given.items():
        if value != ours:
            raise NotImplementedError(f"{layer}: `{name}={value!r}` is not supported (only {ours!r})")


def _head_dims(layer: str, hidden_size: int, expand_k: float, expand_v: float, num_heads: int) -> tuple[int, int]:
    """fla's sizing: key and value widths ``hidden_size * expand_k / expand_v`` split into heads."""
    dims = []
    for name, width in (("expand_k", hidden_size * expand_k), ("expand_v", hidden_size * expand_v)):
        if width != round(width) or round(width) % num_heads:
            raise ValueError(f"{layer}: `hidden_size * {name}` ({width}) must be an integer multiple of "
                             f"`num_heads` ({num_heads})")
        dims.append(round(width) // num_heads)
    return dims[0], dims[1]


class _FlaLayer:
    """fla's call convention over one of our mixers (module docstring; mixed in before the mixer's
    class); ``FLA_NAMES`` renames the state dict's keys to fla's and back."""

    FLA_NAMES: dict = CONVS

    def _fla_setup(self, cfg, variant: str, mode: str, layer_idx, unknown: dict):
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"{type(self).__name__}: `mode` must be 'chunk' or 'fused_recurrent', got {mode!r}")
        unknown = sorted(set(unknown) - {"use_output_gate"})
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword argument(s) {unknown}")
        self.MIXER.__init__(self, cfg, variant)
        self.hidden_size, self.num_heads, self.head_dim = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.num_v_heads = cfg.v_heads
        self.head_v_dim, self.layer_idx, self.fla_mode = cfg.head_v_dim, layer_idx, mode
        self.register_state_dict_post_hook(_to_fla_names)
        self.register_load_state_dict_pre_hook(_from_fla_names)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: dict | None = None, use_cache: bool | None = False,
                output_attentions: bool | None = False, cu_seqlens: torch.Tensor | None = None, **kwargs):
        name = type(self).__name__
        if past_key_values is not None and not isinstance(past_key_values, dict):
            raise TypeError(f"{name}: `past_key_values` must be fastweight's per-layer dict (or None), got "
                            f"{type(past_key_values).__name__} (fla's Cache is not supported)")
        cache = past_key_values if past_key_values is not None else ({} if use_cache else None)
        x, B, T = hidden_states, hidden_states.shape[0], hidden_states.shape[1]
        keep = None
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(f"`attention_mask` must be [batch, seq_len] = {(B, T)}, "
                                 f"got {tuple(attention_mask.shape)}")
            if cu_seqlens is not None:
                raise ValueError("`attention_mask` and `cu_seqlens` cannot be combined")
            if not bool(attention_mask.bool().all()):
                if cache is not None:
                    raise ValueError(f"{name}: a padding `attention_mask` with a cache is not supported")
                keep = attention_mask.bool().flatten()
                lengths = attention_mask.bool().sum(1)
                cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
                x = x.flatten(0, 1)[keep][None]
        shared = None
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError(f"{name}: `cu_seqlens` (packed sequences) with a cache is not supported")
            shared = dict(cu_seqlens=cu_seqlens, positions=sequence_positions(cu_seqlens, x.shape[1], x.device))
        o = super().forward(x, cache, shared)
        if keep is not None:
            o = o.new_zeros(B * T, o.shape[-1]).index_copy(0, keep.nonzero().squeeze(1), o[0]).view(B, T, -1)
        return o, None, cache

    def mode(self, T: int) -> str:
        return "fused_recurrent" if (self.fla_mode == "fused_recurrent" or (not self.training and T <= 64)) \
            else "chunk"


class _FlaDeltaLayer(_FlaLayer, DeltaRuleMixer):
    MIXER = DeltaRuleMixer


class DeltaNet(_FlaDeltaLayer):
    """fla's ``DeltaNet`` layer (Yang et al., 2024):

        q, k = L2(SiLU(conv(W_q x))), L2(SiLU(conv(W_k x)));  v = SiLU(conv(W_v x))
        beta = sigmoid(W_b x) (x2 with allow_neg_eigval)
        S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
        y = W_o RMSNorm(o)

    with fla's arguments: key and value widths ``hidden_size * expand_k`` and ``hidden_size *
    expand_v``, split into ``num_heads`` heads; ``d_model`` is an alias of ``hidden_size``."""

    def __init__(self, mode: str = "chunk", d_model: int | None = None, hidden_size: int = 1024,
                 expand_k: float = 1.0, expand_v: float = 1.0, num_heads: int = 4, use_beta: bool = True,
                 use_gate: bool = False, use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 allow_neg_eigval: bool = False, layer_idx: int | None = None, qk_activation: str = "silu",
                 qk_norm: str = "l2", norm_eps: float = 1e-5, use_output_norm: bool = True, **kwargs):
        hidden_size = hidden_size if d_model is None else d_model
        _refuse("DeltaNet", use_beta=(use_beta, True), use_gate=(use_gate, False),
                use_output_norm=(use_output_norm, True),
                use_short_conv=(use_short_conv, True), conv_bias=(conv_bias, False),
                qk_activation=(qk_activation, "silu"), qk_norm=(qk_norm, "l2"))
        head_k, head_v = _head_dims("DeltaNet", hidden_size, expand_k, expand_v, num_heads)
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, mixer="deltanet",
                       head_dim=head_k, expand_v=head_v / head_k, allow_neg_eigval=allow_neg_eigval,
                       use_short_conv=use_short_conv, conv_size=conv_size, norm_eps=norm_eps)
        self._fla_setup(cfg, "deltanet", mode, layer_idx, kwargs)
        self.expand_k, self.expand_v = expand_k, expand_v
        self.key_dim, self.value_dim = head_k * num_heads, head_v * num_heads


class GatedDeltaNet(_FlaDeltaLayer):
    """fla's ``GatedDeltaNet`` layer (Yang et al., 2024):

        q, k = L2(SiLU(conv(W_q x))), L2(SiLU(conv(W_k x)));  v = SiLU(conv(W_v x))
        beta = sigmoid(W_b x) (x2 with allow_neg_eigval);  g = -exp(A_log) softplus(W_a x + dt_bias)
        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
        y = W_o (RMSNorm(o) * SiLU(W_g x))

    with fla's arguments: key heads ``num_heads`` of ``head_dim``, value heads of
    ``head_dim * expand_v``, ``num_v_heads`` of them (grouped value heads: each run of
    ``num_v_heads / num_heads`` value heads shares one query/key head; default ``num_heads``)."""

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: int | None = None, mode: str = "chunk", use_gate: bool = True,
                 use_short_conv: bool = True, allow_neg_eigval: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 output_gate_activation: str = "swish", **kwargs):
        if num_v_heads is not None and (num_v_heads < num_heads or num_v_heads % num_heads):
            raise ValueError(f"GatedDeltaNet: `num_v_heads` ({num_v_heads}) must be a multiple of `num_heads` "
                             f"({num_heads})")
        _refuse("GatedDeltaNet", use_gate=(use_gate, True), use_short_conv=(use_short_conv, True),
                conv_bias=(conv_bias, False), output_gate_activation=(output_gate_activation, "swish"))
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, n_v_heads=num_v_heads,
                       mixer="gdn", head_dim=head_dim, expand_v=expand_v, allow_neg_eigval=allow_neg_eigval,
                       use_short_conv=use_short_conv, conv_size=conv_size, norm_eps=norm_eps)
        self._fla_setup(cfg, "gdn", mode, layer_idx, kwargs)


class KimiDeltaAttention(_FlaDeltaLayer):
    """fla's ``KimiDeltaAttention`` layer (KDA, Kimi Linear):

        q, k, v as GatedDeltaNet's;  beta = sigmoid(W_b x) (x2 with allow_neg_eigval)
        g = -exp(A_log) softplus(W_f2 W_f1 x + dt_bias)  (one per key channel; A_log per head)
        S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
        y = W_o (RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g))

    with fla's arguments and parameter names (``f_proj.0/1``, ``g_proj.0/1``: the low-rank maps)."""

    FLA_NAMES = {**CONVS, "f_proj.down.": "f_proj.0.", "f_proj.up.": "f_proj.1.", "g_proj.down.": "g_proj.0.",
                 "g_proj.up.": "g_proj.1."}

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = None,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 **kwargs):
        if num_v_heads not in (None, num_heads):
            raise NotImplementedError(f"KimiDeltaAttention: `num_v_heads` ({num_v_heads}) other than `num_heads` "
                                      f"({num_heads}) is not supported by fastweight's layer (the ops take it)")
        # expand_v: fla's low-rank maps have rank head_v_dim, fastweight's head_dim (equal at 1)
        _refuse("KimiDeltaAttention", expand_v=(expand_v, 1), use_short_conv=(use_short_conv, True),
                safe_gate=(safe_gate, False), lower_bound=(lower_bound, None), conv_bias=(conv_bias, False))
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, mixer="kda",
                       head_dim=head_dim, expand_v=expand_v, allow_neg_eigval=allow_neg_eigval,
                       use_short_conv=use_short_conv, conv_size=conv_size, norm_eps=norm_eps)
        self._fla_setup(cfg, "kda", mode, layer_idx, kwargs)


def _to_fla_names(module, state_dict, prefix, local_metadata):
    for key in list(state_dict):
        for ours, theirs in module.FLA_NAMES.items():
            if key.startswith(prefix + ours):
                state_dict[prefix + theirs + key[len(prefix + ours):]] = state_dict.pop(key)


def _from_fla_names(module, state_dict, prefix, *args):
    for key in list(state_dict):
        for ours, theirs in module.FLA_NAMES.items():
            if key.startswith(prefix + theirs):
                state_dict[prefix + ours + key[len(prefix + theirs):]] = state_dict.pop(key)


class GatedLinearAttention(_FlaLayer, DecayMixer):
    """fla's ``GatedLinearAttention`` layer (Yang et al., 2023), in fla's default form:

        q, k, v = W_q x, W_k x, W_v x;  g = logsigmoid(W_1 W_0 x + b) / 16  (one per key channel)
        S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
        y = W_o (RMSNorm(o) * SiLU(W_g x))

    with fla's arguments (key and value widths ``hidden_size * expand_k`` and ``hidden_size *
    expand_v``, split into ``num_heads`` heads) and parameter names (``gk_proj.0/1``,
    ``g_norm_swish_gate``). The other forms fla offers (short convolutions, grouped key heads,
    a feature map, a clamp, another gate or gate rank) are refused by name."""

    MIXER = DecayMixer
    FLA_NAMES = {"gk_proj.down.": "gk_proj.0.", "gk_proj.up.": "gk_proj.1.", "o_norm.": "g_norm_swish_gate."}

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5, expand_v: float = 1.0,
                 num_heads: int = 4, num_kv_heads: int | None = None, feature_map: str | None = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_output_gate: bool = True, gate_fn: str = "swish", elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 16, gate_low_rank_dim: int = 16,
                 clamp_min: float | None = None, fuse_norm: bool = True, layer_idx: int | None = None, **kwargs):
        from fastweight.layers.gated import GATE_LOGIT_NORMALIZER, GATE_RANK
        _refuse("GatedLinearAttention", num_kv_heads=(num_kv_heads if num_kv_heads != num_heads else None, None),
                feature_map=(feature_map, None), use_short_conv=(use_short_conv, False),
                use_output_gate=(use_output_gate, True), gate_fn=(gate_fn, "swish"),
                elementwise_affine=(elementwise_affine, True), gate_logit_normalizer=(gate_logit_normalizer,
                                                                                    GATE_LOGIT_NORMALIZER),
                gate_low_rank_dim=(gate_low_rank_dim, GATE_RANK), clamp_min=(clamp_min, None),
                fuse_norm=(fuse_norm, True))
        head_k, head_v = _head_dims("GatedLinearAttention", hidden_size, expand_k, expand_v, num_heads)
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, mixer="gla", head_dim=head_k,
                       expand_v=head_v / head_k, conv_size=conv_size, norm_eps=norm_eps)
        self._fla_setup(cfg, "gla", mode, layer_idx, kwargs)
        self.expand_k, self.expand_v = expand_k, expand_v
        self.key_dim, self.value_dim = head_k * num_heads, head_v * num_heads
