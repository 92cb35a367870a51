"""fla's layer classes, on fastweight's mixers: the same constructor arguments, the same
``forward(hidden_states, attention_mask=None, past_key_values=None, use_cache=False, ...)``
returning ``(o, None, past_key_values)``, and the same parameter names, so that code written
against ``fla.layers`` and the state dicts of fla checkpoints carry over.

    from fastweight.layers import GatedDeltaNet          # in place of: from fla.layers import GatedDeltaNet
                                                          # (and DeltaNet, GatedLinearAttention,
                                                          #  KimiDeltaAttention, Comba, HGRN2Attention,
                                                          #  Mamba2, RWKV7Attention)
    layer = GatedDeltaNet(hidden_size=1024, head_dim=128, num_heads=8, expand_v=2)
    o, _, _ = layer(x)                                    # x [B, T, hidden_size]

Padding: ``attention_mask`` [B, S] (1 = token, 0 = padding, on either side; its last T columns
are this call's, as generation passes it) packs the tokens into one varlen batch of B sequences, as
fla does, and the output is zero at padded positions. Packed input: ``cu_seqlens`` [N+1] with B = 1.
Both work with a cache (one state and one set of convolution tails per sequence). Caching: ``past_key_values`` is this library's per-layer dict
(``fastweight.layers.base``: the state and the convolutions' tails; ``use_cache=True`` without one
returns a new one), or fla's ``Cache`` (or any object with its protocol, as
``fastweight.layers.fla_cache.LayerCache``): read at ``layer_idx`` and written back in fla's state
layouts, and returned, as fla's layers do (``fastweight/layers/fla_cache.py``). An fla option a
class does not implement (its docstring lists them: KDA's ``num_v_heads``, GatedDeltaNet's
``use_gate=False``, GLA's short convolutions, ...) raises an error naming it, and so does an
unknown keyword (fla's layers ignore those).

``Comba``, ``HGRN2Attention`` and ``RWKV7Attention`` compute fla's form, which differs from the LM's
``comba``, ``hgrn2`` and ``rwkv7`` mixers (their docstrings; ``docs/models.md``): RWKV-7's computation
is here, Comba's and HGRN2's in ``fla_forms.py`` (which ``LMConfig(fla_form=True)`` builds too).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight.layers.base import Mixer, sequence_positions, split_heads
from fastweight.layers.common import ShortConv, at_least_fp32
from fastweight.layers.delta import DeltaRuleMixer
from fastweight.layers.fla_cache import FlaLayout, is_protocol_cache, read_layer, write_layer
from fastweight.layers.fla_forms import CombaFlaMixer, HGRN2FlaMixer
from fastweight.layers.gated import DecayMixer, Mamba2Mixer
from fastweight.layers.rwkv import EXP_MINUS_HALF

# our submodule name -> fla's, in the state dict
CONVS = {"q_conv.": "q_conv1d.", "k_conv.": "k_conv1d.", "v_conv.": "v_conv1d."}
# the q, k, v convolutions' cache keys, in the order of fla's conv_state tuple
QKV_CONVS = ("conv_q", "conv_k", "conv_v")


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
    class); ``FLA_NAMES`` renames the state dict's keys to fla's and back; ``FLA_CACHE`` is where
    fla's layer of that name keeps its state in fla's cache (``fastweight.layers.fla_cache``)."""

    FLA_NAMES: dict = CONVS
    FLA_CACHE: FlaLayout

    def _fla_setup(self, cfg, variant: str, mode: str, layer_idx, unknown: dict):
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"{type(self).__name__}: `mode` must be 'chunk' or 'fused_recurrent', got {mode!r}")
        unknown = sorted(set(unknown) - {"use_output_gate"})
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword argument(s) {unknown}")
        self.MIXER.__init__(self, cfg, *(() if variant is None else (variant,)))
        self.hidden_size, self.num_heads, self.head_dim = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.num_v_heads = cfg.v_heads
        self.head_v_dim, self.layer_idx, self.fla_mode = cfg.head_v_dim, layer_idx, mode
        for module in self.modules():   # fla's conv_state keeps W inputs (fastweight/layers/fla_cache.py)
            if isinstance(module, ShortConv):
                module.tail_width = module.kernel_size
        self.register_state_dict_post_hook(_to_fla_names)
        self.register_load_state_dict_pre_hook(_from_fla_names)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = False,
                output_attentions: bool | None = False, cu_seqlens: torch.Tensor | None = None, **kwargs):
        """``hidden_states`` [B, T, hidden_size] -> ``(o [B, T, hidden_size], None, cache)``.
        ``past_key_values``: None, this library's per-layer dict (updated in place), or a cache with
        fla's protocol (read at ``layer_idx``, written back; ``fastweight.layers.fla_cache``); the cache
        returned is the one passed, else a new dict with ``use_cache``, else None."""
        name = type(self).__name__
        shared_cache = None   # fla's cache protocol (fastweight.layers.fla_cache): read here, written back below
        if past_key_values is not None and not isinstance(past_key_values, dict):
            if not is_protocol_cache(past_key_values):
                raise ValueError(f"{name}: `past_key_values` must be fastweight's per-layer dict, an object with "
                                 f"fla's cache protocol (fla's Cache, fastweight.layers.fla_cache.LayerCache) "
                                 f"or None, got {type(past_key_values).__name__}")
            if self.layer_idx is None:
                raise ValueError(f"{name}: `past_key_values` as fla's cache needs the layer's `layer_idx`")
            shared_cache, past_key_values = past_key_values, read_layer(past_key_values, self.layer_idx,
                                                                        self.FLA_CACHE)
        cache = past_key_values if past_key_values is not None else ({} if use_cache else None)
        x, B, T = hidden_states, hidden_states.shape[0], hidden_states.shape[1]
        keep = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(f"`attention_mask` must be [batch, seq_len] with seq_len >= {T} (its last {T} "
                                 f"columns are this call's tokens), got {tuple(attention_mask.shape)}")
            mask = attention_mask[:, attention_mask.shape[1] - T:].bool()   # T = 0: no columns
            if not bool(mask.all()):
                if cu_seqlens is not None:
                    raise ValueError("a padding `attention_mask` and `cu_seqlens` cannot be combined")
                # one sequence per row (a row of padding only: an empty one, its state carried over)
                keep = mask.flatten()
                lengths = mask.sum(1)
                cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
                x = x.flatten(0, 1)[keep][None]
        shared = self._shared_inputs(kwargs) or None
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise ValueError(f"`cu_seqlens` packs sequences along time: batch size 1, got {x.shape[0]}")
            shared = dict(shared or {}, cu_seqlens=cu_seqlens,
                          positions=sequence_positions(cu_seqlens, x.shape[1], x.device))
        o = super().forward(x, cache, shared)
        if keep is not None:
            o = o.new_zeros(B * T, o.shape[-1]).index_copy(0, keep.nonzero().squeeze(1), o[0]).view(B, T, -1)
        if shared_cache is not None:
            write_layer(shared_cache, self.layer_idx, self.FLA_CACHE, cache, T)
            return o, None, shared_cache
        return o, None, cache

    def _shared_inputs(self, kwargs: dict) -> dict:
        """The forward keywords a class reads (into the mixer's ``shared`` dict; others are ignored)."""
        return {}

    def mode(self, T: int) -> str:
        return "fused_recurrent" if (self.fla_mode == "fused_recurrent" or (not self.training and T <= 64)) \
            else "chunk"


class _FlaDeltaLayer(_FlaLayer, DeltaRuleMixer):
    MIXER = DeltaRuleMixer
    FLA_CACHE = FlaLayout(v_first=True, conv=QKV_CONVS)   # fla's GDN and KDA: state_v_first=True


class DeltaNet(_FlaDeltaLayer):
    """fla's ``DeltaNet`` layer (Yang et al., 2024):

        q, k = L2(SiLU(conv(W_q x))), L2(SiLU(conv(W_k x)));  v = SiLU(conv(W_v x))
        beta = sigmoid(W_b x) (x2 with allow_neg_eigval)
        S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
        y = W_o RMSNorm(o)

    with fla's arguments: key and value widths ``hidden_size * expand_k`` and ``hidden_size *
    expand_v``, split into ``num_heads`` heads; ``d_model`` is an alias of ``hidden_size``."""

    FLA_CACHE = FlaLayout(v_first=False, conv=QKV_CONVS)

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
          = lower_bound * sigmoid(exp(A_log) (W_f2 W_f1 x + dt_bias))   (with ``lower_bound`` < 0)
        S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
        y = W_o (RMSNorm(o) * sigmoid(W_g2 W_g1 x + b_g))

    with fla's arguments and parameter names (``f_proj.0/1``, ``g_proj.0/1``: the low-rank maps, of
    rank ``head_dim * expand_v``). ``num_v_heads``: grouped value heads. ``safe_gate`` only selects
    fla's tensor-core kernel for gates in [lower_bound, 0) (the same function; ``lower_bound`` in
    [-5, 0) required, as fla's op does); the bounded gate is formed in PyTorch before the op."""

    FLA_NAMES = {**CONVS, "f_proj.down.": "f_proj.0.", "f_proj.up.": "f_proj.1.", "g_proj.down.": "g_proj.0.",
                 "g_proj.up.": "g_proj.1."}

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = None,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 **kwargs):
        if num_v_heads is not None and (num_v_heads < num_heads or num_v_heads % num_heads):
            raise ValueError(f"KimiDeltaAttention: `num_v_heads` ({num_v_heads}) must be a multiple of `num_heads` "
                             f"({num_heads})")
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"KimiDeltaAttention: `safe_gate=True` needs `lower_bound` in [-5, 0), "
                             f"got {lower_bound!r}")
        _refuse("KimiDeltaAttention", use_short_conv=(use_short_conv, True), conv_bias=(conv_bias, False))
        from fastweight.models.config import LMConfig
        head_v = int(head_dim * expand_v)
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, n_v_heads=num_v_heads,
                       mixer="kda", head_dim=head_dim, expand_v=expand_v, allow_neg_eigval=allow_neg_eigval,
                       use_short_conv=use_short_conv, conv_size=conv_size, norm_eps=norm_eps,
                       kda_gate_rank=None if head_v == head_dim else head_v, kda_lower_bound=lower_bound)
        self._fla_setup(cfg, "kda", mode, layer_idx, kwargs)
        self.safe_gate = safe_gate


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
    FLA_CACHE = FlaLayout(v_first=True)

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


class Comba(_FlaLayer, CombaFlaMixer):
    """fla's ``Comba`` layer (Hu et al., 2025), as fla 0.6.0 computes it:

        q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))   (k and q not yet normalised)
        p = sigmoid(decay) * k                           (use_inner_decay; else p = k)
        q <- q - D * p                                   (use_output_correction: o_t = S_t^T (q_t - D p_t))
        q, k, p <- L2(q), L2(k), L2(p);  beta = sigmoid(W_b x);  g = -exp(A_log) softplus(W_a x + dt_bias)
        S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T,   o_t = S_t^T q_t / sqrt(d_k)
        y = W_o (RMSNorm(o) * sigmoid(W_g x))            (use_output_gate; else W_o RMSNorm(o))

    ``decay`` and ``D`` are per key head. fla normalises p after scaling, so ``decay`` reaches the
    recurrence only through the correction (p = L2(k)); the paper's p = d k keeps |p| = d. This
    class is fla's form, for fla's checkpoints; the LM's ``comba`` mixer is the paper's p = d L2(k)
    without the correction (``docs/models.md``). Grouped value heads: ``num_v_heads``."""

    MIXER = CombaFlaMixer
    FLA_NAMES = {**CONVS, "inner_decay": "decay"}
    FLA_CACHE = FlaLayout(v_first=False, conv=QKV_CONVS)

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
                 use_output_gate: bool = True, use_output_correction: bool = True, use_inner_decay: bool = True,
                 correction_factor: float = 1.0, conv_size: int = 4, conv_bias: bool = False,
                 layer_idx: int | None = None, norm_eps: float = 1e-5, **kwargs):
        if num_v_heads is not None and (num_v_heads < num_heads or num_v_heads % num_heads):
            raise ValueError(f"Comba: `num_v_heads` ({num_v_heads}) must be a multiple of `num_heads` ({num_heads})")
        _refuse("Comba", use_short_conv=(use_short_conv, True), conv_bias=(conv_bias, False))
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, n_v_heads=num_v_heads,
                       mixer="comba", head_dim=head_dim, expand_v=expand_v, conv_size=conv_size, norm_eps=norm_eps)
        self._fla_setup(cfg, "comba", mode, layer_idx, kwargs)
        self.set_options(norm_eps, use_output_gate, use_output_correction, use_inner_decay, correction_factor)


class HGRN2Attention(_FlaLayer, HGRN2FlaMixer):
    """fla's ``HGRN2Attention`` layer (Qin et al., 2024), as fla 0.6.0 computes it:

        q = SiLU(W_q x);  f = W_f x;  i = W_i x;  log alpha = logsigmoid(f)
        with ``lower_bound`` (a forward argument, [hidden_size] in (0, 1); layers after the first):
            alpha = lower_bound + (1 - lower_bound) sigmoid(f)   (HGRN's forget-gate lower bound)
        S_t = Diag(alpha_t) S_{t-1} + (1 - alpha_t) i_t^T,   o_t = S_t^T q_t / sqrt(expand_ratio)
        y = W_o RMSNorm(o)                               (one RMSNorm over all heads jointly, eps 1e-5:
                                                          fla's rms_norm_linear default, whatever norm_eps)

    Heads: ``hidden_size / expand_ratio`` (or ``num_heads`` when ``expand_ratio`` is None), each with
    a forget/key width of ``expand_ratio`` and a value width of ``hidden_size / num_heads``. fla's
    models compute the lower bounds from a model-level parameter ([n_layers, hidden_size]: softmax
    over layers, cumulative sum); this layer takes one per call, as fla's does. The LM's ``hgrn2``
    mixer normalises per head, without the scale and the lower bound (``docs/models.md``)."""

    MIXER = HGRN2FlaMixer
    FLA_NAMES = {"k_proj.": "f_proj.", "v_proj.": "i_proj.", "o_norm.": "g_norm."}
    FLA_CACHE = FlaLayout(v_first=True)

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, num_heads: int | None = None,
                 expand_ratio: int | None = 128, use_short_conv: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, elementwise_affine: bool | None = True, norm_eps: float = 1e-5,
                 layer_idx: int | None = None, **kwargs):
        if expand_ratio is None and num_heads is None:
            raise ValueError("HGRN2Attention: one of `expand_ratio` or `num_heads` must be given")
        num_heads = hidden_size // expand_ratio if expand_ratio is not None else num_heads
        expand_ratio = hidden_size // num_heads if expand_ratio is None else expand_ratio
        if hidden_size % num_heads:
            raise ValueError(f"HGRN2Attention: `hidden_size` ({hidden_size}) must be a multiple of the number of "
                             f"heads ({num_heads})")
        _refuse("HGRN2Attention", use_short_conv=(use_short_conv, False), elementwise_affine=(elementwise_affine, True))
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, mixer="hgrn2",
                       head_dim=expand_ratio, expand_v=(hidden_size // num_heads) / expand_ratio, norm_eps=norm_eps)
        self._fla_setup(cfg, "hgrn2", mode, layer_idx, kwargs)
        self.expand_ratio, self.forget_dim, self.input_dim = expand_ratio, num_heads * expand_ratio, hidden_size

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = False, output_attentions: bool | None = False,
                lower_bound: torch.Tensor | None = None, **kwargs):
        """fla's call, ``lower_bound`` [hidden_size] its sixth parameter as in fla (fla's models pass it by
        name; a positional call lands on it too); the rest as ``_FlaLayer.forward``."""
        return super().forward(hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                               lower_bound=lower_bound, **kwargs)

    def _shared_inputs(self, kwargs: dict) -> dict:
        return {} if kwargs.get("lower_bound") is None else {"lower_bound": kwargs["lower_bound"]}


class Mamba2(_FlaLayer, Mamba2Mixer):
    """fla's ``Mamba2`` layer (Dao & Gu, 2024; the names of ``mamba_ssm``'s ``Mamba2Simple``):

        z, xBC, dt = in_proj(x);  x, B, C = SiLU(conv1d(xBC));  dt = softplus(dt + dt_bias)
        h_t = exp(-exp(A_log) dt_t) h_{t-1} + dt_t B_t x_t^T,   y_t = C_t^T h_t + D x_t
        out = out_proj(RMSNorm(y * SiLU(z)))

    with ``intermediate_size = expand * hidden_size`` in heads of ``head_dim``, state size
    ``state_size``, one (B, C) group. Refused by name: ``n_groups > 1``, a conv or projection bias
    other than fla's default, ``D_has_hdim``, ``rmsnorm=False``, ``norm_before_gate``, a ``dt_limit``,
    another activation."""

    MIXER = Mamba2Mixer
    FLA_NAMES = {}
    FLA_CACHE = FlaLayout(v_first=True, conv=("conv",))   # mamba's ssm_state [N, H, head_dim, state_size]

    def __init__(self, num_heads: int | None = None, head_dim: int = 64, hidden_size: int = 2048,
                 state_size: int = 128, expand: int = 2, n_groups: int = 1, conv_kernel: int = 4,
                 conv_init: float | None = None, use_conv_bias: bool = True, hidden_act: str = "silu",
                 A_init_range: tuple = (1, 16), D_has_hdim: bool = False, rmsnorm: bool = True,
                 norm_before_gate: bool = False, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, dt_limit: tuple = (0.0, float("inf")), use_bias: bool = False,
                 norm_eps: float = 1e-5, chunk_size: int = 256, layer_idx: int | None = None,
                 backend: str = "cuda", **kwargs):
        if (expand * hidden_size) % head_dim or num_heads not in (None, 0, expand * hidden_size // head_dim):
            raise ValueError(f"Mamba2: `expand * hidden_size` ({expand * hidden_size}) must be `num_heads * head_dim` "
                             f"(head_dim {head_dim}, num_heads {num_heads})")
        _refuse("Mamba2", n_groups=(n_groups, 1), use_conv_bias=(use_conv_bias, True), hidden_act=(hidden_act, "silu"),
                D_has_hdim=(D_has_hdim, False), rmsnorm=(rmsnorm, True), norm_before_gate=(norm_before_gate, False),
                dt_limit=(tuple(dt_limit), (0.0, float("inf"))), use_bias=(use_bias, False))
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=1, mixer="mamba2", head_dim=state_size,
                       mamba_expand=expand, mamba_head_dim=head_dim, conv_size=conv_kernel, norm_eps=norm_eps)
        self._fla_setup(cfg, None, "chunk", layer_idx, kwargs)
        self.num_heads, self.head_dim, self.ssm_state_size = self.n_heads, head_dim, state_size
        self.intermediate_size, self.n_groups, self.expand = self.d_inner, n_groups, expand
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)


def _rwkv7_rank(hidden_size: int, scale: float, factor: float) -> int:
    """fla's default LoRA rank of an RWKV-7 gate: ``scale * sqrt(hidden_size) * factor``, to a multiple of 32, >= 32."""
    return max(32, int(round(scale * hidden_size ** 0.5 * factor / 32) * 32))


class _RWKV7Mixer(Mixer):
    """RWKV7Attention's computation (its docstring); its parameters are made by the class."""

    def __init__(self, cfg):
        Mixer.__init__(self)

    def _make_parameters(self, D: int, H: int, V: int, ranks: dict, first: bool, eps: float):
        """The parameters (zeros, as fla's layer before its init): ``D`` wide, ``H`` heads, value
        width ``V``, LoRA ranks ``ranks`` (w, a, v, g); no ``v_lora`` when ``first``; ``eps`` the GroupNorm's."""
        from fastweight.layers.common import LowRank, TokenShift
        K = D // H
        self.shift_x = TokenShift()
        for c in "rwkvag":
            setattr(self, f"x_{c}", nn.Parameter(torch.zeros(1, 1, D)))
        self.k_k = nn.Parameter(torch.zeros(D))
        self.k_a = nn.Parameter(torch.zeros(D))
        self.r_k = nn.Parameter(torch.zeros(H, K))
        self.r_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, V, bias=False)
        self.o_proj = nn.Linear(V, D, bias=False)
        self.w_lora = LowRank(D, ranks["w"], D, activation="tanh", bias=True)
        self.v_lora = None if first else LowRank(D, ranks["v"], V, activation=None, bias=True)
        self.a_lora = LowRank(D, ranks["a"], D, activation=None, bias=True)
        self.g_lora = LowRank(D, ranks["g"], V, activation="sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(H, V, eps=eps, affine=True)

    no_weight_decay = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "r_k")   # vectors (fastweight.optim.decays)

    @torch.no_grad()
    def reset_layer_parameters(self, layer_idx: int, n_layers: int) -> None:
        """The official initial vectors for this layer's depth (``fastweight.layers.rwkv.rwkv7_init``:
        token-shift mixes, the decay, learning-rate and value-residual logits as the LoRAs' output
        biases, k_k, k_a, r_k), in place of the zeros the layer is made with; the LM calls it
        after its generic init (a model trained from scratch; a converted one loads its weights)."""
        from fastweight.layers.rwkv import rwkv7_init
        H, K = self.r_k.shape
        init = rwkv7_init(self.x_r.shape[-1], H, K, self.v_proj.out_features // H, layer_idx, n_layers)
        for i, c in enumerate("rwkvag"):
            getattr(self, f"x_{c}").copy_(init["mu"][i].view_as(getattr(self, f"x_{c}")))
        for lora, name in ((self.w_lora, "w0"), (self.a_lora, "a0"), (self.v_lora, "v0")):
            if lora is not None:
                lora.up.bias.copy_(init[name])
        self.k_k.copy_(init["xi"].flatten())
        self.k_a.copy_(init["alpha"].flatten())
        self.r_k.copy_(init["rho"])

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        H = self.num_heads
        xx = self.shift(self.shift_x, x, cache, shared) - x
        xr, xw, xk, xv, xa, xg = (torch.addcmul(x, xx, getattr(self, f"x_{c}")) for c in "rwkvag")
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        w = -EXP_MINUS_HALF * torch.sigmoid(at_least_fp32(self.w_lora(xw)))
        if self.v_lora is None:
            shared.get("_out", shared)["v_first"] = v
        elif shared.get("v_first") is None:
            raise ValueError(f"RWKV7Attention (layer_idx {self.layer_idx}): `v_first` (layer 0's value) is required")
        else:
            v = torch.lerp(v, shared["v_first"].to(v.dtype), torch.sigmoid(self.v_lora(xv)))
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = F.normalize(split_heads(k * self.k_k, H), dim=-1, p=2.0)
        k = k.addcmul(k * (a - 1), self.k_a)
        r, w, k, a = (split_heads(t, H) for t in (r, w, k, a))
        v = split_heads(v, H)
        o = self.recur("rwkv7", cache, shared, scale=1.0, r=r, w=w, k=k, v=v, a=-kk, b=kk * a)
        B, T = x.shape[:2]
        o = self.g_norm(o.reshape(B * T, -1)).view(B, T, -1)
        o = o + ((r * k * self.r_k.to(r.dtype)).sum(-1, keepdim=True) * v).flatten(-2)
        return self.o_proj(o * g)


class RWKV7Attention(_FlaLayer, _RWKV7Mixer):
    """fla's ``RWKV7Attention`` layer (RWKV-7 "Goose" time mixing, Peng et al., 2025), as fla 0.6.0
    and the official ``RWKV_x070`` code compute it:

        x^c = x + (x_{t-1} - x) * x_c              for c in r, w, k, v, a, g  (token shift)
        r, k, v = W_r x^r, W_k x^k, W_v x^v;   w = -exp(-1/2) sigmoid(lora_w(x^w))   (log decay)
        v <- lerp(v, v_first, sigmoid(lora_v(x^v)))  (layers after the first: the value residual)
        a = sigmoid(lora_a(x^a));  g = lora_g(x^g) (sigmoid inside);  kk = L2(k * k_k) per head
        k <- k * (1 + (a - 1) * k_a)
        S_t = (Diag(exp w_t) - kk_t (a_t kk_t)^T) S_{t-1} + k_t v_t^T,   o_t = S_t^T r_t
        y = W_o ((GroupNorm(o) + ((r * k * r_k).sum per head) v) * g)

    GroupNorm: one group per head (per-head mean and variance, a weight and bias per channel,
    eps ``head_dim * norm_eps``: 64e-5 at fla's defaults). Each LoRA has its own rank
    (``decay_low_rank_dim``, ``a_low_rank_dim``, ``v_low_rank_dim``, ``gate_low_rank_dim``; fla's
    defaults from ``hidden_size``). Layer 0 has no ``v_lora``. ``forward`` takes and returns
    ``v_first`` as fla's does: ``(o, None, past_key_values, v_first)``. This is a layer of its own
    (the LM's ``rwkv7`` mixer keeps its form: a per-head RMSNorm, one rank; ``docs/models.md``)."""

    MIXER = _RWKV7Mixer
    FLA_NAMES = {f"{n}_lora.{ours}.": f"{n}_lora.lora.{theirs}." for n in "wavg"
                 for ours, theirs in (("down", 0), ("up", 2))}
    FLA_CACHE = FlaLayout(v_first=False, conv=("shift",))

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, head_dim: int | None = 64,
                 num_heads: int | None = None, decay_low_rank_dim: int | None = None,
                 gate_low_rank_dim: int | None = None, a_low_rank_dim: int | None = None,
                 v_low_rank_dim: int | None = None, elementwise_affine: bool | None = True, norm_eps: float = 1e-5,
                 layer_idx: int | None = None, fuse_norm: bool = False, value_dim: int | None = None,
                 num_hidden_layers: int | None = None, **kwargs):
        if head_dim is None and num_heads is None:
            raise ValueError("RWKV7Attention: one of `head_dim` or `num_heads` must be given")
        H = hidden_size // head_dim if head_dim is not None else num_heads
        if hidden_size % H:
            raise ValueError(f"RWKV7Attention: `hidden_size` ({hidden_size}) must be a multiple of the heads ({H})")
        K, value_dim = hidden_size // H, value_dim or hidden_size
        _refuse("RWKV7Attention", elementwise_affine=(elementwise_affine, True))
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=H, mixer="rwkv7", head_dim=K,
                       expand_v=value_dim / hidden_size, norm_eps=norm_eps)
        self._fla_setup(cfg, None, mode, layer_idx, kwargs)
        factor = K / 64
        ranks = dict(w=decay_low_rank_dim or _rwkv7_rank(hidden_size, 2.5, factor),
                     a=a_low_rank_dim or _rwkv7_rank(hidden_size, 2.5, factor),
                     v=v_low_rank_dim or _rwkv7_rank(hidden_size, 1.7, factor),
                     g=gate_low_rank_dim or _rwkv7_rank(hidden_size, 5.0, 1.0))
        self.decay_low_rank_dim, self.a_low_rank_dim = ranks["w"], ranks["a"]
        self.v_low_rank_dim, self.gate_low_rank_dim = ranks["v"], ranks["g"]
        self.key_dim, self.value_dim, self.fuse_norm, self.num_hidden_layers = hidden_size, value_dim, fuse_norm, \
            num_hidden_layers
        self._make_parameters(hidden_size, H, value_dim, ranks, layer_idx == 0, K * norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = False,
                output_attentions: bool | None = False, v_first: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, **kwargs):
        """fla's call: ``(o, None, past_key_values, v_first)``; ``v_first`` [B, T, value_dim] is
        layer 0's value (made there, read by the later layers)."""
        if attention_mask is not None and not bool(attention_mask.bool().all()) and self.layer_idx != 0:
            raise NotImplementedError("RWKV7Attention: a padding `attention_mask` after layer 0 is not supported "
                                      "(`v_first` would need the same packing)")
        out = {}
        o, _, cache = super().forward(hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                                      cu_seqlens=cu_seqlens, v_first=v_first, _out=out, **kwargs)
        return o, None, cache, out.get("v_first", v_first)

    def _shared_inputs(self, kwargs: dict) -> dict:
        shared = {"_out": kwargs["_out"]}
        if kwargs.get("v_first") is not None:
            shared["v_first"] = kwargs["v_first"]
        return shared


class RWKV7OfficialTimeMix(_RWKV7Mixer):
    """The LM's mixer under ``LMConfig(rwkv7_official=True)``: the official RWKV-7 time mixing
    (RWKV7Attention's computation, the LM's call convention; layer ``layer_idx`` 0 writes the value
    residual's ``v_first`` into ``shared``, the later layers read it). The GroupNorm's eps is
    ``cfg.rwkv7_ln_x_eps``: ``64 * norm_eps`` (the official 64e-5 at 1e-5, whatever the head size), or
    ``rwkv7_group_norm_eps`` (fla's ``head_dim * norm_eps``)."""

    def __init__(self, cfg, layer_idx: int):
        _RWKV7Mixer.__init__(self, cfg)
        self.recurrent_threshold = cfg.recurrent_threshold
        self.num_heads, self.layer_idx = cfg.n_heads, layer_idx
        self._make_parameters(cfg.d_model, cfg.n_heads, cfg.n_heads * cfg.head_v_dim,
                              dict(zip("wavg", cfg.rwkv7_lora_ranks)), layer_idx == 0, cfg.rwkv7_ln_x_eps)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        return super().forward(x, cache, {} if shared is None else shared)
