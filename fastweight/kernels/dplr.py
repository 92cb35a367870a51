"""Chunked Triton kernels of the generic DPLR recurrence (RWKV-7), forward and backward.

fla's meaning (``a`` is read against the state, ``b`` is the write direction):

    S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T        o_t = S_t^T (scale q_t)

Per chunk of 64 tokens, G the chunk-local cumulative log decay, G^- one token earlier, S the
state before the chunk (the readable spec is ``fastweight/chunk/dplr.py``):

    1. G, G^- from gk, then A_qk, A_qb (s <= t, decays exp(G_t - G_s)), A_ak, A_ab (s < t,
       exp(G^-_t - G_s)), the whole chunk factored through its gates' midpoint, or by sub-chunks,
       in one kernel                                                   ``dplr_intra.py``
    2. T = (I - A_ab)^{-1} (blockwise exact solve)                    ``kkt_solve.py``
       W = T (a * exp(G^-)),  U~ = T A_ak V                          ``dplr_wy.py``
       (bf16: both in one kernel, T's blocks kept in registers,       ``dplr_wy.dplr_solve_wy``)
    3. per chunk in order: U = W S + U~,
       o = scale (q * exp G) S + A_qb U + A_qk V,
       S <- Diag(exp G_e) S + (b exp(G_e - G))^T U + (k exp(G_e - G))^T V   ``state.py``
       (the output in the same pass, so inference stores neither the chunk states nor U;
       ``DplrLaunch(fused_output=False)``: by its own kernel after the pass, ``decay_output.py``)

Backward: the forward's intra-chunk matrices, T, W, the chunk states and the reads U are kept
(``DplrLaunch.recompute`` False, the default) or recomputed (steps 1-3 again, True: fla's choice,
less memory); U~ is kept only where K > 64 (``DplrLaunch.ut_kept``; its one use, dX U~^T in dA_ab,
is (dX V^T) A_ak^T T^T per chunk), and the gates' cumsum is always recomputed (an fp32 gate
gradient is written over it). A_qb, read only by the backward's state pass, is dropped after it
(held outside the saved tensors unless ``saved_tensors_hooks`` are active, which must see it).
Kept, they cost per token and head 4 x 64 + K + V + K V / 64 in the input dtype (A_qk, A_qb, A_ak, T, W, U, h; ``DplrLaunch.factors_fp32`` keeps A_ak and T in fp32),
plus V for U~ where K > 64: 0.9 KiB at K = V = 64, 1.75 KiB at K = V = 128 in bf16, against
0.9 / 1.8 KiB for the inputs the op keeps anyway.
The state gradient runs the loop in reverse (with the reads' gradient dU),
then a program per (chunk, head) (``dplr_bwd.py``; the chunks in launches whose scratch is
bounded) forms dV and the four matrices' gradients (``dplr_wy.local_grads``), takes them to q, k,
a, b and the per-token gate terms (``dplr_intra.py``) and sums those into the gate gradient
inside the chunk, in a form that does not cancel under strong decay (no sequence-wide sum, no
final-state carry).

Every exponential has an argument <= 0, except in the chunks (and diagonal sub-chunks) whose
gates span less than ``common.SAFE_SPAN`` (there, within +-SAFE_SPAN / 2); no gate is clamped.
Shapes: q, k, a, b, gk [B, T, H, K], v [B, T, H, V], ``initial_state`` [N, H, K, V],
``cu_seqlens`` [N+1] (B = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastweight.kernels.common import SAFE_SPAN, Chunks, prepare_chunks
from fastweight.kernels.cumsum import chunk_cumsum
from fastweight.kernels.decay_output import output_fwd
from fastweight.kernels.dplr_bwd import dplr_bwd
from fastweight.kernels.dplr_intra import dplr_intra_fwd, fwd_launch_config
from fastweight.kernels.state import state_bwd, state_fwd
from fastweight.kernels.dplr_wy import dplr_solve_wy, dplr_wy_fwd
from fastweight.kernels.kkt_solve import solve

BT = 64
# the output is formed in the forward state pass up to this key size (timed there: RWKV-7 forward -2.8 ms
# at (8, 16384, 64, 64), -4% at (4, 8192, 16, 128), H100); at K = 256 that pass spills 928 B a thread
# against 560 B without the output (sm_90 compile), untimed, so it keeps the output kernel
FUSED_OUTPUT_MAX_K = 128


@dataclass(frozen=True)
class DplrLaunch:
    """Variants of the DPLR chunk kernels (tests and benchmarks compare them); the defaults are the
    tuned path. ``recompute``: the backward recomputes steps 1-3 instead of keeping the forward's
    intermediates. ``span``: a chunk (and a diagonal sub-chunk) whose gates span less is factored
    (0: none, 1e30: every one). ``wide_kernel``: the wider chunks' forward in its own kernel
    (False: in the main one), one program per sub-chunk (``wide_grid`` "sub_chunk") or per chunk
    ("chunk"). ``intra_config`` (BK, (num_warps, num_stages)) of the intra forward,
    ``bwd_blocks`` (BK, BV) and ``bwd_config`` (num_warps, num_stages) of the backward's main kernel
    (split: of both its launches, which otherwise take their own, ``dplr_bwd.launch_config``),
    ``bwd_programs`` its chunks a launch (0: all in one, the scratch as large as the input),
    ``state_block_v`` the state passes' V block: None is each launcher's own choice by shape.
    ``state_grads_fp32``: the backward state pass stores dh [NC, H, K, V] and dU [1, T, H, V] in fp32
    (default False: in the input dtype, fla's choice for dh, 2 GiB less at B 8, T 16384, H 64,
    K = V = 64, except dh for fp16 inputs, kept in fp32 (a constant cotangent rounds every entry of dh
    the same way: dk 15x the PyTorch path's error, GPU fuzz); they accumulate in fp32 either way, only
    the stored copies are rounded). ``factors_fp32``: T = (I - A_ab)^{-1} and A_ak, kept from the
    forward for the backward, stored in fp32 (default False: in the input dtype, 2 GiB less at that
    shape; the solve still reads an fp32 A_ab). ``ut_kept``: U~ kept from the forward for the backward
    (False: recomputed per chunk, 1 GiB less at that shape; None: kept where K > 64, whose backward
    the recompute makes 14% slower on the H100, against 3% at K = 64). ``fused_output``: the output
    formed in the forward state pass where K <= ``FUSED_OUTPUT_MAX_K`` (False: by its own kernel, ``decay_output``, from the stored
    chunk states and reads; the pass then stores them whether or not a backward follows).
    ``bwd_split``: the fused backward in two launches, its local part and its intra part, the four
    dA's through fp32 buffers (``dplr_bwd.dplr_bwd(split=True)``; None, the default: split where
    K <= ``dplr_bwd.SPLIT_MAX_K``; split, ``bwd_programs`` 0 also puts every chunk's dA slot in one
    launch: 16 B a token, head and chunk row on top of the scratch). ``bwd_early`` (default True): split, the
    first launch forms, stores and drops dA_qk and dA_qb before the rest (two fp32 [64, 64]
    accumulators live instead of four; sm_90 spill at K = 64 376 -> 176 B; H100, (8, 16384, 64, 64)
    fwd+bwd -2.8%, docs/bench/decay_dplr.md); False forms the four together. ``solve_wy``: the solve and W, U~ in
    one kernel, T held on chip between them (``dplr_wy.dplr_solve_wy``; stored only for a backward), in
    ``solve_wy_config`` (num_warps, BK, BV; None: ``dplr_wy.SOLVE_WY_CONFIG``); None, the default: for
    bf16 inputs (H100, RWKV-7 (8, 16384, 64, 64) forward 18.35 -> 16.62 ms; fp16's 3 x TF32 dots spill
    200-400 B a thread there and its forward went 28.3 -> 34.8 ms, fp32 spills 1.2-1.7 KB). Fused, A_ab (fp32)
    is live beside W and U~: at that shape a forward without backward peaks 1 GiB higher (2 GiB for one that keeps
    T, still below the backward's peak: fwd+bwd 38.88 GiB either way). ``bwd_gate_sums``: the backward's gate
    sums formed in its state pass (``state.state_bwd(gate_sums=...)``) instead of by ``chunk_cumsum`` before it;
    None, the default: for bf16 inputs where K <= 64 (``gate_sums_in_pass``; H100, RWKV-7 (8, 16384, 64, 64)
    fwd+bwd 80.07 -> 79.42 ms; at K = 128 the pass gains 56 B of stack a thread and the H200 measured +5.4% at
    (4, 8192, 16, 128); fp16 and fp32 untimed). ``fwd_gate_sums``: the forward state pass forms the gate's chunk
    sums from the raw log gate (``state.state_fwd(raw_gate=True)``), so the intra kernel stores them only for its
    wide chunks (one [T, H, K] fp32 write less where K fits its one key block); None, the default:
    ``fwd_gate_sums_in_pass``. Rounding dh, dU, T and A_ak
    costs bf16 ~8% in the worst error (H200: 3.62e-3 -> 3.91e-3 at (1, 1024, 4, 32, 128), fla's
    5.1e-3 the bound) for 4 GiB."""
    recompute: bool = False
    span: float = SAFE_SPAN
    wide_kernel: bool = True
    wide_grid: str = "sub_chunk"
    intra_config: tuple[int, tuple[int, int]] | None = None
    bwd_blocks: tuple[int, int] | None = None
    bwd_config: tuple[int, int] | None = None
    bwd_programs: int | None = None
    state_block_v: int | None = None
    state_grads_fp32: bool = False
    factors_fp32: bool = False
    ut_kept: bool | None = None
    fused_output: bool = True
    bwd_split: bool | None = None
    bwd_early: bool = True
    solve_wy: bool | None = None
    solve_wy_config: tuple[int, int, int] | None = None
    bwd_gate_sums: bool | None = None
    fwd_gate_sums: bool | None = None

    def __post_init__(self):
        for name in ("bwd_split", "solve_wy", "bwd_gate_sums", "fwd_gate_sums"):
            if not isinstance(getattr(self, name), (bool, type(None))):
                raise ValueError(f"DplrLaunch.{name} must be None, True or False, got {getattr(self, name)!r}")


def gate_sums_in_pass(launch: DplrLaunch, K: int, dtype: torch.dtype) -> bool:
    """Whether the backward state pass forms the gate sums (``DplrLaunch.bwd_gate_sums``; None: bf16, K <= 64)."""
    if launch.bwd_gate_sums is not None:
        return launch.bwd_gate_sums
    return dtype == torch.bfloat16 and K <= 64


# the forward's gate sums formed in its state pass up to this key size, for FWD_GATE_SUMS_DTYPES (H100, RWKV-7
# (8, 16384, 64, 64) fwd 16.36 -> 15.73 ms, fwd+bwd 78.52 -> 77.70; a wider K keeps its intra kernel's sums
# for its key blocks, so nothing is saved there: docs/bench/decay_dplr.md)
FWD_GATE_SUMS_MAX_K = 64
FWD_GATE_SUMS_DTYPES = (torch.bfloat16,)


def fwd_gate_sums_in_pass(launch: DplrLaunch, K: int, dtype: torch.dtype) -> bool:
    """Whether the forward state pass forms the gate sums (``DplrLaunch.fwd_gate_sums``; None: K <=
    ``FWD_GATE_SUMS_MAX_K`` in ``FWD_GATE_SUMS_DTYPES`` where the intra kernel takes K in one key block, the
    one case in which it then stores no sums). Only a forward whose output the pass forms uses it: the
    output kernel reads the sums too."""
    if launch.fwd_gate_sums is not None:
        return launch.fwd_gate_sums
    BK = (launch.intra_config or fwd_launch_config(K, dtype))[0]
    return dtype in FWD_GATE_SUMS_DTYPES and K <= min(FWD_GATE_SUMS_MAX_K, BK)


def _intra(q, k, a, b, gk, scale: float, chunks: Chunks, launch: DplrLaunch, gate_sums: bool = True):
    """Step 1: gc (None without ``gate_sums``), A_qk, A_qb, A_ak, A_ab, the chunks' wide flags and a exp(G^-)."""
    factors = torch.float32 if launch.factors_fp32 else q.dtype
    return dplr_intra_fwd(q, k, a, b, gk, scale, chunks, span=launch.span, wide_kernel=launch.wide_kernel,
                          config=launch.intra_config, wide_grid=launch.wide_grid, ak_dtype=factors,
                          gate_sums=gate_sums)


def _saved_tensors_hooked() -> bool:
    """Whether a ``saved_tensors_hooks`` context is active (non-reentrant checkpointing, offloading
    to the CPU): it must see every tensor kept for the backward. torch has no public query; where
    the private one is missing, assume one is."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _read_dtype(q: torch.Tensor):
    """The dtype the forward keeps the reads U = U~ + W S in for the backward: fp32 for fp16
    inputs, else the inputs'. db and dk take U dS'^T; a cotangent shared along V (``S.sum()``'s,
    or an expanded one) makes each of their entries one sum over V and the value heads, which can
    cancel to a small fraction of its terms, and fp16's rounding of U then dominates (T = 1, 4
    value heads, 216x cancellation, H100: db 5.50e-3 with fp16 reads, 3.31e-3 with fp32 ones,
    against a fuzz tolerance of 4.5e-3; the PyTorch path 4.0e-4). fp16 keeps dh in fp32 for the
    like reason. bf16 keeps its reads at its own resolution. Reads that only feed the output are
    kept in v's dtype (the output multiplies them in it)."""
    return torch.float32 if q.dtype == torch.float16 else None


def _prepare(q, k, v, a, b, gk, scale: float, chunks: Chunks, launch: DplrLaunch, need_t: bool = True,
             gate_sums: bool = True):
    """Steps 1-2: gates, the four intra-chunk matrices, T, W and U~ (and the chunks' wide flags);
    T is None where ``need_t`` is False and the solve is fused with W and U~ (``launch.solve_wy``); gc is None
    without ``gate_sums``."""
    T, H = q.shape[1], q.shape[2]
    factors = torch.float32 if launch.factors_fp32 else q.dtype
    gc, Aqk, Aqb, Aak, Aab, wide, ag = _intra(q, k, a, b, gk, scale, chunks, launch, gate_sums)
    if launch.solve_wy or (launch.solve_wy is None and q.dtype == torch.bfloat16):
        Ai, w, ut = dplr_solve_wy(Aab, ag, v, Aak, chunks, dtype=a.dtype, t_dtype=factors if need_t else None,
                                  config=launch.solve_wy_config)
        return gc, Aqk, Aqb, Aak, Ai, w, ut, wide
    Ai = solve(Aab, torch.full((1, T, H), -1.0, device=q.device), chunks, dtype=factors, precision_of=q.dtype)
    del Aab  # the solve's only: freed before W and U~ are allocated (fp32, 2 GiB at B 8, T 16384, H 64, K 64)
    w, ut = dplr_wy_fwd(ag, v, Ai, Aak, chunks, dtype=a.dtype)
    return gc, Aqk, Aqb, Aak, Ai, w, ut, wide


class ChunkDplrFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, a, b, gk, initial_state, scale: float, output_final_state: bool, chunks: Chunks,
                launch: DplrLaunch, keep: bool):
        fused = launch.fused_output and k.shape[-1] <= FUSED_OUTPUT_MAX_K
        # the pass forms the gate sums itself: nothing before it stores them (the backward forms its own)
        raw = fused and fwd_gate_sums_in_pass(launch, k.shape[-1], q.dtype)
        gc, Aqk, Aqb, Aak, Ai, w, ut, wide = _prepare(q, k, v, a, b, gk, scale, chunks, launch,
                                                      need_t=keep and not launch.recompute, gate_sums=not raw)
        if fused:
            # the chunk states and reads are stored only for a backward that keeps them
            store = keep and not launch.recompute
            h, u, o, ht = state_fwd("dplr", k, v, chunks, g=gk if raw else gc, w=w, u=ut, b=b, q=q, A=Aqk, A2=Aqb,
                                    scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                                    store_h=store, store_r=store, fuse_output=True, block_v=launch.state_block_v,
                                    r_dtype=_read_dtype(q), raw_gate=raw)
        else:
            h, u, _, ht = state_fwd("dplr", k, v, chunks, g=gc, w=w, u=ut, b=b, initial_state=initial_state,
                                    output_final_state=output_final_state, store_r=True,
                                    block_v=launch.state_block_v,
                                    r_dtype=_read_dtype(q) if keep and not launch.recompute else None)
            o = output_fwd(q, k, v, gc, gc, h, Aqk, scale, chunks, False, A2=Aqb, v2=u)
        if not keep:
            ctx.save_for_backward()
            ctx.aqb = []
            return o, ht
        ut_kept = launch.ut_kept if launch.ut_kept is not None else k.shape[-1] > 64
        kept = (Aqk, Aak, Ai, w, ut if ut_kept else None, h, u, wide) if not launch.recompute else ()
        # A_qb's one reader in the backward is its state pass; a saved tensor would live until the
        # backward returns, through dplr_bwd's peak, so it is held here and dropped after that pass
        # (a second backward through a retained graph recomputes it); saved, where hooks must see it
        hooked = not launch.recompute and _saved_tensors_hooked()
        ctx.save_for_backward(q, k, v, a, b, gk, initial_state, *kept, *((Aqb,) if hooked else ()))
        ctx.aqb = [Aqb] if not launch.recompute and not hooked else []
        ctx.scale, ctx.chunks, ctx.launch = scale, chunks, launch
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, a, b, gk, initial_state, *kept = ctx.saved_tensors
        scale, chunks, launch = ctx.scale, ctx.chunks, ctx.launch
        # autograd hands cotangents in any strides (S.sum(): stride 0; through S.mT: transposed);
        # the kernels read both as contiguous
        do = do.contiguous()
        dht = dht.contiguous() if dht is not None else None
        if launch.recompute:
            gc, Aqk, Aqb, Aak, Ai, w, ut, wide = _prepare(q, k, v, a, b, gk, scale, chunks, launch)
            h, u, _, _ = state_fwd("dplr", k, v, chunks, g=gc, w=w, u=ut, b=b, initial_state=initial_state,
                                   store_r=True, block_v=launch.state_block_v, r_dtype=_read_dtype(q))
        else:
            Aqk, Aak, Ai, w, ut, h, u, wide, *saved_aqb = kept
            try:
                Aqb = saved_aqb[0] if saved_aqb else ctx.aqb.pop()
            except IndexError:  # taken by an earlier backward through this graph
                gc, _, Aqb, *_ = _intra(q, k, a, b, gk, scale, chunks, launch)
            else:
                gc = None
        grads_dtype = torch.float32 if launch.state_grads_fp32 else None  # None: the inputs' dtypes
        # fp16 keeps dh in fp32: a constant cotangent (S.sum()'s) makes every entry of dh one value,
        # rounded the same way, and the shared bias (2.7e-4) survives the cancellation in dk
        state_dtype = torch.float32 if q.dtype == torch.float16 else grads_dtype
        sums = {}
        gate_sums = gate_sums_in_pass(launch, k.shape[-1], q.dtype)
        if gc is None and gate_sums:  # the pass forms the sums from the raw gate and stores them
            gc = torch.empty(gk.shape, dtype=torch.float32, device=gk.device)
            sums = dict(g=gk, gate_sums=gc)
        elif gc is None:
            gc = chunk_cumsum(gk, chunks)
        dh, du, dh0 = state_bwd("dplr", q, do, chunks, **(sums or dict(g=gc)), w=w, b=b, A=Aqb, scale=scale,
                                dht=dht, need_dh0=initial_state is not None, state_dtype=state_dtype,
                                dr_dtype=grads_dtype, block_v=launch.state_block_v)
        del Aqb  # the state pass's only reader: freed before the backward's peak
        dq, dk, dv, da, db, dg = dplr_bwd(q, k, v, a, b, gc, gk, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, wide, scale,
                                          chunks, span=launch.span, blocks=launch.bwd_blocks,
                                          config=launch.bwd_config, programs=launch.bwd_programs,
                                          split=launch.bwd_split, early=launch.bwd_early)
        del dh, du  # before a 16-bit gate's copy of dg is allocated
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, da, db, dg.to(gk.dtype), dh0, None, None, None, None, None


def chunk_dplr(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False,
                          cu_seqlens=None, launch: DplrLaunch = DplrLaunch(), **_):
    """Generic DPLR, fla's meaning: S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,
    o_t = S_t^T (scale q_t); ``launch`` the kernels' variant. Returns (o [B, T, H, V], final state
    [N, H, K, V] fp32 or None)."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    chunks = prepare_chunks(cu_seqlens, B, T, BT, q.device)

    def pack(x):
        return x.reshape(1, B * T, *x.shape[2:]).contiguous()

    if initial_state is not None:
        initial_state = initial_state.contiguous()
    # the forward's intermediates are kept only when a backward can follow
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, a, b, gk, initial_state))
    o, ht = ChunkDplrFunction.apply(pack(q), pack(k), pack(v), pack(a), pack(b), pack(gk), initial_state, scale,
                                    output_final_state, chunks, launch, keep)
    return o.reshape(B, T, H, V), ht
