"""Softmax attention for hybrid stacks: full causal, or a sliding window of W tokens.

    o_i = sum_{j in window(i)} softmax_j(q_i . k_j / sqrt(d)) v_j,
    window(i) = {j : j <= i}                (full)      {j : i - W < j <= i}   (swa)

Rotary positions on q and k; ``cfg.attention_heads`` heads (``attn_heads``, else ``n_heads``),
grouped key/value heads (``cfg.n_kv_heads``). The decode cache holds the keys and values seen
so far: all of them for full attention (a buffer with room for the next max(256, n/8) tokens,
so a decode step appends in place), the last W for a sliding window (a ring of W slots,
constant size: a one-token step overwrites the oldest slot in place and attends to the whole
ring, since softmax attention does not depend on the order of its keys).

Kernels: on CUDA in fp16/bf16, FlashAttention through ``aten::_flash_attention_forward``,
whose causal mask is aligned to the last key (query i of T sees the keys up to S - T + i)
and which skips the key blocks outside a window (``window_size_left = W - 1``): O(T W) work
for SWA, split over the keys for one-token decode steps. Full causal attention over a whole
sequence keeps ``scaled_dot_product_attention(is_causal=True)``. Elsewhere (CPU, fp32) SDPA:
a sliding window over a long sequence runs blockwise (queries in blocks of W, each attending
to its own block and the previous one), packed sequences (``cu_seqlens``) use a dense
block-diagonal causal mask.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight.layers.base import Mixer, packed, positions, split_heads
from fastweight.layers.common import rotary


class Attention(Mixer):
    """Multi-head softmax attention; ``window`` None = full causal attention."""

    def __init__(self, cfg, window: int | None = None):
        super().__init__()
        D, H = cfg.d_model, cfg.attention_heads
        self.n_heads, self.n_kv_heads = H, cfg.n_kv_heads or H
        self.head_dim = D // H
        self.window, self.rope_theta = window, cfg.rope_theta
        self.q_proj = nn.Linear(D, H * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(H * self.head_dim, D, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        if packed(shared, "context_parallel") is not None:
            raise NotImplementedError("context parallelism covers the linear mixers; an attention layer (here "
                                      f"{type(self).__name__}) would need ring attention, which fastweight lacks")
        pos, cu_seqlens = positions(shared), packed(shared, "cu_seqlens")
        q = rotary(split_heads(self.q_proj(x), self.n_heads), pos, self.rope_theta, shared)
        k = rotary(split_heads(self.k_proj(x), self.n_kv_heads), pos, self.rope_theta, shared)
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        if cache is not None:
            k, v = self.append(cache, k, v) if self.window is None else self.window_append(cache, k, v)
        return self.o_proj(self.attend(q, k, v, cu_seqlens).flatten(-2))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """q [B, T, H, d] against the last-aligned keys k, v [B, S, H_kv, d] (S >= T): query i sees
        the keys up to S - T + i (and within the window); returns [B, T, H, d]."""
        T, S = q.shape[1], k.shape[1]
        if cu_seqlens is None and flash_usable(q) and (self.window is not None or S != T):
            return flash(q, k, v, self.window)
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
        if cu_seqlens is None and self.window is None and S == T:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif cu_seqlens is None and S == T and T > self.window:
            o = window_blocks(q, k, v, self.window)
        elif cu_seqlens is None and T == 1 and (self.window is None or S <= self.window):
            o = F.scaled_dot_product_attention(q, k, v)  # one query that sees every key
        else:
            q_pos = torch.arange(S - T, S, device=q.device)[:, None]
            k_pos = torch.arange(S, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if self.window is not None:
                mask = mask & (k_pos > q_pos - self.window)
            if cu_seqlens is not None:  # packed sequences: block-diagonal
                seq = torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=q.device), right=True)
                mask = mask & (seq[:, None] == seq[None, :])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2)

    def append(self, cache: dict, k: torch.Tensor, v: torch.Tensor):
        """Full attention: add k, v [B, T, H, d] to the cache; returns the keys and values to attend to."""
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

    def window_append(self, cache: dict, k: torch.Tensor, v: torch.Tensor):
        """Sliding window: the ring ``cache["k"], cache["v"]`` [B, W, H, d] holds the last ``cache["length"]``
        <= W tokens, the oldest at slot ``cache["start"]``. One new token overwrites the oldest slot
        (in place) and the whole ring is returned, in ring order (every key in it is in the new
        token's window). Several tokens: the past in order, then k, v; the ring is rebuilt."""
        W, T = self.window, k.shape[1]
        n, start = cache.get("length", 0), cache.get("start", 0)
        if T == 1 and "k" in cache and cache["k"].shape[0] == k.shape[0]:
            slot = n if n < W else start
            cache["k"][:, slot], cache["v"][:, slot] = k[:, 0], v[:, 0]
            if n < W:
                cache["length"] = n + 1
                return cache["k"][:, :n + 1], cache["v"][:, :n + 1]
            cache["start"] = (start + 1) % W
            return cache["k"], cache["v"]
        if n:
            past = [torch.roll(cache[name][:, :n], -start, dims=1) if start else cache[name][:, :n] for name in "kv"]
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        keep = min(k.shape[1], W)
        for name, new in (("k", k), ("v", v)):
            buf = new.new_empty(new.shape[0], W, *new.shape[2:])
            buf[:, :keep] = new[:, new.shape[1] - keep:]
            cache[name] = buf
        cache["length"], cache["start"] = keep, 0
        return k, v


def flash_usable(q: torch.Tensor) -> bool:
    """FlashAttention for q: CUDA, fp16/bf16, head dim a multiple of 8 up to 256, outside torch.compile,
    and a first call on the device that matched the SDPA path (see :func:`_probe`)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    if torch.compiler.is_compiling():
        return False
    key = (q.device.index, q.dtype)
    if key not in _FLASH_OK:
        _FLASH_OK[key] = _probe(q.device, q.dtype)
    return _FLASH_OK[key]


_FLASH_OK: dict = {}


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal attention aligned to the last key, within ``window`` (None: unlimited); q [B, T, H, d],
    k, v [B, S, H_kv, d] (H_kv divides H). Differentiable (aten's flash backward)."""
    T, S = q.shape[1], k.shape[1]
    left = None if window is None or window >= S else window - 1
    return torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, T, S, 0.0, True, False, window_size_left=left,
        window_size_right=None if left is None else 0)[0]


def _probe(device, dtype) -> bool:
    """Run :func:`flash` once at a small size against the SDPA path (forward and gradients, a window,
    a one-token step and five queries after a cache); False (with a warning) if it fails or disagrees."""
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(2, 70, 2, 64, device=device, dtype=dtype, generator=g).requires_grad_()
                       for _ in range(3))
            out = flash(q, k, v, 8)  # a small window: one key too many or too few moves o by ~10%
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
            qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
            ref = window_blocks(qf, kf, vf, 8).transpose(1, 2)
            ref_grads = torch.autograd.grad(ref.square().sum(), (qf, kf, vf))
            step = flash(q[:, -1:], k[:, -8:], v[:, -8:], 8)
            tail = flash(q[:, -5:], k, v, 8)  # several queries after a cache: aligned to the last key
            errs = [_err(out, ref), _err(step, ref[:, -1:]), _err(tail, ref[:, -5:])]
            errs += [_err(a, b.transpose(1, 2)) for a, b in zip(grads, ref_grads)]
        if max(errs) < 2e-2:  # bf16 rounding of o and of the probabilities: ~5e-3
            return True
        warnings.warn(f"flash attention disagrees with SDPA on {device} ({dtype}): errors {errs}; using SDPA")
    except Exception as e:  # noqa: BLE001 (any failure: fall back)
        warnings.warn(f"flash attention unavailable on {device} ({type(e).__name__}: {e}); using SDPA")
    return False


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


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
