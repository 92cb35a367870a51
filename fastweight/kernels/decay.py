"""Chunked Triton kernels of the decay family, forward and backward.

    S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T        o_t = S_t^T (scale q_t)

with g_t a scalar per head (Mamba-2 style ``simple_gla``; RetNet's fixed ``g_gamma``; none for
linear attention) or a vector per key channel (GLA, HGRN2 with k = 1 - exp g, RWKV-6 whose
readout is o_t = S_{t-1}^T (scale r_t) + (scale r_t . (u * k_t)) v_t). Stages, in chunks of 64:

    1. gc = chunk-local cumsum of g                        ``cumsum.py``
    2. h[c] = state before chunk c (one loop over chunks)   ``state.py``
    3. A = intra-chunk decayed attention (per-channel gate) ``decay_intra.py``
    4. o = scale (q * exp gq) h[c] + A v                    ``decay_output.py``

A forward without backward forms 4 inside 2 (``DecayLaunch.fused_output``, :func:`fuses_output`): the
pass computes each chunk's output from the state it holds, so no h is stored and q, k, v are read once.

Backward: h is kept from the forward (``DecayLaunch.recompute`` False, the default: K V / 64 values
per token and head in the input dtype, 128 B at K = V = 64 and 512 B at 128 in bf16) or recomputed
(True: one more state pass, less memory); dh[c] (state gradient after chunk c)
comes from the same loop run in reverse, then dv, dA, dq, dk per chunk. When a scalar gate's
gradient is wanted, h and dh are kept wide instead (twice the bytes: fp32 for fp32 inputs; for 16-bit
ones two 16-bit planes, hi = x rounded and lo = (x - hi) rounded, ``state.state_fwd(state_dtype="split")``),
and the 16-bit dots of ``bwd_dqk`` that read them take both planes (two tensor-core dots); the output and
dv kernels, whose dots round the states to 16 bits anyway, read hi alone. Otherwise the
gate's state term exp(G_C) sum_kv h dh and its k dk^inter term would carry one 16-bit
rounding of each state, and with a loss on the final state alone nothing else dilutes them (fp16
dg_gamma up to 1.95x the fuzz's tolerance with 16-bit states, at most 0.31x with both changes:
tests/kernels/test_decay.py, state-only cases). A per-channel gate sums over V alone, and its
16-bit states stay within 0.5 of the tolerance on the same cases. Every cotangent is
made contiguous first (``S.sum()`` hands an expanded one, ``S.mT`` losses a transposed one).

The gate gradient is formed per chunk: a token's gate acts only inside its chunk and on the
state after it, whose gradient dh[c] carries everything later. With G the chunk-local
cumulative log decay (per channel; a scalar gate sums the channels), C the chunk's last token,
h the state before the chunk and dh the gradient of the state after it, for u in the chunk:

    dg_u = sum_{t >= u} q_t dq^inter_t                         dq^inter_t = scale exp(G_t) (h do_t)
         + sum_{t >= u} (q_t dq^pair_t - k_t dk^pair_t)        pairs s < t only (P_ts in both)
         + sum_{t < u} k_t dk^inter_t                          dk^inter_t = exp(G_C - G_t) (dh v_t)
         + exp(G_C) sum_v h dh

The pair (t, s) contributes P_ts = dA_ts dA_ts/dG to dg_u for s < u <= t; the diagonal s = t,
whose decay exp(G_t - G_t) has no gate in it, is left out, and so is every term that would
cancel: the sequence-wide identity dg_s = sum_{t >= s} (q dq - k dk)_t (+ S_T dS_T) holds as
well, but under strong decay its terms, the diagonal and the state's carry, are far larger
than their sum. RWKV-6 reads G_{t-1}: its pairs contribute for s < u < t, its q terms for
t > u, and the pair t = s + 1 (decay exp(G_s - G_s)) is the one left out.
``docs/kernels.md`` (the decay family's gate gradient) has the derivation.

Shapes (fla's): q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or [B, T, H, K];
``initial_state`` [N, H, K, V]; ``cu_seqlens`` [N+1] with B = 1. Returns (o, final state fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastweight.kernels.common import SAFE_SPAN, Chunks, prepare_chunks
from fastweight.kernels.cumsum import chunk_cumsum, gate_chunk_grad
from fastweight.kernels.decay_intra import intra_bwd, intra_fwd
from fastweight.kernels.decay_output import bwd_dqk, bwd_dv, output_fwd, wide_dqk
from fastweight.kernels.state import FUSED_DECAY_MAX_K, state_bwd, state_fwd

BT = 64


@dataclass(frozen=True)
class DecayLaunch:
    """Variants of the decay family's chunk kernels (tests and benchmarks compare them); the
    defaults are the tuned path. ``recompute``: the backward recomputes the chunk states instead of
    keeping the forward's. ``span``: a diagonal sub-chunk whose gates span less is factored
    (``decay_intra``; 0: every one token at a time, 1e30: every one factored). ``fused_output``: a
    forward without backward (grad disabled, or no input requiring it) forms the output in the state pass (K <=
    ``state.FUSED_DECAY_MAX_K``, not RWKV-6's exclusive form), storing no chunk states and reading q, k, v
    once; None (default): where that measured faster (:func:`fuses_output`)."""
    recompute: bool = False
    span: float = SAFE_SPAN
    fused_output: bool | None = None

    def __post_init__(self):
        if not isinstance(self.fused_output, (bool, type(None))):
            raise ValueError(f"DecayLaunch.fused_output must be None, True or False, got {self.fused_output!r}")


# a scalar (or no) gate's pass at a wider K forms its scores beside a [K, V] state in one key block, which
# lost to the separate output kernel at K = 128 (H100, simple_gla (4, 8192, 16, 128): 0.551 against 0.528 ms)
FUSED_SCALAR_MAX_K = 64


def fuses_output(launch: DecayLaunch, K: int, vector: bool, exclusive: bool, dtype: torch.dtype) -> bool:
    """Whether a forward without backward forms its output in the state pass: ``launch.fused_output``, or
    where it is None, for 16-bit inputs (fp32's exact dots spill kilobytes a thread in the one-block pass,
    sm_90) at K <= ``FUSED_SCALAR_MAX_K`` or with a per-channel gate (GLA: its scores come from the intra
    kernel either way) up to ``state.FUSED_DECAY_MAX_K``; never for the exclusive form (RWKV-6)."""
    if exclusive or K > FUSED_DECAY_MAX_K:
        return False
    if launch.fused_output is not None:
        return launch.fused_output
    return dtype != torch.float32 and (vector or K <= FUSED_SCALAR_MAX_K)


def _rounded(h):
    """The 16-bit plane of split states (``state.state_fwd(state_dtype="split")``), else h: the output and dv
    kernels round the states to the inputs' dtype for their dots, so they read that plane alone."""
    return h[0] if h.dim() == 5 else h


class ChunkDecayFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, u, g_gamma, initial_state, scale: float, output_final_state: bool,
                chunks: Chunks, exclusive: bool, launch: DecayLaunch, keep: bool = True):
        T, H = q.shape[1], q.shape[2]
        if exclusive:
            gc, gq = chunk_cumsum(g, chunks, exclusive=True)
        else:
            gc = (chunk_cumsum(g, chunks, g_gamma=g_gamma, heads=H, length=T)
                  if (g is not None or g_gamma is not None) else None)
            gq = gc
        vector = gc is not None and gc.dim() == 4
        if not keep and fuses_output(launch, k.shape[-1], vector, exclusive, q.dtype):
            # no backward: the state pass forms the output, so neither the chunk states nor a second
            # read of q, k, v reaches HBM
            A = intra_fwd(q, k, gq, gc, u, scale, chunks, exclusive, span=launch.span) if vector else None
            _, _, o, ht = state_fwd("decay", k, v, chunks, g=gc, q=q, A=A, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, store_h=False, fuse_output=True)
            ctx.save_for_backward()
            return o, ht
        # a scalar gate's gradient reads exp(G_C) sum_kv h dh per chunk (module docstring)
        scalar_grad = gc is not None and not vector and (ctx.needs_input_grad[3] or ctx.needs_input_grad[5])
        wide = None if not scalar_grad else ("split" if q.dtype in (torch.float16, torch.bfloat16) else torch.float32)
        h, _, _, ht = state_fwd("decay", k, v, chunks, g=gc, initial_state=initial_state,
                                output_final_state=output_final_state, state_dtype=wide)
        A = intra_fwd(q, k, gq, gc, u, scale, chunks, exclusive, span=launch.span) if vector else None
        o = output_fwd(q, k, v, gq, gc, _rounded(h), A, scale, chunks, exclusive)
        ctx.save_for_backward(q, k, v, g, u, gc, gq if exclusive else None, A, initial_state,
                              None if launch.recompute else h)
        ctx.scale, ctx.chunks, ctx.exclusive, ctx.launch, ctx.wide = scale, chunks, exclusive, launch, wide
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, u, gc, gq, A, initial_state, h = ctx.saved_tensors
        scale, chunks, exclusive = ctx.scale, ctx.chunks, ctx.exclusive
        gq = gq if exclusive else gc
        do = do.contiguous()
        if dht is not None:
            dht = dht.contiguous()
        if h is None:
            h, _, _, _ = state_fwd("decay", k, v, chunks, g=gc, initial_state=initial_state, state_dtype=ctx.wide)
        dh, _, dh0 = state_bwd("decay", q, do, chunks, g=gc, gq=gq if exclusive else None, scale=scale, dht=dht,
                               need_dh0=initial_state is not None, state_dtype=ctx.wide)
        # the dq/dk kernel's wide form forms the scores do v^T itself (a scalar gate or none)
        own_scores = A is None and wide_dqk(q.shape[-1], q.dtype)
        dv, dA = bwd_dv(q, k, v, gq, gc, A, _rounded(dh), do, scale, chunks, exclusive, need_dA=not own_scores)
        du = dg = dg_gamma = None
        if A is not None:
            dq, dk, dgx, dga, dgy, du = intra_bwd(q, k, v, gq, gc, u, h, dh, do, dA, scale, chunks, exclusive,
                                                  span=ctx.launch.span)
            if g is not None and ctx.needs_input_grad[3]:
                dg = gate_chunk_grad(dgx, dga, dgy, chunks, dtype=g.dtype)
        else:
            dq, dk, dgt = bwd_dqk(q, k, v, gq, gc, h, dh, do, dA, scale, chunks, exclusive)
            if g is not None and ctx.needs_input_grad[3]:
                dg = dgt.to(g.dtype)
            if ctx.needs_input_grad[5]:
                dg_gamma = dgt.sum((0, 1))
        if du is not None:
            du = du.sum((0, 1)).to(u.dtype)
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg, du, dg_gamma, dh0, None, None, None, None, None, None


def chunk_decay(q, k, v, g=None, *, u=None, g_gamma=None, scale: float, initial_state=None,
                output_final_state: bool = False, cu_seqlens=None, exclusive: bool = False,
                launch: DecayLaunch = DecayLaunch()):
    """The generic entry: g scalar [B, T, H] or vector [B, T, H, K] or None; g_gamma [H] (a log decay
    per head, added to every token's g; its gradient is the sum of theirs); u [H, K] with
    ``exclusive`` (RWKV-6 readout, per-channel g); ``launch`` the kernels' variant (every op's
    mechanism file passes it on). Returns (o [B, T, H, V], final state or None)."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    if exclusive and (g is None or g.dim() != 4 or g_gamma is not None):
        raise ValueError("chunk_decay: the exclusive readout (RWKV-6) takes a per-channel g and no g_gamma")
    chunks = prepare_chunks(cu_seqlens, B, T, BT, q.device)

    def pack(x):
        return None if x is None else x.reshape(1, B * T, *x.shape[2:]).contiguous()

    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if g_gamma is not None:
        g_gamma = g_gamma.float().contiguous()
    if u is not None:
        u = u.contiguous()
    # no backward can follow (grad disabled, or nothing requires it): the forward may keep nothing
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, g, u, g_gamma, initial_state))
    o, ht = ChunkDecayFunction.apply(pack(q), pack(k), pack(v), pack(g), u, g_gamma, initial_state, scale,
                                     output_final_state, chunks, exclusive, launch, keep)
    return o.reshape(B, T, H, V), ht
