"""More of fla's layer classes of the decay family (beside ``fla_layers.py``, which holds GLA, HGRN2
and Mamba-2): HGRN, linear attention, RetNet, RWKV-6, with fla 0.6.0's constructor arguments (in its order,
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
from fastweight.layers.common import GatedRMSNorm, RMSNorm, TokenShift, at_least_fp32, rotary
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


class _Hadamard(nn.Module):
    """fla's ``HadamardFeatureMap``: phi(x) = (W_1 x + b_1) * (W_2 x + b_2), per head."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.layer1 = nn.Linear(head_dim, head_dim)
        self.layer2 = nn.Linear(head_dim, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer1(x) * self.layer2(x)


# fla's parameter-free feature maps (fla's elu_p1 is ELU + 1)
FEATURE_MAPS = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu, "identity": lambda x: x}


class LinearAttention(_FlaLayer, _OwnParameters):
    """fla's ``LinearAttention`` layer (Katharopoulos et al., 2020), as fla 0.6.0 computes it:

        q, k, v = W_q x, W_k x, W_v x   (k, v: ``num_kv_heads`` heads, each repeated for its
                                         ``num_heads / num_kv_heads`` query heads)
        q, k = phi_q(q), phi_k(k)         (``feature_map``: fla's ``elementwise_product``, a learned
                                         Hadamard map (W_1 x + b_1) * (W_2 x + b_2) per head, or
                                         ``elu`` (ELU + 1), ``relu``, ``identity``)
        q <- q / (sum q + 1e-4) with ``norm_q``; k likewise with ``norm_k``
        S_t = S_{t-1} + k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)   (``chunk_linear_attn``; with
              ``do_feature_map_norm``, divided by q_t . sum_{s<=t} k_s / sqrt(d_k), its state (S, z))
        y = W_o RMSNorm(o)                (per head; ``output_norm="identity"``: no norm)

    Key and value widths ``hidden_size * expand_k`` and ``hidden_size * expand_v`` split into
    ``num_heads`` heads. fla's ``fused_chunk`` mode is the same function (run as ``chunk``).
    Refused by name: the ``hedgehog``, ``t2r`` and ``dpfp`` feature maps, ``elementwise_affine=False``."""

    FLA_NAMES = {}
    FLA_CACHE = FlaLayout(v_first=False)
    MIXER = _OwnParameters

    def __init__(self, mode: str = "chunk", hidden_size: str = 1024, expand_k: float = 1.0, expand_v: float = 1.0,
                 num_heads: int = 8, num_kv_heads: int | None = None, feature_map: str = "elementwise_product",
                 tie_feature_map_qk: bool = False, output_norm: str = "rmsnorm", norm_q: bool = False,
                 norm_k: bool = False, do_feature_map_norm: bool = False, elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, layer_idx: int | None = None, **kwargs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"LinearAttention: `num_heads` ({num_heads}) must be a multiple of `num_kv_heads` "
                             f"({num_kv_heads})")
        if feature_map not in ("elementwise_product", *FEATURE_MAPS):
            raise NotImplementedError(f"LinearAttention: `feature_map={feature_map!r}` is not supported (only "
                                      f"'elementwise_product', 'elu', 'relu', 'identity')")
        if output_norm not in ("rmsnorm", "identity"):
            raise ValueError(f"LinearAttention: `output_norm` must be 'rmsnorm' or 'identity', got {output_norm!r}")
        _refuse("LinearAttention", elementwise_affine=(elementwise_affine, True))
        head_k, head_v = _head_dims("LinearAttention", hidden_size, expand_k, expand_v, num_heads)
        self._fla_setup(_sizes(hidden_size, num_heads, head_k, head_v), None,
                        "chunk" if mode == "fused_chunk" else mode, layer_idx, kwargs)
        self.expand_k, self.expand_v, self.num_kv_heads = expand_k, expand_v, num_kv_heads
        self.num_kv_groups = num_heads // num_kv_heads
        self.key_dim, self.value_dim = head_k * num_heads, head_v * num_heads
        self.head_k_dim, self.head_v_dim = head_k, head_v
        self.norm_q, self.norm_k, self.do_feature_map_norm = norm_q, norm_k, do_feature_map_norm
        if feature_map == "elementwise_product":
            self.feature_map_q = _Hadamard(head_k)
            self.feature_map_k = self.feature_map_q if tie_feature_map_qk else _Hadamard(head_k)
        else:
            self.feature_map_q = self.feature_map_k = FEATURE_MAPS[feature_map]
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim // self.num_kv_groups, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim // self.num_kv_groups, bias=False)
        self.norm = RMSNorm(head_v, norm_eps) if output_norm == "rmsnorm" else None
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _mix(self, x: torch.Tensor, cache: dict | None, shared: dict | None) -> torch.Tensor:
        group = self.num_kv_groups
        q = split_heads(self.q_proj(x), self.num_heads)
        k, v = (split_heads(p(x), self.num_kv_heads).repeat_interleave(group, 2) for p in (self.k_proj, self.v_proj))
        q, k = self.feature_map_q(q), self.feature_map_k(k)
        if self.norm_q:
            q = q / (q.sum(-1, keepdim=True) + 1e-4)
        if self.norm_k:
            k = k / (k.sum(-1, keepdim=True) + 1e-4)
        o = self.recur("linear_attn", cache, shared, scale=self.head_k_dim ** -0.5, q=q, k=k, v=v,
                       normalize=self.do_feature_map_norm)
        if self.norm is not None:
            o = self.norm(o)
        return self.o_proj(o.flatten(-2))


class MultiScaleRetention(_FlaLayer, _OwnParameters):
    """fla's ``MultiScaleRetention`` layer (RetNet, Sun et al., 2023), as fla 0.6.0 computes it:

        q, k, v = W_q x, W_k x, W_v x;  q, k = RoPE(q), RoPE(k)   (rotate-half, base 10000, at each
                                         token's position in its sequence, past tokens counted)
        S_t = gamma_h S_{t-1} + k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k),  gamma_h = 1 - 2^(-5-h)
        y = W_o (RMSNorm(o) * SiLU(W_g x))   (per head; ``use_output_gate=False``: W_o RMSNorm(o))

    (``chunk_retention``). Key and value widths ``hidden_size * expand_k`` and ``hidden_size *
    expand_v`` in ``num_heads`` heads; k and v in ``num_kv_heads`` heads, each repeated for its query
    heads. The norm is fla's ``g_norm_swish_gate`` (fused, the default) or ``g_norm`` (``fuse_norm=False``
    or no output gate), the same function. fla's ``fused_chunk`` and ``parallel`` modes are the same
    function (run as ``chunk``). Positions with a cache: this library's dict counts each sequence's
    tokens; with fla's ``Cache``, its ``get_seq_length(layer_idx)``, less each row's padding (fla's rule).
    Refused by name: ``feature_map``, ``use_short_conv``, a ``gate_fn`` other than swish,
    ``elementwise_affine=False``."""

    FLA_NAMES = {}
    FLA_CACHE = FlaLayout(v_first=False)
    MIXER = _OwnParameters

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 1.0, expand_v: float = 2.0,
                 num_heads: int = 8, num_kv_heads: int | None = None, feature_map: str | None = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_output_gate: bool = True, gate_fn: str = "swish", elementwise_affine: bool | None = True,
                 norm_eps: float = 1e-5, fuse_norm: bool = True, layer_idx: int = None, **kwargs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"MultiScaleRetention: `num_heads` ({num_heads}) must be a multiple of `num_kv_heads` "
                             f"({num_kv_heads})")
        _refuse("MultiScaleRetention", feature_map=(feature_map, None), use_short_conv=(use_short_conv, False),
                gate_fn=(gate_fn, "swish"), elementwise_affine=(elementwise_affine, True))
        head_k, head_v = _head_dims("MultiScaleRetention", hidden_size, expand_k, expand_v, num_heads)
        self._fla_setup(_sizes(hidden_size, num_heads, head_k, head_v), None,
                        "chunk" if mode in ("fused_chunk", "parallel") else mode, layer_idx, kwargs)
        self.expand_k, self.expand_v, self.num_kv_heads = expand_k, expand_v, num_kv_heads
        self.num_kv_groups = num_heads // num_kv_heads
        self.key_dim, self.value_dim = head_k * num_heads, head_v * num_heads
        self.head_k_dim, self.head_v_dim = head_k, head_v
        self.use_output_gate, self.use_short_conv, self.conv_size, self.conv_bias = use_output_gate, False, \
            conv_size, conv_bias
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim // self.num_kv_groups, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim // self.num_kv_groups, bias=False)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.fuse_norm_and_gate = fuse_norm and use_output_gate
        norm = GatedRMSNorm(head_v, norm_eps, "silu")
        if self.fuse_norm_and_gate:
            self.g_norm_swish_gate = norm
        else:
            self.g_norm = norm

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = False, output_attentions: bool | None = False,
                **kwargs):
        """fla's call (``_FlaLayer.forward``); with fla's cache, the rotary positions start at its
        ``get_seq_length(layer_idx)`` less each row's padding, as in fla."""
        past = None
        if past_key_values is not None and not isinstance(past_key_values, dict) \
                and is_protocol_cache(past_key_values) and self.layer_idx is not None:
            if not hasattr(past_key_values, "get_seq_length"):
                raise ValueError("MultiScaleRetention: `past_key_values` needs fla's `get_seq_length(layer_idx)` "
                                 "(the rotary positions)")
            seen = past_key_values.get_seq_length(self.layer_idx)
            past = seen
            if attention_mask is not None and seen > 0:
                past = seen + attention_mask.sum(1) - attention_mask.shape[1]
        return super().forward(hidden_states, attention_mask, past_key_values, use_cache, output_attentions,
                               _past=past, **kwargs)

    def _shared_inputs(self, kwargs: dict) -> dict:
        return {} if kwargs.get("_past") is None else {"past": kwargs["_past"]}

    def _mix(self, x: torch.Tensor, cache: dict | None, shared: dict | None) -> torch.Tensor:
        B, T = x.shape[:2]
        cu = packed(shared, "cu_seqlens")
        past = (shared or {}).get("past", 0 if cache is None else cache.get("seen", 0))
        past = torch.as_tensor(past, device=x.device).expand(B if cu is None else len(cu) - 1)   # [N]
        if cu is None:
            positions = past[:, None] + torch.arange(T, device=x.device)                      # [B, T]
        else:
            cu = cu.to(x.device)
            sequence = torch.searchsorted(cu[1:], torch.arange(T, device=x.device), right=True)
            positions = (shared["positions"] + past[sequence])[None]                          # [1, T]
        q = split_heads(self.q_proj(x), self.num_heads)
        k = split_heads(self.k_proj(x), self.num_kv_heads)
        q, k = (torch.cat([rotary(t[b:b + 1], positions[b]) for b in range(t.shape[0])]) for t in (q, k))
        group = self.num_kv_groups
        k = k.repeat_interleave(group, 2)
        v = split_heads(self.v_proj(x), self.num_kv_heads).repeat_interleave(group, 2)
        o = self.recur("retention", cache, shared, scale=self.head_k_dim ** -0.5, q=q, k=k, v=v)
        if cache is not None:
            cache["seen"] = past + (T if cu is None else cu.diff())
        gate = split_heads(self.g_proj(x), self.num_heads) if self.use_output_gate else None
        o = (self.g_norm_swish_gate if self.fuse_norm_and_gate else self.g_norm)(o, gate)
        return self.o_proj(o.flatten(-2))


class _Lerp(nn.Module):
    """fla's ``LerpLinear`` / ``DDLerpLinear`` (RWKV-6): ``linear(x + delta * mu)``, mu its own
    parameter (``own_mu``) or given; ``linear`` a matrix, or fla's ``LoRA`` (``lora.0``, tanh,
    ``lora.2`` with a bias) at ``low_rank_dim``."""

    def __init__(self, d_in: int, d_out: int, low_rank_dim: int | None = None, own_mu: bool = False):
        super().__init__()
        if low_rank_dim is None:
            self.linear = nn.Linear(d_in, d_out, bias=False)
        else:
            self.linear = nn.Module()
            self.linear.lora = nn.Sequential(nn.Linear(d_in, low_rank_dim, bias=False), nn.Tanh(),
                                             nn.Linear(low_rank_dim, d_out, bias=True))
        if own_mu:
            self.mu = nn.Parameter(torch.zeros(d_in))

    def forward(self, x: torch.Tensor, delta: torch.Tensor, mu: torch.Tensor | None = None) -> torch.Tensor:
        y = x + delta * (self.mu if mu is None else mu)
        return self.linear(y) if isinstance(self.linear, nn.Linear) else self.linear.lora(y)


class RWKV6Attention(_FlaLayer, _OwnParameters):
    """fla's ``RWKV6Attention`` layer (RWKV-6 "Finch" time mixing, Peng et al., 2024), as fla 0.6.0
    computes it:

        delta = x_{t-1} - x_t                                  (token shift; zero before a sequence)
        m_r, m_w, m_k, m_v, m_g = W_2 tanh(W_1 (x + delta * mu)) + x_bias    (5 low-rank mixes of rank
                                                                ``proj_low_rank_dim``, ``x_proj``)
        r, k, v, g = W_c (x + delta * m_c);  w = -exp(LoRA_w(x + delta * m_w))   (tanh LoRA of rank
                                                                ``gate_low_rank_dim``, with a bias)
        S_t = Diag(exp w_t) S_{t-1} + k_t v_t^T,  o_t = S_{t-1}^T r_t + (r_t . (bonus * k_t)) v_t
        y = W_o (GroupNorm(o) * SiLU(g))                        (one group per head, weight and bias)

    (``chunk_rwkv6``, scale 1). Key and value widths ``hidden_size * expand_k`` and ``hidden_size *
    expand_v`` in ``num_heads`` heads. fla's cache keeps the state [N, H, K, V] and the last token
    [N, hidden_size]. Refused by name: a ``gate_fn`` other than swish, ``elementwise_affine=False``.
    (The LM's ``rwkv6`` mixer is another form: ``fastweight.layers.rwkv.RWKV6TimeMix``.)"""

    FLA_NAMES = {}
    FLA_CACHE = FlaLayout(v_first=False, conv=("shift",))
    MIXER = _OwnParameters

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5, expand_v: float = 1.0,
                 num_heads: int = 4, gate_fn: str = "swish", proj_low_rank_dim: int = 32, gate_low_rank_dim: int = 64,
                 fuse_norm: bool = True, elementwise_affine: bool | None = True, norm_eps: float = 1e-5,
                 layer_idx: int = None, **kwargs):
        _refuse("RWKV6Attention", gate_fn=(gate_fn, "swish"), elementwise_affine=(elementwise_affine, True))
        head_k, head_v = _head_dims("RWKV6Attention", hidden_size, expand_k, expand_v, num_heads)
        self._fla_setup(_sizes(hidden_size, num_heads, head_k, head_v), None, mode, layer_idx, kwargs)
        D, K, V = hidden_size, head_k * num_heads, head_v * num_heads
        self.expand_k, self.expand_v, self.key_dim, self.value_dim = expand_k, expand_v, K, V
        self.head_k_dim, self.head_v_dim, self.fuse_norm = head_k, head_v, fuse_norm
        self.proj_low_rank_dim, self.gate_low_rank_dim = proj_low_rank_dim, gate_low_rank_dim
        self.time_shift = TokenShift()
        self.x_proj = nn.Sequential(_Lerp(D, proj_low_rank_dim * 5, own_mu=True), nn.Tanh(),
                                    nn.Linear(proj_low_rank_dim * 5, D, bias=False))
        self.x_bias = nn.Parameter(torch.zeros(5, D))
        self.r_proj, self.k_proj = _Lerp(D, K), _Lerp(D, K)
        self.w_proj = _Lerp(D, K, low_rank_dim=gate_low_rank_dim)
        self.v_proj, self.g_proj = _Lerp(D, V), _Lerp(D, V)
        self.bonus = nn.Parameter(torch.zeros(num_heads, head_k))
        self.g_norm = nn.GroupNorm(num_heads, V, eps=norm_eps, affine=True)
        self.o_proj = nn.Linear(V, D, bias=False)

    def _mix(self, x: torch.Tensor, cache: dict | None, shared: dict | None) -> torch.Tensor:
        B, T, D = x.shape
        H, R = self.num_heads, self.proj_low_rank_dim
        delta = self.shift(self.time_shift, x, cache, shared) - x
        mixes = torch.tanh(self.x_proj[0](x, delta)).view(B, T, 5, R)
        mixes = torch.einsum("btnr,hnr->btnh", mixes, self.x_proj[2].weight.view(D, 5, R)) + self.x_bias
        m_r, m_w, m_k, m_v, m_g = mixes.unbind(-2)
        r, k = (split_heads(p(x, delta, m), H) for p, m in ((self.r_proj, m_r), (self.k_proj, m_k)))
        w = split_heads(-torch.exp(at_least_fp32(self.w_proj(x, delta, m_w))), H)
        v = split_heads(self.v_proj(x, delta, m_v), H)
        o = self.recur("rwkv6", cache, shared, scale=1.0, r=r, k=k, v=v, w=w, u=self.bonus)
        o = self.g_norm(o.reshape(B * T, -1)).view(B, T, -1)
        return self.o_proj(o * F.silu(self.g_proj(x, delta, m_g)))
