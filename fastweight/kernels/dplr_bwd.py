"""The per-chunk backward of the generic DPLR chunk algorithm: a program per (chunk, head).

Given the state pass's results (h, dh, U, dU from ``state.py``), a program

    1. forms dV and the four intra-chunk matrices' gradients dA_qk, dA_qb, dA_ak, dA_ab (in
       registers) and the parts of dq, dk, da, db that pass through the states (fp32 scratch):
       ``dplr_wy.local_grads``;
    2. takes the dA's to q, k, a, b (``dplr_intra.py``): a chunk whose gates span less than
       ``common.SAFE_SPAN`` (every RWKV-7 chunk: 64 x 0.607 = 38.8) factors every decay
       through the per-channel midpoint of its gates, eight [BT, BT] x [BT, BK] dots per K block;
       a wider one goes sub-chunk by sub-chunk from the stored dA's (reference rows between
       sub-chunks, the diagonal ones factored or token at a time);
    3. stores dq, dk, da, db and three per-token gate terms, which ``dplr_gate_bwd_kernel`` sums
       into the gate gradient.

The gate gradient, per key channel, chunk by chunk. With G the chunk-local cumulative log gate,
G^-_t = G_{t-1} (q, k, b read at G, a at G^-), h the state before chunk c and dh' the gradient
of the state after it, C the chunk's last valid token, for u in the chunk

    dg_u = sum_{t >= u} dgk_t + sum_{t > u} dga_t + sum_{t < u} dgs_t + exp(G_C) rowsum(h * dh')

    dgk = q dq - k dk - b db     every part of dq, dk, db read at G, but the pairs and the state terms
    dga = a da                   every part of da (read at G^-), but the pairs
    dgs = k dk^S + b db^S        the chunk-end state terms, dk^S = (V dh'^T) exp(G_C - G) (db^S: U)

all sums inside the chunk: a pair (t, s) of an intra-chunk matrix depends on the gates strictly
after s up to t (t - 1 for the a rows), which is rowsum(dA * A) - colsum(dA * A) summed in
reverse; the state S_C = Diag(exp G_C) h + sum_s (k_s exp(G_C - G_s)) v_s^T + (b_s exp(G_C - G_s)) u_s^T
depends on the gates after s, a forward exclusive sum. The pairs without a gate, the diagonal of
dA_qk, dA_qb (exp(G_t - G_t)) and the subdiagonal of dA_ak, dA_ab (exp(G^-_t - G_{t-1})), are left
out (``dplr_wy.local_grads``): their terms cancel exactly, and under strong decay they dominate.
The sequence-wide form (sum_{t >= u} of q dq - k dk - b db + a da, plus the carry ht * dht) is
the same in exact arithmetic, but cancels those pairs and the state terms against the carry.

The scratch written in 1 is read back in 2 by other threads of the same program, after a barrier;
3 stores the gate terms over it (read first, then overwritten after a barrier), and the gate
kernel reads them.

Fused (one launch, the default where K > 64, ``SPLIT_MAX_K``), a program holds the dA's of 1 in
registers through 2 and stores them only for a wide chunk, in that chunk's slot. Split (the default
where K <= 64, where the fused program spills ~1.1 KB a thread), 1 and 2 are two launches of the
same kernel (PHASE 1, 2): the first stores every chunk's dA's in its launch slot and its scratch
rows, the second (same stream: after the first ends) reads both back. Each launch has its own
blocks and warps (``launch_config``). Nothing of it outlives that, so the chunks go in launches of P (the main
kernel, then the gate kernel, then the next P), each program with its own scratch rows:
4 x P x BT x H x K fp32 (at most ``SCRATCH_BYTES``), where one launch of all needs 4 x T x H x K (16 B a token and key
channel: 8.6 GB at B 8, T 16384, H 64, K 64). A loop over chunks inside the kernel would do the
same in one launch, but doubles its register spill (``bench.compile_delta``, sm_90, bf16: 2,160
against 1,080 B a thread at K = 64, 1,624 against 608 at K = 128); the gate sum inside the main
kernel (one kernel, no second read of the terms) made the backward 11-17% slower on the H100
(its occupancy of one CTA an SM for a latency-bound pass).
Shapes as in ``dplr.py``: q, k, a, b, gk and gc (its chunk-local sums, fp32; G^- = gc - gk is
formed where read) [1, T, H, K]; v, U, dU, dO [1, T, H, V]; A's [1, T, H, BT];
h, dh [NC, H, K, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels.common import Chunks, SAFE_SPAN, chunk_bounds, dot_precision, exp
from fastweight.kernels.decay_intra import diag_precision, span_ref
from fastweight.kernels.dplr_intra import bwd_finish, bwd_sub, factored_bwd, load_gp, load_rows
from fastweight.kernels.dplr_wy import local_grads


# the backward runs split (two launches, the dA's through launch slots) up to this key size: at K = 64
# the fused kernel spills ~1.1 KB a thread (sm_90), at K = 128 432 B, where the split is slower
SPLIT_MAX_K = 64


def default_split(K: int) -> bool:
    """Whether ``dplr_bwd`` splits its main kernel by default at key size K."""
    return K <= SPLIT_MAX_K


def launch_config(K: int, phase: int = 0) -> tuple[tuple[int, int], tuple[int, int]]:
    """((BK, BV), (num_warps, num_stages)) of dplr_bwd_kernel's ``phase`` at key size K, one stage
    each (the launcher narrows a block to a smaller K or V). Fused (0): K <= 64 blocks 32 x 64 with
    4 warps, wider K 64 x 64 with 8 warps. Split: the local part (1) 32 x 32 with 4 warps, the intra
    part (2, no V block) 64-wide key blocks with 8 warps. Each the fastest of 13 configurations per
    phase for RWKV-7 bf16 forward+backward at K = V = 64 and 128 (docs/bench/decay_dplr.md)."""
    if phase == 1:
        return (32, 32), (4, 1)
    if phase == 2:
        return (64, 64), (8, 1)
    return ((32, 64), (4, 1)) if K <= 64 else ((64, 64), (8, 1))


@triton.jit
def dplr_bwd_kernel(q, k, v, a, b, gc, gk, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, wide, slots, dAqk, dAqb, dAak, dAab,
                    pairs, dq_s, dk_s, da_s, db_s, dq, dk, dv, da, db, cu_seqlens, chunk_indices, scale, t0,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, DOT_PRECISION: tl.constexpr, DIAG_PRECISION: tl.constexpr,
                    SPAN: tl.constexpr, SLOTTED: tl.constexpr, UT_KEPT: tl.constexpr, PHASE: tl.constexpr,
                    EARLY: tl.constexpr):
    """Program (p, head) takes chunk t0 + p, its scratch the rows ``p * BT ...`` of the [P * BT, H, K]
    fp32 buffers dq_s, dk_s, da_s, db_s (``dplr_bwd`` launches the chunks P at a time); not
    SLOTTED (one launch of all), the chunk's own rows of [T, H, K] buffers.
    DOT_PRECISION serves the local part and the whole-chunk path (its [BT, BT] fp32 operands: 3 x
    TF32 there would need more shared memory than the H200 has), DIAG_PRECISION the diagonal
    sub-chunks of the sub-chunk path and the local part's dots with dh (``local_grads``). ``wide``
    [NC, H]: the forward's branch (``dplr_intra_fwd``); ``slots`` [NC]: a wide chunk's place in the
    dA buffers, [slots, BT, H, BT] (only wide chunks have one). PHASE 0 runs both halves; split
    (``dplr_bwd(split=True)``), PHASE 1 runs the local part and stores every chunk's dA's in its
    launch slot (p), PHASE 2 reads them back and takes them to q, k, a, b, so that neither program
    holds the other's tiles."""
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_t = t0 + i_p
    i_c, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    # the program's scratch rows, addressed as the chunk's rows of a [T, H, K] buffer (every
    # scratch index below is unchanged); the gate terms go over three of them
    if SLOTTED:
        rebase = (i_p * BT - bos - i_c * BT) * H * K
        dq_c, dk_c, da_c, db_c = dq_s + rebase, dk_s + rebase, da_s + rebase, db_s + rebase
    else:
        dq_c, dk_c, da_c, db_c = dq_s, dk_s, da_s, db_s
    p_A = ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
    if PHASE != 2:
        # EARLY: local_grads stores the dA's in the launch slot p (see below); else it reads no dA pointer
        slot = (i_p * BT - bos - i_c * BT) * H * BT if EARLY else 0
        b_dqk, b_dqb, b_dak, b_dab = local_grads(q, k, v, gc, gk, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, dv, dq_c,
                                                 dk_c, da_c, db_c, pairs, dAqk + slot, dAqb + slot, dAak + slot,
                                                 dAab + slot, i_t, i_c, bos, T, i_h, scale, H, K, V, BT, BK, BV,
                                                 DOT_PRECISION, DIAG_PRECISION, UT_KEPT, EARLY)
    if PHASE != 0:
        # the launch slot p, addressed as the chunk's rows of a [T, H, BT] buffer
        rebase = (i_p * BT - bos - i_c * BT) * H * BT
        dAqk, dAqb, dAak, dAab = dAqk + rebase, dAqb + rebase, dAak + rebase, dAab + rebase
    if PHASE == 1:
        if not EARLY:
            tl.store(dAqk + p_A, b_dqk, mask=m_t[:, None])
            tl.store(dAqb + p_A, b_dqb, mask=m_t[:, None])
            tl.store(dAak + p_A, b_dak, mask=m_t[:, None])
            tl.store(dAab + p_A, b_dab, mask=m_t[:, None])
    elif tl.load(wide + i_t * H + i_h) == 0:
        if PHASE == 0:
            tl.debug_barrier()
        elif PHASE == 2:
            b_dqk = tl.load(dAqk + p_A, mask=m_t[:, None], other=0.)
            b_dqb = tl.load(dAqb + p_A, mask=m_t[:, None], other=0.)
            b_dak = tl.load(dAak + p_A, mask=m_t[:, None], other=0.)
            b_dab = tl.load(dAab + p_A, mask=m_t[:, None], other=0.)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            b_g = load_rows(gc, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_gp = load_gp(gc, gk, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            _, b_ref = span_ref(b_gp, b_g, m_tk)
            b_q = load_rows(q, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_k = load_rows(k, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_a = load_rows(a, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_b = load_rows(b, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_z = tl.zeros([BT, BK], dtype=tl.float32)
            b_dq, b_dk, b_da, b_db = factored_bwd(b_q, b_k, b_a, b_b, b_g, b_gp, b_ref, b_z, b_z, b_z, b_z, b_dqk,
                                                   b_dqb, b_dak, b_dab, m_tk, scale, DOT_PRECISION)
            bwd_finish(b_q, b_k, b_a, b_b, b_dq, b_dk, b_da, b_db, k, a, b, pairs, bos, o_t, m_t, i_c * BT,
                        tl.minimum(T, i_c * BT + BT), i_h, o_k, m_k, scale, H, K, dq_c, dk_c, da_c, db_c, dq, dk,
                        da, db, dq_c, da_c, dk_c)
    else:
        if PHASE == 0:
            # the chunk's slot, addressed as its rows of a [T, H, BT] buffer: every dA index below is unchanged
            rebase = (tl.load(slots + i_t).to(tl.int64) * BT - bos - i_c * BT) * H * BT
            dAqk, dAqb, dAak, dAab = dAqk + rebase, dAqb + rebase, dAak + rebase, dAab + rebase
            tl.debug_barrier()
            tl.store(dAqk + p_A, b_dqk, mask=m_t[:, None])
            tl.store(dAqb + p_A, b_dqb, mask=m_t[:, None])
            tl.store(dAak + p_A, b_dak, mask=m_t[:, None])
            tl.store(dAab + p_A, b_dab, mask=m_t[:, None])
        tl.debug_barrier()
        for i_k in range(0, tl.cdiv(K, BK)):
            for i_i in range(0, BT // BC):
                if i_c * BT + i_i * BC < T:
                    bwd_sub(q, k, a, b, gc, gk, dAqk, dAqb, dAak, dAab, pairs, dq_c, dk_c, da_c, db_c, dq, dk, da,
                             db, dq_c, da_c, dk_c, scale, i_k, i_c, i_i, bos, T, i_h, H, K, BT, BC, BK, DOT_PRECISION,
                             DIAG_PRECISION, SPAN)


@triton.jit
def dplr_gate_bwd_kernel(gc, h, dh, dgk, dga, dgs, dg, cu_seqlens, chunk_indices, t0, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         SLOTTED: tl.constexpr):
    """Program (p, head), chunk t0 + p: dg_u = sum_{t >= u} dgk_t + sum_{t > u} dga_t
    + sum_{t < u} dgs_t + exp(G_C) rowsum(h dh'), every sum inside the chunk; the terms as
    ``dplr_bwd_kernel``'s program p left them (SLOTTED: its scratch rows)."""
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_t = t0 + i_p
    i_c, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    if SLOTTED:
        rebase = (i_p * BT - bos - i_c * BT) * H * K
        dgk, dga, dgs = dgk + rebase, dga + rebase, dgs + rebase
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    hi = tl.minimum(T, i_c * BT + BT)
    m_prev, m_next = m_t & (o_t > i_c * BT), o_t + 1 < hi
    o_h = (i_t * H + i_h) * K * V
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_e = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            p_h = o_h + o_k[:, None] * V + o_v[None, :]
            m_h = m_k[:, None] & (o_v < V)[None, :]
            b_h = tl.load(h + p_h, mask=m_h, other=0.).to(tl.float32)
            b_e += tl.sum(b_h * tl.load(dh + p_h, mask=m_h, other=0.).to(tl.float32), 1)
        b_e *= exp(tl.load(gc + ((bos + hi - 1) * H + i_h) * K + o_k, mask=m_k, other=0.))
        b_x = load_rows(dgk, bos, o_t, m_t, i_h, o_k, m_k, H, K) + load_rows(dga, bos, o_t + 1, m_next, i_h, o_k, m_k,
                                                                               H, K)
        b_p = load_rows(dgs, bos, o_t - 1, m_prev, i_h, o_k, m_k, H, K)
        b_dg = tl.cumsum(b_x, axis=0, reverse=True) + tl.cumsum(b_p, axis=0) + b_e[None, :]
        tl.debug_barrier()  # dg is gc's buffer: every thread's loads first
        tl.store(dg + ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :], b_dg.to(dg.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])


SCRATCH_BYTES = 2 ** 29


def chunks_per_launch(NC: int, H: int, K: int, BT: int, split: bool = False) -> int:
    """P, the chunks of one launch of the backward: all of them while the scratch (4 x NC x BT x H x
    K fp32, and with ``split`` the dA slots, 4 x NC x BT x H x BT fp32) fits ``SCRATCH_BYTES``, else
    as many as fit. Measured on the H100 (RWKV-7 bf16
    fwd+bwd): launches in turn cost ~4% at (8, 16384, 64, 64) against one launch of all (the
    scratch rows addressed by program); 16 launches of 512 MiB take the same time as 4 of 2 GiB
    (119.9 against 120.1 ms) for 1.5 GiB less."""
    return max(1, min(NC, SCRATCH_BYTES // (16 * BT * H * (K + (BT if split else 0)))))


def dplr_bwd(q, k, v, a, b, gc, gk, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, wide, scale: float, chunks: Chunks,
             *, span: float = SAFE_SPAN, blocks: tuple[int, int] | None = None,
             config: tuple[int, int] | None = None, programs: int | None = None, split: bool | None = None,
             early: bool = True):
    """dq, dk, dv, da, db (inputs' dtypes) and dg, the gradient of the log gates, in fp32 written over
    gc (the caller's to give: nothing reads it after; a 16-bit gate's copy is the caller's to make,
    after the scratch is freed). ``ut``: the forward's
    U~, or None (recomputed per chunk, ``dplr_wy.local_grads``).
    ``wide``: the forward's [NC, H] flags (``dplr_intra.dplr_intra_fwd``), which, fused, size the dA buffers:
    one [BT, H, BT] slot per chunk with a wide head (RWKV-7's gates, >= -e^-0.5 a token, leave none; the
    count costs one device sync; split, every chunk of a launch has a slot). ``span``: as in
    ``dplr_intra.dplr_intra_fwd``; ``blocks`` (BK, BV)
    and ``config`` (num_warps, num_stages) of every dplr_bwd_kernel launch (split: both) instead of
    ``launch_config``'s;
    ``programs``: the chunks of a launch instead of ``chunks_per_launch``'s (0: all in one launch; the
    scratch is 4 x programs x BT x H x K fp32). ``split``: the main kernel in two launches, the local
    part and then the intra part, the dA's through 4 x programs x BT x H x BT fp32 buffers (None:
    ``default_split(K)``); ``early``: split, the first launch forms dA_qk and dA_qb before the rest
    and stores them (``dplr_wy.local_grads``' EARLY)."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    if split is None:
        split = default_split(K)
    elif not isinstance(split, bool):
        raise ValueError(f"split must be None, True or False, got {split!r}")
    if programs is None:
        programs = chunks_per_launch(chunks.NC, H, K, chunks.BT, split)
    P = max(1, chunks.NC if programs == 0 else min(programs, chunks.NC))  # NC = 0: every sequence empty
    slotted = P < chunks.NC
    dq, dk, dv, da, db = (torch.empty_like(x) for x in (q, k, v, a, b))
    f32 = dict(dtype=torch.float32, device=q.device)
    # fused, the dA's are written only by chunks that take the sub-chunk path; the scratch by every
    # program, and the next launch (same stream: after this one ends) writes it again
    if split:  # every chunk's dA's, in its launch slot
        slots, n_slots = wide, P
    else:
        wide_chunk = wide.amax(1) > 0
        slots = (torch.cumsum(wide_chunk, 0, dtype=torch.int32) - 1)
        n_slots = max(int(wide_chunk.sum()), 1)
    dAs = [torch.empty(n_slots * chunks.BT, H, chunks.BT, **f32) for _ in range(4)]
    pairs = torch.empty(1, T, H, 4, **f32)
    scratch = [torch.empty(P * chunks.BT if slotted else T, H, K, **f32) for _ in range(4)]
    # dg goes over gc: a chunk's gate sums are read only by its own programs (the state pass before,
    # the main kernel of its launch, then its gate program, which reads its rows and then writes
    # them); gc is this backward's own (``ChunkDplrFunction.backward`` forms it)
    dg = gc
    GK, GV = min(64, max(16, triton.next_power_of_2(K))), min(64, max(16, triton.next_power_of_2(V)))
    for t0 in range(0, chunks.NC, P):
        n = min(P, chunks.NC - t0)
        for phase in (1, 2) if split else (0,):
            default_blocks, default_config = launch_config(K, phase)
            BK, BV = blocks or default_blocks
            BK, BV = min(BK, max(16, triton.next_power_of_2(K))), min(BV, max(16, triton.next_power_of_2(V)))
            warps, stages = config or default_config
            # fp16's split second launch multiplies its fp32 operands truncated (plain TF32): rounding
            # them first (``dot_at("tf32rn")``) takes its stack 128 -> 1192 B at K = 64 (sm_90)
            precision = "tf32" if phase == 2 and q.dtype == torch.float16 else dot_precision(q.dtype)
            dplr_bwd_kernel[(n, H)](
                q, k, v, a, b, gc, gk, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, wide, slots, *dAs, pairs, *scratch, dq,
                dk, dv, da, db, chunks.cu_seqlens, chunks.chunk_indices, scale, t0, H=H, K=K, V=V, BT=chunks.BT,
                BC=16, BK=BK, BV=BV, DOT_PRECISION=precision, DIAG_PRECISION=diag_precision(q.dtype),
                SPAN=span, SLOTTED=slotted, UT_KEPT=ut is not None, PHASE=phase, EARLY=early and phase == 1,
                num_warps=warps, num_stages=stages)
        # the gate terms (over three of the scratch buffers) summed before the next launch writes them
        dplr_gate_bwd_kernel[(n, H)](gc, h, dh, scratch[0], scratch[2], scratch[1], dg, chunks.cu_seqlens,
                                     chunks.chunk_indices, t0, H=H, K=K, V=V, BT=chunks.BT, BK=GK, BV=GV,
                                     SLOTTED=slotted, num_warps=4)
    return dq, dk, dv, da, db, dg
