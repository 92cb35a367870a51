"""The decay-only layers (no delta correction): linear attention, RetNet, GLA, HGRN2, Mamba-2.

| mixer  | recurrence                         | gate                                                  | op          |
|--------|------------------------------------|-------------------------------------------------------|-------------|
| la     | S + phi(k) v^T, phi = elu + 1      | none                                                  | linear_attn |
| retnet | gamma_h S + k v^T                  | gamma_h = 1 - 2^(-5-h), fixed; rotary q, k            | retention   |
| gla    | Diag(alpha_t) S + k v^T            | log alpha = logsigmoid(low-rank(x)) / 16              | gla         |
| hgrn2  | Diag(alpha_t) S + (1 - alpha_t) v^T| log alpha = logsigmoid(W_f x); the key is 1 - alpha   | hgrn2       |
| mamba2 | exp(dt A) S + dt B x^T, y = C^T S + D x | Mamba-2's A_log, dt_bias, softplus               | simple_gla  |

All but Mamba-2 share ``q, k, v = W_q x, W_k x, W_v x`` and ``y = W_o (RMSNorm(o) [* silu(W_g x)])``;
GLA's q, k, v go through short convolutions when ``LMConfig.gla_short_conv`` (fla's ``use_short_conv``).
Linear attention's normaliser ``1 / phi(q)^T sum phi(k)`` is a positive per-head scalar, so
the output RMSNorm (scale invariant) makes it redundant; it is left out.
Mamba-2 keeps its own block: one input projection to (z, x, B, C, dt), a ShortConv over
(x, B, C), one (B, C) pair shared by all heads, and the gated norm RMSNorm(y * silu(z)).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight.layers.base import Mixer, packed, positions, split_heads
from fastweight.layers.common import GatedRMSNorm, LowRank, RMSNorm, ShortConv, at_least_fp32, mamba_decay_init, rotary

GATE_LOGIT_NORMALIZER = 16
GATE_RANK = 16   # GLA's low-rank decay projection (fla's gate_low_rank_dim)


class DecayMixer(Mixer):
    """Linear attention, RetNet, GLA, HGRN2 by ``variant`` (see the module docstring)."""

    def __init__(self, cfg, variant: str = "gla"):
        super().__init__()
        self.variant, self.recurrent_threshold = variant, cfg.recurrent_threshold
        self.rope_theta = cfg.rope_theta
        D, H, K, V = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.head_v_dim
        self.n_heads, self.head_k = H, K
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.g_proj = nn.Linear(D, H * V, bias=False) if variant in ("gla", "retnet") else None
        if variant == "gla":
            self.gk_proj = LowRank(D, GATE_RANK, H * K, activation=None, bias=True)
        self.qkv_conv = None
        if variant == "gla" and cfg.gla_short_conv:
            self.qkv_conv = nn.ModuleDict({"q": ShortConv(H * K, cfg.conv_size, "silu"),
                                           "k": ShortConv(H * K, cfg.conv_size, "silu"),
                                           "v": ShortConv(H * V, cfg.conv_size, "silu")})
        self.o_norm = GatedRMSNorm(V, cfg.norm_eps, "silu")
        self.o_proj = nn.Linear(H * V, D, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        H = self.n_heads
        q, k, v = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if self.qkv_conv is not None:
            q, k, v = (self.conv(self.qkv_conv[n], y, cache, f"conv_{n}", shared) for n, y in zip("qkv", (q, k, v)))
        q, k, v = (split_heads(y, H) for y in (q, k, v))
        scale = self.head_k ** -0.5
        if self.variant == "la":
            q, k = F.elu(q) + 1, F.elu(k) + 1
            o = self.recur("linear_attn", cache, shared, scale=scale, q=q, k=k, v=v, normalize=False)
        elif self.variant == "retnet":
            pos = positions(shared)
            q, k = rotary(q, pos, self.rope_theta), rotary(k, pos, self.rope_theta)
            o = self.recur("retention", cache, shared, scale=scale, q=q, k=k, v=v)
        elif self.variant == "gla":
            g = split_heads(F.logsigmoid(at_least_fp32(self.gk_proj(x))) / GATE_LOGIT_NORMALIZER, H)
            o = self.recur("gla", cache, shared, scale=scale, q=q, k=k, v=v, g=g)
        else:  # hgrn2: W_k is the forget gate projection; its complement 1 - alpha is the key
            g = split_heads(F.logsigmoid(at_least_fp32(k.flatten(-2))), H)
            o = self.recur("hgrn2", cache, shared, scale=1.0, q=F.silu(q), v=v, g=g)
        gate = None if self.g_proj is None else split_heads(self.g_proj(x), H)
        return self.o_proj(self.o_norm(o, gate).flatten(-2))


class Mamba2Mixer(Mixer):
    """Mamba-2 (Dao & Gu 2024): h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = C_t^T h_t + D x_t.

    d_inner = cfg.mamba_expand * d_model split in heads of ``cfg.mamba_head_dim``; the state
    size N = cfg.head_dim; B, C shared by all heads (one group).

    ``cfg.allow_neg_eigval`` (Grazzi et al. 2024, arXiv:2411.12537: Mamba with eigenvalues in
    [-1, 1]): the transition is a_t = 2 exp(dt_t A) - 1 in place of exp(dt_t A). The op takes log
    decays, so the sign is moved out exactly: with s_t = prod_{u<=t} sign(a_u) (each sequence from
    s = 1 at the call's first token) and S~_t = s_t S_t,

        S~_t = |a_t| S~_{t-1} + k_t (s_t v_t)^T,    o_t = s_t S~_t^T q_t,    S_T = s_T S~_T

    i.e. simple_gla with g = log |a_t| on v s_t, its output times s_t and its final state times s_T
    (the initial state is S~_0 = S_0). |a_t| below 1e-12 is held there (a reset either way).
    """

    def __init__(self, cfg):
        super().__init__()
        self.recurrent_threshold = cfg.recurrent_threshold
        D, N, P = cfg.d_model, cfg.head_dim, cfg.mamba_head_dim
        self.d_inner = cfg.mamba_expand * D
        if self.d_inner % P:
            raise ValueError(f"`mamba_head_dim` ({P}) must divide mamba_expand * d_model ({self.d_inner})")
        self.n_heads, self.d_state = self.d_inner // P, N
        self.in_proj = nn.Linear(D, 2 * self.d_inner + 2 * N + self.n_heads, bias=False)
        self.conv1d = ShortConv(self.d_inner + 2 * N, cfg.conv_size, "silu", bias=True)
        self.A_log, self.dt_bias = mamba_decay_init(self.n_heads)
        self.allow_neg_eigval = cfg.allow_neg_eigval
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = RMSNorm(self.d_inner, cfg.norm_eps)
        self.out_proj = nn.Linear(self.d_inner, D, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, N, E = self.n_heads, self.d_state, self.d_inner
        z, xbc, dt = self.in_proj(x).split([E, E + 2 * N, H], dim=-1)
        xs, b, c = self.conv(self.conv1d, xbc, cache, "conv", shared).split([E, N, N], dim=-1)
        dt = F.softplus(at_least_fp32(dt) + self.dt_bias)  # [B, T, H]
        g = -at_least_fp32(self.A_log).exp() * dt
        xs = split_heads(xs, H)
        q, k = (t[:, :, None].expand(B, T, H, N) for t in (c, b))
        v = xs * dt[..., None].to(xs.dtype)
        if self.allow_neg_eigval:
            o = self._signed_recur(cache, shared, q, k, v, g)
        else:
            o = self.recur("simple_gla", cache, shared, scale=1.0, q=q, k=k, v=v, g=g)
        y = o + self.D.to(xs.dtype)[:, None] * xs
        y = y.flatten(-2) * F.silu(z)
        return self.out_proj(self.norm(y))

    def _signed_recur(self, cache, shared, q, k, v, g):
        """The recurrence with a_t = 2 exp(g_t) - 1 (class docstring): g [B, T, H] fp32."""
        if packed(shared, "context_parallel") is not None:
            raise NotImplementedError("Mamba-2 with allow_neg_eigval under context parallelism (the running sign "
                                      "would have to cross ranks)")
        a = 2 * g.exp() - 1
        negative = (a < 0).to(torch.int64)
        flips = negative.cumsum(1)
        cu = packed(shared, "cu_seqlens")
        if cu is not None:   # each packed sequence starts from s = +1: remove the flips before its start
            cu = cu.to(device=g.device, dtype=torch.int64)
            start = torch.searchsorted(cu[1:], torch.arange(g.shape[1], device=g.device), right=True)
            before = F.pad(flips, (0, 0, 1, 0))[:, cu[:-1]]            # [B, N, H]: flips before each start
            flips = flips - before[:, start]
        s = 1 - 2 * (flips % 2).to(g.dtype)                            # [B, T, H] in {-1, +1}
        o = self.recur("simple_gla", cache, shared, scale=1.0, q=q, k=k, v=v * s[..., None].to(v.dtype),
                       g=a.abs().clamp_min(1e-12).log())
        if cache is not None and g.shape[1]:
            if cu is None:
                last = s[:, -1]
            else:   # s at each sequence's last token; +1 for an empty one
                ends = (cu[1:] - 1).clamp(min=0)
                last = torch.where((cu[1:] > cu[:-1])[:, None], s[0, ends], torch.ones_like(s[0, ends]))
            cache["state"] = cache["state"] * last[..., None, None].to(cache["state"].dtype)
        return o * s[..., None].to(o.dtype)
