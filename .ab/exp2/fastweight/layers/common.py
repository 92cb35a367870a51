"""Parts every layer is built from: norms, the short convolution, token shift, low-rank MLPs,
rotary embeddings and the SwiGLU MLP.

Parts that carry information across time (``ShortConv``, ``TokenShift``) take and return
their decode cache explicitly, so a layer can run a whole prompt (prefill) and then one
token at a time with the same result as one pass over the whole sequence.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": F.relu,
               "identity": lambda x: x, None: lambda x: x}


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim (computed in fp32).

    The output is in x's dtype, or under autocast in the autocast dtype: what the projections
    after it would cast it to, once each (a fp32 residual stream feeds up to six of them).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _triton_usable(x):
            from fastweight.kernels.norm import gated_rms_norm
            return gated_rms_norm(x, None, self.weight, self.eps, out_dtype=out_dtype(x))
        return rms_norm(x, self.weight, self.eps).to(out_dtype(x))


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or float64 if it is (a float64 model's gates stay float64)."""
    return x if x.dtype == torch.float64 else x.float()


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """x's dtype, or the autocast dtype for a fp32 x under autocast."""
    if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm with fp32 arithmetic, in one kernel on CUDA (which accumulates in fp32 for
    16-bit inputs: no fp32 copy of x needed); in x's dtype for a weight of x's dtype, else fp32;
    float64 stays float64 (a float64 model computes in float64 throughout)."""
    if (x.is_cuda and x.dtype == weight.dtype) or x.dtype == torch.float64:
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)


class GatedRMSNorm(RMSNorm):
    """The output of most linear layers: RMSNorm(o) * act(gate), per head (last dim).

    With ``gate=None`` it is a plain RMSNorm. ``activation`` is "silu" (GDN, GLA, Mamba-2)
    or "sigmoid" (KDA).
    """

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__(dim, eps)
        self.act = ACTIVATIONS[activation]
        self.act_name = activation or "identity"

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if _triton_usable(x) and self.act_name in ("silu", "sigmoid", "identity"):
            # one pass (fastweight.kernels.norm), where the form below makes up to seven
            from fastweight.kernels.norm import gated_rms_norm
            return gated_rms_norm(x, gate, self.weight, self.eps, self.act_name, out_dtype=out_dtype(x))
        y = super().forward(x)
        if gate is None:
            return y
        if gate.dtype == y.dtype:  # 16-bit activations compute in fp32 inside their kernel
            return y * self.act(gate)
        return y * self.act(at_least_fp32(gate)).to(y.dtype)


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over time (kernel W, default 4), then an activation.

        y_t[c] = act( sum_{j<W} weight[c, j] * x_{t-W+1+j}[c] )

    x: [B, T, C]. ``cache`` holds the last ``tail_width`` inputs ``[B, tail_width, C]`` (zeros at the
    start; W-1, the ones the next output reads, unless set to W: fla's conv_state keeps W, the oldest
    unread); ``forward`` returns ``(y, new_cache)`` so decoding one token costs O(W C). With ``positions``
    (packed sequences, B = 1) no tap reaches into the previous sequence, and no cache is kept unless
    ``cu_seqlens`` [N+1] is given too: then ``cache`` (None: zeros) is ``[N, tail_width, C]``, sequence
    n's history, and the tails come back per sequence (an empty sequence keeps its own).
    """

    def __init__(self, channels: int, kernel_size: int = 4, activation: str | None = "silu", bias: bool = False):
        super().__init__()
        self.channels, self.kernel_size = channels, kernel_size
        self.tail_width = kernel_size - 1
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        self.act = ACTIVATIONS[activation]
        # the Triton kernel (fastweight.kernels.conv) on CUDA for SiLU / no activation, without a
        # bias: Mamba-2's conv (the only one with a bias) keeps conv1d until its kernel path passes a
        # GPU check (a Mamba-2 model gave NaN from its first step on the H200 with it and the
        # scalar-decay kernels at V = 16; docs/results/full.md). The interpreter finds it exact.
        self.fused = activation in ("silu", "identity", None) and not bias
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None):
        B, T, C = x.shape
        W, n = self.kernel_size, self.tail_width
        if cache is not None and (cache.dim() != 3 or cache.shape[1] < W - 1 or cache.shape[2] != C):
            raise ValueError(f"the convolution cache must be [batch, >= {W - 1}, {C}] (its last inputs), "
                             f"got {tuple(cache.shape)}")
        if cu_seqlens is not None:
            positions = packed_positions(x, positions, cu_seqlens)
            weight, bias = self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
            y, tail = packed_conv_cached(x, weight, bias, positions, cu_seqlens, cache, n)
            return self.act(y), tail
        if cache is None and positions is None and self.fused and _fused_conv_usable(x):
            # one pass over [B, T, C] in and out (conv1d needs channels first: two transposed copies)
            from fastweight.kernels.conv import short_conv
            y = short_conv(x, self.weight.view(C, W), self.bias, silu=self.act is F.silu)
            return y, last_inputs(None, x, n)
        weight, bias = self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        if positions is not None:
            return self.act(self._packed(x, weight, bias, positions)), None
        if cache is None:
            # zero history: pad inside the conv, keep the first T outputs (no copy of x)
            y = F.conv1d(x.transpose(1, 2), weight, bias, padding=W - 1, groups=C)[..., :T]
            return self.act(y.transpose(1, 2)), last_inputs(None, x, n)
        xx = torch.cat([cache[:, cache.shape[1] - (W - 1):].to(x.dtype), x], dim=1)  # [B, T + W - 1, C]
        if T == 1:
            # a decode step: W products summed (conv1d on a 4-long input may pick a general kernel)
            y = (xx * weight[:, 0].t()).sum(1, keepdim=True)
            y = y if bias is None else y + bias
        elif self.fused and _fused_conv_usable(x):
            from fastweight.kernels.conv import short_conv
            y = short_conv(xx, self.weight.view(C, W), self.bias, silu=self.act is F.silu)[:, W - 1:]
            return y, last_inputs(cache, x, n)
        else:
            y = F.conv1d(xx.transpose(1, 2), weight, bias, groups=C).transpose(1, 2)
        return self.act(y), last_inputs(cache, x, n)

    def _packed(self, x, weight, bias, positions):
        return packed_conv(x, weight, bias, positions)


def packed_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor):
    """ShortConv's convolution (no activation) over packed sequences: x [B, T, C], weight [C, 1, W],
    ``positions`` [T] (each token's index in its own sequence); a tap that would reach back past
    the start of the token's sequence reads zero."""
    W, T = weight.shape[-1], x.shape[1]
    y = x * weight[:, 0, W - 1]
    for lag in range(1, min(W, T)):
        shifted = F.pad(x[:, :T - lag], (0, 0, lag, 0)) * (positions >= lag)[None, :, None].to(x.dtype)
        y = y + shifted * weight[:, 0, W - 1 - lag]
    return y if bias is None else y + bias


def packed_positions(x: torch.Tensor, positions: torch.Tensor | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each packed token's index in its own sequence (``positions``, or formed from ``cu_seqlens``);
    packed input has batch size 1."""
    if x.shape[0] != 1:
        raise ValueError(f"`cu_seqlens` packs sequences along time: batch size 1, got {x.shape[0]}")
    if positions is not None:
        return positions
    from fastweight.layers.base import sequence_positions
    return sequence_positions(cu_seqlens, x.shape[1], x.device)


def last_inputs(prev: torch.Tensor | None, x: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` rows along time of ``[prev; x]`` (prev None: zeros before x), in their own memory
    (a view would keep all of x alive in a cache)."""
    seq = x if prev is None else torch.cat([prev.to(x.dtype), x], dim=1)
    L = seq.shape[1]
    return seq[:, L - n:].clone() if L >= n else F.pad(seq, (0, 0, n - L, 0))


def packed_history(x: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, seq: torch.Tensor,
                   lag: int) -> torch.Tensor:
    """x_{t - lag} for each of T packed tokens (x [1, T, C]; ``seq`` [T] each token's sequence): from x
    within the token's sequence, else from its sequence's ``cache`` [N, width, C] (its last inputs,
    newest last)."""
    T, width = x.shape[1], cache.shape[1]
    inside = x[0, (torch.arange(T, device=x.device) - lag).clamp(min=0)] if T else x[0]
    before = cache.to(x.dtype)[seq, (width - (lag - positions)).clamp(0, width - 1)]
    return torch.where((positions >= lag)[:, None], inside, before)[None]


def token_sequences(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """The sequence of each of T packed tokens ([T], int64)."""
    return torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=cu_seqlens.device), right=True)


def packed_tails(x: torch.Tensor, cache: torch.Tensor | None, cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """Each packed sequence's last ``width`` inputs [N, width, C], newest last, reaching into its
    ``cache`` [N, width, C] (None: zeros) where the sequence is shorter."""
    N, T = cu_seqlens.numel() - 1, x.shape[1]
    p = cu_seqlens.diff()[:, None] - width + torch.arange(width, device=x.device)   # in-sequence positions
    if T == 0:
        inside = x.new_zeros(N, width, x.shape[2])
    else:
        inside = x[0, (cu_seqlens[:-1, None] + p).clamp(0, T - 1)]
    before = (x.new_zeros(N, width, x.shape[2]) if cache is None else
              cache.to(x.dtype)[torch.arange(N, device=x.device)[:, None], (width + p).clamp(0, width - 1)])
    return torch.where((p >= 0)[..., None], inside, before)


def packed_conv_cached(x, weight, bias, positions, cu_seqlens, cache, width):
    """ShortConv's convolution (no activation) over packed sequences that continue from a cache:
    ``cache`` [N, >= W-1, C] (None: zeros) holds sequence n's last inputs. Returns (y, the new
    [N, width, C] tails)."""
    W = weight.shape[-1]
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    if cache is not None and cache.shape[0] != cu.numel() - 1:
        raise ValueError(f"the convolution cache is {tuple(cache.shape)}: {cache.shape[0]} sequences, "
                         f"`cu_seqlens` packs {cu.numel() - 1}")
    if cache is None:   # zeros before every sequence: the uncached packed convolution
        y = packed_conv(x, weight, bias, positions)
    else:
        seq = token_sequences(cu, x.shape[1])
        y = x * weight[:, 0, W - 1]
        for lag in range(1, W):
            y = y + packed_history(x, cache, positions, seq, lag) * weight[:, 0, W - 1 - lag]
        y = y if bias is None else y + bias
    if cache is not None and cache.shape[1] < width:   # an older cache, narrower: zeros before it
        cache = F.pad(cache, (0, 0, width - cache.shape[1], 0))
    return y, packed_tails(x, None if cache is None else cache[:, cache.shape[1] - width:], cu, width)


def _fused_conv_usable(x: torch.Tensor) -> bool:
    """Whether the Triton short conv runs: on CUDA, or on the CPU under TRITON_INTERPRET=1 inside
    ``use_backend("triton")`` (fp32/fp16); never in float64 (the PyTorch path is the exact one)
    nor inside ``torch.compile`` (which fuses the PyTorch path itself)."""
    if x.dtype == torch.float64 or torch.compiler.is_compiling() or x.numel() == 0:
        return False
    if x.is_cuda:
        return True
    from fastweight.layers.linear_op import current_backend
    return (os.environ.get("TRITON_INTERPRET") == "1" and current_backend() == "triton"
            and x.dtype != torch.bfloat16)


def _triton_usable(x: torch.Tensor) -> bool:
    """The Triton norm for large inputs (training, prefill; >= 2^20 elements): a decode step's
    few rows cost less through one PyTorch kernel than through a Triton launch from Python."""
    return x.numel() >= _TRITON_MIN_NUMEL and _fused_conv_usable(x)


_TRITON_MIN_NUMEL = 1 << 20


class TokenShift(nn.Module):
    """RWKV's token shift: x_{t-1} for every t (the cache is the last token ``[B, 1, D]``; zero
    before the first token of a sequence)."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None):
        """With ``cu_seqlens`` (packed sequences that continue from a cache): ``cache`` [N, 1, D] (None:
        zeros) is each sequence's last token; returns (shifted, each sequence's new last token)."""
        if cu_seqlens is not None:
            positions = packed_positions(x, positions, cu_seqlens)
            cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
            if cache is not None and cache.shape[:2] != (cu.numel() - 1, 1):
                raise ValueError(f"the token-shift cache is {tuple(cache.shape)}, expected [N, 1, D] = "
                                 f"[{cu.numel() - 1}, 1, D] for {cu.numel() - 1} packed sequences")
            if cache is not None:
                return packed_history(x, cache, positions, token_sequences(cu, x.shape[1]), 1), \
                    packed_tails(x, cache, cu, 1)
            cache_out = packed_tails(x, None, cu, 1)
            return self.forward(x, None, positions)[0], cache_out
        prev = x.new_zeros(x.shape[0], 1, x.shape[2]) if cache is None else cache.to(x.dtype)
        shifted = torch.cat([prev, x[:, :-1]], dim=1)
        if positions is not None:  # packed sequences: the first token of each has no predecessor
            shifted = shifted * (positions > 0)[None, :, None].to(x.dtype)
        return shifted, x[:, -1:]


class LowRank(nn.Module):
    """A LoRA-style MLP ``x -> B act(A x)`` (RWKV's weight preparation, KDA's gates)."""

    def __init__(self, d_in: int, rank: int, d_out: int, activation: str | None = "tanh", bias: bool = False):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.act(self.down(x)))


class SwiGLU(nn.Module):
    """The MLP of every block: W_down (silu(W_gate x) * W_up x)."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        a, b = self.gate_proj(x), self.up_proj(x)
        if a.dtype == b.dtype and _triton_usable(a):
            from fastweight.kernels.swiglu import swiglu
            return self.down_proj(swiglu(a, b))
        return self.down_proj(F.silu(a) * b)


def rotary(x: torch.Tensor, offset: int | torch.Tensor, theta: float = 10000.0,
           tables: dict | None = None) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [B, T, H, D] at positions offset..offset+T-1
    (or at the positions given as a tensor [T]). ``tables``: a dict (the model's per-call ``shared``
    one) that keeps the cos/sin tables for the other layers of the same call."""
    T, D = x.shape[1], x.shape[-1]
    cos, sin = rotary_tables(T, D, offset, theta, x.device, tables)
    if _triton_usable(x):
        from fastweight.kernels.rotary import rotary_triton
        return rotary_triton(x, cos, sin)
    key = ("rotary_full", T, D, theta, offset if isinstance(offset, int) else id(offset), x.device)
    if tables is not None and key in tables:
        cos, sin = tables[key]
    else:
        cos, sin = (torch.cat([t, t], -1)[None, :, None, :] for t in (cos, sin))
        if tables is not None:
            tables[key] = cos, sin
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rotary_tables(T: int, D: int, offset, theta: float, device, tables: dict | None = None):
    """cos and sin of the rotary angles, [T, D/2] fp32 each, reused from ``tables`` when there."""
    key = ("rotary", T, D, theta, offset if isinstance(offset, int) else id(offset), device)
    if tables is not None and key in tables:
        return tables[key]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    if isinstance(offset, torch.Tensor):
        pos = offset.to(device=device, dtype=torch.float32)
    else:
        pos = torch.arange(offset, offset + T, device=device, dtype=torch.float32)
    angle = pos[:, None] * inv_freq[None, :]  # [T, D/2]
    out = angle.cos(), angle.sin()
    if tables is not None:
        tables[key] = out
    return out


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def mamba_decay_init(n_heads: int, dt_min: float = 1e-3, dt_max: float = 0.1, a_range: tuple = (1, 16)):
    """Mamba-2's parameterisation of a log decay: (A_log, dt_bias) with -A = exp(A_log) uniform in
    ``a_range`` (Mamba-2's [1, 16]; fla's Gated DeltaNet draws from (0, 16)) and dt = softplus(. +
    dt_bias) starting log-uniform in [dt_min, dt_max] (floored at 1e-4); g = A * dt <= 0. The median
    head starts at g ~ -0.085 a token: a horizon 1 / |g| of ~12 tokens, from ~0.6 to ~1000."""
    A_log = torch.empty(n_heads).uniform_(*a_range).clamp_min(1e-4).log()
    dt = torch.exp(torch.rand(n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return nn.Parameter(A_log), nn.Parameter(inverse_softplus(dt.clamp(min=1e-4)))
