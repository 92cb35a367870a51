"""Softmax attention for hybrid stacks: full causal, or a sliding window of W tokens.

    o_i = sum_{j in window(i)} softmax_j(q_i . k_j / sqrt(d)) v_j,
    window(i) = {j : j <= i}                (full)      {j : i - W < j <= i}   (swa)

Rotary positions on q and k; grouped key/value heads (``cfg.n_kv_heads``). The decode
cache holds the keys and values seen so far: all of them for full attention (it grows
with the sequence), the last W - 1 for a sliding window (constant size).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight.layers.base import Mixer, split_heads
from fastweight.layers.common import rotary


class Attention(Mixer):
    """Multi-head softmax attention; ``window`` None = full causal attention."""

    def __init__(self, cfg, window: int | None = None):
        super().__init__()
        D, H = cfg.d_model, cfg.n_heads
        self.n_heads, self.n_kv_heads = H, cfg.n_kv_heads or H
        self.head_dim = D // H
        self.window, self.rope_theta = window, cfg.rope_theta
        self.q_proj = nn.Linear(D, H * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(H * self.head_dim, D, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        T = x.shape[1]
        offset = 0 if shared is None else shared.get("offset", 0)
        q = rotary(split_heads(self.q_proj(x), self.n_heads), offset, self.rope_theta)
        k = rotary(split_heads(self.k_proj(x), self.n_kv_heads), offset, self.rope_theta)
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
            keep = k.shape[1] if self.window is None else min(k.shape[1], self.window - 1)
            cache["k"], cache["v"] = k[:, k.shape[1] - keep:], v[:, v.shape[1] - keep:]
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
        S = k.shape[2]
        if self.window is None and S == T:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q_pos = torch.arange(S - T, S, device=x.device)[:, None]
            k_pos = torch.arange(S, device=x.device)[None, :]
            mask = k_pos <= q_pos
            if self.window is not None:
                mask = mask & (k_pos > q_pos - self.window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).flatten(-2))
