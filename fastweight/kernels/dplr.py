"""Chunked Triton kernels of the generic DPLR recurrence (RWKV-7), forward and backward.

fla's meaning (``a`` is read against the state, ``b`` is the write direction):

    S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T        o_t = S_t^T (scale q_t)

Per chunk of 64 tokens, G the chunk-local cumulative log decay, G^- one token earlier, S the
state before the chunk (the readable spec is ``fastweight/chunk/dplr.py``):

    1. A_qk, A_qb (s <= t, decays exp(G_t - G_s)), A_ak, A_ab (s < t, exp(G^-_t - G_s)),
       the whole chunk factored through its gates' midpoint, or by sub-chunks ``dplr_intra.py``
    2. T = (I - A_ab)^{-1} (blockwise exact solve)                    ``kkt_solve.py``
       W = T (a * exp(G^-)),  U~ = T A_ak V                          ``dplr_wy.py``
    3. per chunk in order: U = W S + U~,
       S <- Diag(exp G_e) S + (b exp(G_e - G))^T U + (k exp(G_e - G))^T V   ``dplr_state.py``
    4. o = scale (q * exp G) S + A_qb U + A_qk V                     ``decay_output.py``

Backward: the forward's intra-chunk matrices, T, W, U~, the chunk states and the reads U are
kept (``RECOMPUTE = False``, the default) or recomputed (steps 1-3 again, ``RECOMPUTE = True``:
fla's choice, less memory); the gates' cumsum is always recomputed. Kept, they cost per token
and head 4 x 64 fp32 (A_qk, A_qb, A_ak, T) + K + 2 V + K V / 64 in the input dtype (W, U~, U,
h): 1.5 KB at K = V = 64, 2.3 KB at K = V = 128 in bf16, against 0.9 / 1.8 KB for the inputs
the op keeps anyway. The state gradient runs the loop in reverse (with the reads' gradient dU),
then one program per chunk (``dplr_bwd.py``) forms dV and the four matrices' gradients
(``dplr_wy.local_grads``) and takes them to q, k, a, b and the per-token gate terms
(``dplr_intra.py``), which a last pass sums into dgk chunk by chunk, in a form that does not
cancel under strong decay (``dplr_bwd.py``; no sequence-wide sum, no final-state carry).

Every exponential has an argument <= 0, except in the chunks (and diagonal sub-chunks) whose
gates span less than ``decay_intra.SAFE_SPAN`` (there, within +-SAFE_SPAN / 2); no gate is clamped. Shapes: q, k, a, b, gk
[B, T, H, K], v [B, T, H, V], ``initial_state`` [N, H, K, V], ``cu_seqlens`` [N+1] (B = 1).
"""

from __future__ import annotations

import torch

from fastweight.kernels.common import Chunks, prepare_chunks
from fastweight.kernels.decay_gate import gate_cumsum
from fastweight.kernels.decay_output import output_fwd
from fastweight.kernels.dplr_bwd import dplr_bwd
from fastweight.kernels.dplr_intra import dplr_intra_fwd
from fastweight.kernels.dplr_state import dplr_state_bwd, dplr_state_fwd
from fastweight.kernels.dplr_wy import dplr_wy_fwd
from fastweight.kernels.kkt_solve import solve

BT = 64
# keep the forward's intermediates for the backward (False) or recompute them there (True)
RECOMPUTE = False


def _prepare(q, k, v, a, b, gk, scale: float, chunks: Chunks):
    """Steps 1-2: gates, the four intra-chunk matrices, T, W and U~."""
    T, H = q.shape[1], q.shape[2]
    gc, gp = gate_cumsum(gk, None, chunks, H, T, exclusive=True)
    Aqk, Aqb, Aak, Aab = dplr_intra_fwd(q, k, a, b, gc, gp, scale, chunks)
    Ai = solve(Aab, torch.full((1, T, H), -1.0, device=q.device), chunks)
    w, ut = dplr_wy_fwd(a, v, gp, Ai, Aak, chunks)
    return gc, gp, Aqk, Aqb, Aak, Ai, w, ut


class ChunkDplrFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, a, b, gk, initial_state, scale: float, output_final_state: bool, chunks: Chunks):
        gc, gp, Aqk, Aqb, Aak, Ai, w, ut = _prepare(q, k, v, a, b, gk, scale, chunks)
        h, u, ht = dplr_state_fwd(k, v, b, gc, w, ut, chunks, initial_state, output_final_state)
        o = output_fwd(q, k, v, gc, gc, h, Aqk, scale, chunks, False, A2=Aqb, v2=u)
        kept = (Aqk, Aqb, Aak, Ai, w, ut, h, u) if not RECOMPUTE else ()
        ctx.save_for_backward(q, k, v, a, b, gk, initial_state, *kept)
        ctx.scale, ctx.chunks, ctx.recompute = scale, chunks, RECOMPUTE
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, a, b, gk, initial_state, *kept = ctx.saved_tensors
        scale, chunks = ctx.scale, ctx.chunks
        # autograd hands cotangents in any strides (S.sum(): stride 0; through S.mT: transposed);
        # the kernels read both as contiguous
        do = do.contiguous()
        dht = dht.contiguous() if dht is not None else None
        if ctx.recompute:
            gc, gp, Aqk, Aqb, Aak, Ai, w, ut = _prepare(q, k, v, a, b, gk, scale, chunks)
            h, u, _ = dplr_state_fwd(k, v, b, gc, w, ut, chunks, initial_state, False)
        else:
            Aqk, Aqb, Aak, Ai, w, ut, h, u = kept
            gc, gp = gate_cumsum(gk, None, chunks, q.shape[2], q.shape[1], exclusive=True)
        dh, du, dh0 = dplr_state_bwd(q, b, gc, w, Aqb, do, dht, scale, chunks, initial_state is not None)
        dq, dk, dv, da, db, dg = dplr_bwd(q, k, v, a, b, gc, gp, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, scale, chunks,
                                          gk.dtype)
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, da, db, dg, dh0, None, None, None


def chunk_dplr_delta_rule(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False,
                          cu_seqlens=None, **_):
    """Generic DPLR, fla's meaning: S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,
    o_t = S_t^T (scale q_t). Returns (o [B, T, H, V], final state [N, H, K, V] fp32 or None)."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    chunks = prepare_chunks(cu_seqlens, B, T, BT, q.device)

    def pack(x):
        return x.reshape(1, B * T, *x.shape[2:]).contiguous()

    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, ht = ChunkDplrFunction.apply(pack(q), pack(k), pack(v), pack(a), pack(b), pack(gk), initial_state, scale,
                                    output_final_state, chunks)
    return o.reshape(B, T, H, V), ht


def chunk_rwkv7(r, w, k, v, a, b, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """RWKV-7 with fla's arguments: ``chunk_dplr_delta_rule(q=r, k, v, a, b, gk=w)``, w the log decay,
    a = -kappa^ (read), b = kappa^ * iclr (write)."""
    return chunk_dplr_delta_rule(r, k, v, a, b, w, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens)
