"""Softmax attention for hybrid stacks: full causal, or a sliding window of W tokens.

    o_i = sum_{j in window(i)} softmax_j(q_i . k_j / sqrt(d)) v_j,
    window(i) = {j : j <= i}                (full)      {j : i - W < j <= i}   (swa)

Rotary positions on q and k; grouped key/value heads (``cfg.n_kv_heads``). The decode
cache holds the keys and values seen so far: all of them for full attention (a buffer
with room for the next max(256, n/8) tokens, so a decode step appends in place), the last W - 1 for a sliding
window (constant size). A sliding window over a long sequence runs blockwise: queries in
blocks of W, each attending to its own block and the previous one, O(T W) work. Packed
sequences (``cu_seqlens``) use a dense block-diagonal causal mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight.layers.base import Mixer, packed, positions, split_heads
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
        pos, cu_seqlens = positions(shared), packed(shared, "cu_seqlens")
        q = rotary(split_heads(self.q_proj(x), self.n_heads), pos, self.rope_theta)
        k = rotary(split_heads(self.k_proj(x), self.n_kv_heads), pos, self.rope_theta)
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        if cache is not None:
            k, v = self.append(cache, k, v)
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
        S = k.shape[2]
        if cu_seqlens is None and self.window is None and S == T:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif cu_seqlens is None and S == T and T > self.window:
            o = window_blocks(q, k, v, self.window)
        else:
            q_pos = torch.arange(S - T, S, device=x.device)[:, None]
            k_pos = torch.arange(S, device=x.device)[None, :]
            mask = k_pos <= q_pos
            if self.window is not None:
                mask = mask & (k_pos > q_pos - self.window)
            if cu_seqlens is not None:  # packed sequences: block-diagonal
                seq = torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=x.device), right=True)
                mask = mask & (seq[:, None] == seq[None, :])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).flatten(-2))

    def append(self, cache: dict, k: torch.Tensor, v: torch.Tensor):
        """Add k, v [B, T, H, d] to the cache; returns the keys and values to attend to."""
        if self.window is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
            keep = min(k.shape[1], self.window - 1)
            cache["k"], cache["v"] = k[:, k.shape[1] - keep:], v[:, v.shape[1] - keep:]
            return k, v
        n, T = cache.get("length", 0), k.shape[1]
        if "k" not in cache or n + T > cache["k"].shape[1]:
            size = n + T + (0 if n == 0 else max(256, n // 8))
            for name, new in (("k", k), ("v", v)):
                buf = new.new_empty(new.shape[0], size, *new.shape[2:])
                if n:
                    buf[:, :n] = cache[name][:, :n]
                cache[name] = buf
        cache["k"][:, n:n + T], cache["v"][:, n:n + T] = k, v
        cache["length"] = n + T
        return cache["k"][:, :n + T], cache["v"][:, :n + T]


def window_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window attention of q, k, v [B, H, T, d] in blocks of W = ``window`` queries.

    Block 0 is plain causal attention. Block n > 0 attends to the 2W keys of blocks n-1 and n:
    query i of the block (position nW + i) sees local keys j in (i, W + i], i.e. the positions
    (nW + i - W, nW + i]; one [W, 2W] mask serves every block.
    """
    B, H, T, d = q.shape
    W = window
    n = -(-T // W)
    pad = n * W - T
    q, k, v = (F.pad(t, (0, 0, 0, pad)).view(B, H, n, W, d) for t in (q, k, v))
    first = F.scaled_dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
    k, v = (torch.cat([t[:, :, :-1], t[:, :, 1:]], dim=3) for t in (k, v))  # [B, H, n-1, 2W, d]
    i = torch.arange(W, device=q.device)[:, None]
    j = torch.arange(2 * W, device=q.device)[None, :]
    mask = (j > i) & (j <= W + i)
    rest = F.scaled_dot_product_attention(q[:, :, 1:].reshape(B, H * (n - 1), W, d),
                                          k.reshape(B, H * (n - 1), 2 * W, d),
                                          v.reshape(B, H * (n - 1), 2 * W, d), attn_mask=mask)
    o = torch.cat([first[:, :, None], rest.view(B, H, n - 1, W, d)], dim=2)
    return o.view(B, H, n * W, d)[:, :, :T]
