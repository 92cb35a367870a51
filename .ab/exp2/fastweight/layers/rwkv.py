"""RWKV-6 ("Finch") and RWKV-7 ("Goose") time mixing, and RWKV channel mixing.

Both start with token shift: every projection reads its own interpolation of the current
and the previous token, ``x + (x_{t-1} - x) * mu``. RWKV-6 makes the mix data dependent (a
low-rank MLP adds to mu, "ddlerp"); its decay w_t is a low-rank MLP of x too:

    RWKV-6:  S_t = Diag(w_t) S_{t-1} + k_t v_t^T
             o_t = S_{t-1}^T r_t + (r_t . (u * k_t)) v_t          log w_t = -exp(w0 + lora_w(x^w))

RWKV-7's weight preparation (paper Sec. 4): log w = -e^{-1/2} sigmoid(w0 + lora_w(x^w)),
in-context learning rate a = sigmoid(a0 + lora_a(x^a)), output gate g = lora_g(x^g) with a
sigmoid inside, removal key kappa^ = normalise(k * xi), replacement key
k~ = k * (1 + (a - 1) * alpha) (``fastweight.mechanisms.rwkv7.prepare``), and the value
residual: every RWKV-7 layer after the first mixes in the first one's value,
v <- v + (v_first - v) * sigmoid(v0 + lora_v(x^v)). Then

    RWKV-7:  S_t = (Diag(w_t) - (a_t * kappa^_t) kappa^_t^T) S_{t-1} + k~_t v_t^T
             o_t = GroupNorm(S_t^T r_t) + (r_t . (rho * k~_t)) v_t,   y = W_o (o * g)

Channel mixing: y = W_v relu(W_k x^k)^2 (RWKV-6 multiplies by sigmoid(W_r x^r)).
GroupNorm over each head is written as the per-head RMSNorm all layers share.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fastweight.layers.base import Mixer, split_heads
from fastweight.layers.common import GatedRMSNorm, LowRank, TokenShift, at_least_fp32
from fastweight.mechanisms.rwkv7 import prepare

EXP_MINUS_HALF = math.exp(-0.5)


def _decay_init(n: int, lo: float, hi: float) -> nn.Parameter:
    """Per-channel decay logits spread from ``lo`` to ``hi`` (slow and fast channels)."""
    return nn.Parameter(torch.linspace(lo, hi, n))


def rwkv7_init(d_model: int, n_heads: int, head_k: int, head_v: int, layer_idx: int, n_layers: int) -> dict:
    """RWKV-7's initial per-channel parameters (the official ``RWKV_x070`` training code's values)
    for layer l = ``layer_idx`` of L = ``n_layers``. Over a width C (d_model for the token-shift
    mixes, H * head_k for the key side, H * head_v for values), channel c, u_c = c / (C-1) - 1/2,
    and per head of size N the "zigzag" z_i = s |s|, s = (i - (N-1)/2) / ((N-1)/2), i = c mod N:

    - token-shift mixes ``mu`` [6, d_model] (rows r, w, k, v, a, g): 1 - (c / C)^(p (1 - l / L)),
      p = 0.2, 0.9, 0.7, 0.7, 0.9, 0.2 (from "all previous token" at c = 0 to "all current" near C);
    - decay logit ``w0`` [H * head_k]: -6 + 6 (c / (C-1))^(1 + (l / (L-1))^0.3) + 0.5 + 2.5 z_i:
      every head spans slow to fast channels, down to sigmoid(-8) = 3e-4, a log decay of -2e-4 a
      token (a horizon of thousands of tokens); the fastest forget at about -0.6 a token;
    - in-context learning rate logit ``a0``: -0.19 + 0.3 z_i + 0.4 u_c (a = sigmoid ~ 0.45);
    - removal-key scale ``xi`` [H, head_k]: 0.71 - 0.1 u_c; replacement-key mix ``alpha``: 1.02;
      bonus ``rho``: -0.04; value-residual logit ``v0`` [H * head_v]: 0.73 - 0.4 u_c;
    (channel mixing's key mix: :func:`rwkv7_channel_mix_init`).
    """
    depth = layer_idx / max(1, n_layers - 1)           # 0 in the first layer, 1 in the last
    shallow = 1.0 - layer_idx / n_layers               # 1 in the first layer, 1/L in the last

    def ramp(C):                                       # c / C and u_c
        c = torch.arange(C, dtype=torch.float32)
        return c / C, c / max(1, C - 1) - 0.5

    def zigzag(C, N):
        s = ((torch.arange(C) % N) - (N - 1) / 2) / max(1.0, (N - 1) / 2)
        return s * s.abs()

    frac, _ = ramp(d_model)
    K = n_heads * head_k
    _, uk = ramp(K)
    _, uv = ramp(n_heads * head_v)
    z = zigzag(K, head_k)
    powers = torch.tensor([0.2, 0.9, 0.7, 0.7, 0.9, 0.2])[:, None]
    return dict(mu=1.0 - frac[None, :] ** (powers * shallow),
                w0=-6.0 + 6.0 * ((uk + 0.5) ** (1.0 + depth ** 0.3)) + 0.5 + 2.5 * z,
                a0=-0.19 + 0.3 * z + 0.4 * uk, v0=0.73 - 0.4 * uv,
                xi=(0.71 - 0.1 * uk).view(n_heads, head_k), alpha=torch.full((n_heads, head_k), 1.02),
                rho=torch.full((n_heads, head_k), -0.04))


def rwkv7_channel_mix_init(d_model: int, layer_idx: int, n_layers: int) -> torch.Tensor:
    """RWKV-7's initial token-shift mix of the channel mixing's key, [d_model]: 1 - (c / C)^((1 - l / L)^4)."""
    shallow = 1.0 - layer_idx / n_layers
    return 1.0 - (torch.arange(d_model, dtype=torch.float32) / d_model) ** (shallow ** 4)


class RWKV6TimeMix(Mixer):
    """RWKV-6 time mixing (Peng et al. 2024, arXiv:2404.05892)."""

    def __init__(self, cfg):
        super().__init__()
        self.recurrent_threshold = cfg.recurrent_threshold
        D, H, K, V, R = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.head_v_dim, cfg.lora_rank
        self.n_heads = H
        self.shift_x = TokenShift()
        self.mu_x = nn.Parameter(torch.rand(D))
        self.mu = nn.Parameter(torch.rand(5, D))  # w, k, v, r, g
        self.mix_lora = LowRank(D, R, 5 * D, activation="tanh")
        self.r_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.g_proj = nn.Linear(D, H * V, bias=False)
        self.w0 = _decay_init(H * K, -6.0, -0.5)
        self.w_lora = LowRank(D, 2 * R, H * K, activation="tanh")
        self.u = nn.Parameter(torch.randn(H, K) * 0.1)
        self.o_norm = GatedRMSNorm(V, cfg.norm_eps, "silu")
        self.o_proj = nn.Linear(H * V, D, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        H = self.n_heads
        xx = self.shift(self.shift_x, x, cache, shared) - x
        m = self.mix_lora(x + xx * self.mu_x).unflatten(-1, (5, -1))
        xw, xk, xv, xr, xg = (x[..., None, :] + xx[..., None, :] * (self.mu + m)).unbind(-2)
        r, k, v = split_heads(self.r_proj(xr), H), split_heads(self.k_proj(xk), H), split_heads(self.v_proj(xv), H)
        w = split_heads(-torch.exp(self.w0 + at_least_fp32(self.w_lora(xw))), H)
        o = self.recur("rwkv6", cache, shared, scale=1.0, r=r, k=k, v=v, w=w, u=self.u.to(r.dtype))
        return self.o_proj(self.o_norm(o, split_heads(self.g_proj(xg), H)).flatten(-2))


class RWKV7TimeMix(Mixer):
    """RWKV-7 time mixing (Peng et al. 2025, arXiv:2503.14456)."""

    def __init__(self, cfg):
        super().__init__()
        self.recurrent_threshold = cfg.recurrent_threshold
        D, H, K, V, R = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.head_v_dim, cfg.lora_rank
        self.n_heads = H
        self.shift_x = TokenShift()
        self.mu = nn.Parameter(torch.rand(6, D))  # r, w, k, v, a, g
        self.r_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.w0 = _decay_init(H * K, -4.0, 2.0)
        self.w_lora = LowRank(D, R, H * K, activation="tanh")
        self.a0 = nn.Parameter(torch.zeros(H * K))
        self.a_lora = LowRank(D, R, H * K, activation=None)
        self.v0 = nn.Parameter(torch.ones(H * V))
        self.v_lora = LowRank(D, R, H * V, activation=None)
        self.g_lora = LowRank(D, R, H * V, activation="sigmoid")
        self.xi = nn.Parameter(torch.full((H, K), 0.85))
        self.alpha = nn.Parameter(torch.ones(H, K))
        self.rho = nn.Parameter(torch.randn(H, K) * 0.1)
        self.o_norm = GatedRMSNorm(V, cfg.norm_eps, "identity")
        self.o_proj = nn.Linear(H * V, D, bias=False)

    no_weight_decay = ("mu", "xi", "alpha", "rho")    # per-channel vectors kept 2-D (fastweight.optim.decays)

    @torch.no_grad()
    def reset_layer_parameters(self, layer_idx: int, n_layers: int) -> None:
        """The paper's initial decay, learning-rate, value-residual, key and token-shift parameters
        for this layer's depth (:func:`rwkv7_init`; the LM calls it after its generic init)."""
        H, K = self.xi.shape
        init = rwkv7_init(self.mu.shape[1], H, K, self.v0.shape[0] // H, layer_idx, n_layers)
        for name in ("mu", "w0", "a0", "v0", "xi", "alpha", "rho"):
            getattr(self, name).copy_(init[name])

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        H = self.n_heads
        xx = self.shift(self.shift_x, x, cache, shared) - x
        xr, xw, xk, xv, xa, xg = (x[..., None, :] + xx[..., None, :] * self.mu).unbind(-2)
        r, k, v = split_heads(self.r_proj(xr), H), split_heads(self.k_proj(xk), H), split_heads(self.v_proj(xv), H)
        w = split_heads(-EXP_MINUS_HALF * torch.sigmoid(self.w0 + at_least_fp32(self.w_lora(xw))), H)
        a = split_heads(torch.sigmoid(self.a0 + self.a_lora(xa)), H)
        shared = {} if shared is None else shared
        if "v_first" not in shared:
            shared["v_first"] = v
        else:
            v = v + (shared["v_first"] - v) * split_heads(torch.sigmoid(self.v0 + self.v_lora(xv)), H)
        kappa_hat, k_tilde = prepare(dict(k=k, a=a, _xi=self.xi.to(k.dtype), _alpha=self.alpha.to(k.dtype)))
        o = self.recur("rwkv7", cache, shared, scale=1.0, r=r, w=w, k=k_tilde, v=v, a=-kappa_hat,
                       b=kappa_hat * a)
        o = self.o_norm(o) + (r * k_tilde * self.rho.to(r.dtype)).sum(-1, keepdim=True) * v
        return self.o_proj((o * split_heads(self.g_lora(xg), H)).flatten(-2))


class ChannelMix(nn.Module):
    """RWKV channel mixing (the MLP of RWKV blocks): W_v relu(W_k x^k)^2 [* sigmoid(W_r x^r)]."""

    def __init__(self, cfg, receptance: bool = False, width: int | None = None):
        super().__init__()
        D = cfg.d_model
        width = width or 4 * D
        self.shift_x = TokenShift()
        self.mu_k = nn.Parameter(torch.rand(D))
        self.key = nn.Linear(D, width, bias=False)
        self.value = nn.Linear(width, D, bias=False)
        self.mu_r = nn.Parameter(torch.rand(D)) if receptance else None
        self.receptance = nn.Linear(D, D, bias=False) if receptance else None

    @torch.no_grad()
    def reset_layer_parameters(self, layer_idx: int, n_layers: int) -> None:
        """RWKV-7's channel mixing (no receptance): the key's initial token-shift mix for this
        layer's depth (:func:`rwkv7_channel_mix_init`); RWKV-6's keeps its uniform draw."""
        if self.receptance is None:
            self.mu_k.copy_(rwkv7_channel_mix_init(self.mu_k.shape[0], layer_idx, n_layers))

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        xx = Mixer.shift(self.shift_x, x, cache, shared, "ffn_shift") - x
        y = self.value(torch.relu(self.key(x + xx * self.mu_k)).square())
        if self.receptance is not None:
            y = torch.sigmoid(self.receptance(x + xx * self.mu_r)) * y
        return y
