"""The state pass of the decay family: the one sequential loop, over chunks.

Forward (``reverse=False``), with gc the chunk-local cumulative log decay and G = gc at the
chunk's last token (scalar ``[1, T, H]`` or per channel ``[1, T, H, K]``, or no gate):

    h[c]  = S before chunk c;     S <- Diag(exp G) S + (k * exp(G - gc))^T v

Backward (``reverse=True``), the same loop run from the last chunk with x = q, y = do:

    dh[c] = dL/dS after chunk c;  dS <- Diag(exp G) dS + (scale q * exp(gq))^T do

(gq is gc, or gc one token earlier for RWKV-6's exclusive readout). ``h``/``dh`` are stored
per chunk, ``[NC, H, K, V]``; the loop's last value is the final state (fwd) or dh0 (bwd).
Every exponent is <= 0. ``GATE``: 0 none, 1 scalar, 2 per channel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks


@triton.jit
def decay_state_step(b_h, i_t, x, y, gx, gc, h, bos, boh, T, i_h, i_k, i_v, scale, H: tl.constexpr,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     GATE: tl.constexpr, REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One chunk of the loop: store the state (gradient) h[i_t], then fold chunk i_t in."""
    p_h = tl.make_block_ptr(h + ((boh + i_t) * H + i_h) * K * V, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV),
                            (1, 0))
    tl.store(p_h, b_h.to(p_h.dtype.element_ty), boundary_check=(0, 1))
    p_x = tl.make_block_ptr(x + (bos * H + i_h) * K, (K, T), (1, H * K), (i_k * BK, i_t * BT), (BK, BT), (0, 1))
    p_y = tl.make_block_ptr(y + (bos * H + i_h) * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
    b_x = tl.load(p_x, boundary_check=(0, 1)).to(tl.float32)  # [BK, BT]
    b_y = tl.load(p_y, boundary_check=(0, 1))
    last = bos + tl.minimum(T, i_t * BT + BT) - 1
    if GATE == 1:
        b_gl = tl.load(gc + last * H + i_h)
        p_g = tl.make_block_ptr(gx + bos * H + i_h, (T,), (H,), (i_t * BT,), (BT,), (0,))
        b_gx = tl.load(p_g, boundary_check=(0,))
        b_h *= tl.exp(b_gl)
        if REVERSE:
            b_x *= tl.exp(b_gx)[None, :]
        else:
            b_x *= tl.exp(b_gl - b_gx)[None, :]
    elif GATE == 2:
        o_k = i_k * BK + tl.arange(0, BK)
        b_gl = tl.load(gc + (last * H + i_h) * K + o_k, mask=o_k < K, other=0.)
        p_g = tl.make_block_ptr(gx + (bos * H + i_h) * K, (K, T), (1, H * K), (i_k * BK, i_t * BT), (BK, BT), (0, 1))
        b_gx = tl.load(p_g, boundary_check=(0, 1))
        b_h *= tl.exp(b_gl)[:, None]
        if REVERSE:
            b_x *= tl.exp(b_gx)
        else:
            b_x *= tl.exp(b_gl[:, None] - b_gx)
    if REVERSE:
        b_x *= scale
    b_h += tl.dot(b_x.to(b_y.dtype), b_y, input_precision=DOT_PRECISION)
    return b_h


@triton.jit
def decay_state_pass_kernel(x, y, gx, gc, h, h0, ht, cu_seqlens, chunk_offsets, scale, H: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, GATE: tl.constexpr, REVERSE: tl.constexpr,
                            USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                            WHILE_LOOP: tl.constexpr):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    o_h = o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + o_h, mask=m_h, other=0.).to(tl.float32)
    if WHILE_LOOP:
        # the interpreter cannot iterate range() to a runtime bound
        i_c = 0
        while i_c < NT:
            if REVERSE:
                i_t = NT - 1 - i_c
            else:
                i_t = i_c
            b_h = decay_state_step(b_h, i_t, x, y, gx, gc, h, bos, boh, T, i_h, i_k, i_v, scale, H, K, V, BT, BK, BV,
                                   GATE, REVERSE, DOT_PRECISION)
            i_c += 1
    else:
        # compiled: a for loop, which Triton software-pipelines (the next chunk's loads overlap)
        for i_c in range(0, NT):
            if REVERSE:
                i_t = NT - 1 - i_c
            else:
                i_t = i_c
            b_h = decay_state_step(b_h, i_t, x, y, gx, gc, h, bos, boh, T, i_h, i_k, i_v, scale, H, K, V, BT, BK, BV,
                                   GATE, REVERSE, DOT_PRECISION)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + o_h, b_h, mask=m_h)


def while_loops() -> bool:
    """Loops to a runtime bound run as ``while`` under the interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# the key block is 64 and the V block never narrower, a smaller K or V padded (masked): 16-bit dots
# over narrower blocks are what Triton 3.6 miscompiles on the H200 (decay_output.BK_OUT).
# The V block of the state pass: a sequential loop per program, so more, smaller programs hide
# its latency; larger blocks read the gates fewer times. 64 measured faster on the H200
# (docs/bench/decay_dplr.md). 8 warps, 3 stages: the fastest configuration of
# `python -m fastweight.bench.gpu_sweep` on the H200.
STATE_BV = 64


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (ieee); 16-bit inputs use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def state_pass(x: torch.Tensor, y: torch.Tensor, gx: torch.Tensor | None, gc: torch.Tensor | None,
               chunks: Chunks, initial: torch.Tensor | None, store_final: bool, reverse: bool,
               scale: float = 1.0, state_dtype: torch.dtype | None = None):
    """Per-chunk states (or state gradients) and the last one.

    x: [1, T, H, K] (k forward, q backward); y: [1, T, H, V] (v forward, do backward);
    gx, gc: gates as in the module docstring; initial: [N, H, K, V] (h0 forward, dht backward).
    Returns (h [NC, H, K, V] in ``state_dtype`` (default x's), final [N, H, K, V] fp32 or None).
    """
    _, T, H, K = x.shape
    V = y.shape[-1]
    gate = 0 if gc is None else (1 if gc.dim() == 3 else 2)
    h = torch.empty(chunks.NC, H, K, V, dtype=state_dtype or x.dtype, device=x.device)
    final = torch.empty(chunks.N, H, K, V, dtype=torch.float32, device=x.device) if store_final else None
    BK, BV = 64, STATE_BV
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), chunks.N * H)
    decay_state_pass_kernel[grid](x, y, gx if gx is not None else x, gc if gc is not None else x, h,
                                  initial if initial is not None else h, final if final is not None else h,
                                  chunks.cu_seqlens, chunks.chunk_offsets, scale, H=H, K=K, V=V, BT=chunks.BT,
                                  BK=BK, BV=BV, GATE=gate, REVERSE=reverse, USE_H0=initial is not None,
                                  STORE_HT=store_final, DOT_PRECISION=dot_precision(x.dtype),
                                  WHILE_LOOP=while_loops(), num_warps=8, num_stages=3)
    return h, final
