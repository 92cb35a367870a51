"""The per-chunk backward of the generic DPLR chunk algorithm: one program per (chunk, head).

Given the state pass's results (h, dh, U, dU from ``dplr_state.py``), a program

    1. forms dV and the four intra-chunk matrices' gradients dA_qk, dA_qb, dA_ak, dA_ab (in
       registers) and the parts of dq, dk, da, db that pass through the states (fp32 scratch):
       ``dplr_wy.local_grads``;
    2. takes the dA's to q, k, a, b (``dplr_intra.py``): a chunk whose gates span less than
       ``decay_intra.SAFE_SPAN`` (every RWKV-7 chunk: 64 x 0.607 = 38.8) factors every decay
       through the per-channel midpoint of its gates, eight [BT, BT] x [BT, BK] dots per K block,
       with the dA's never leaving the chip; a wider one stores them and goes sub-chunk by
       sub-chunk (reference rows between sub-chunks, the diagonal ones factored or token at a time);
    3. stores dq, dk, da, db and the per-token gate terms dgk = q dq - k dk - b db + a da, dga = a da,
       whose reverse cumulative sum is the gate gradient (``dplr.py``).

The scratch written in 1 is read back in 2 by other threads of the same program, after a barrier.
Shapes as in ``dplr.py``: q, k, a, b, gc, gp [1, T, H, K]; v, U, dU, dO [1, T, H, V]; A's [1, T, H, BT];
h, dh [NC, H, K, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastweight.kernels import decay_intra
from fastweight.kernels.common import Chunks, chunk_bounds
from fastweight.kernels.decay_intra import diag_precision, span_ref
from fastweight.kernels.decay_state import dot_precision
from fastweight.kernels.dplr_intra import _bwd_finish, _bwd_sub, _chunk_span, _factored_bwd, _load_rows
from fastweight.kernels.dplr_wy import local_grads

# (BK, BV) and (num_warps, num_stages) instead of launch_config's (benchmarks set them)
BLOCKS: tuple[int, int] | None = None
CONFIG: tuple[int, int] | None = None


def launch_config(K: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((BK, BV), (num_warps, num_stages)) from the H200 runs of session 4 (RWKV-7 bf16 fwd+bwd,
    scripts/gpu_dplr_variants.py bwd, docs/bench/decay_dplr.md): at K = V = 64, (8, 16384, 64, 64),
    blocks 32 x 64 with 4 warps 86.6 ms (32 x 32 8 warps 99.2, 64 x 64 8 warps 104.9); at K = V = 128,
    (4, 8192, 16, 128), 64 x 64 with 8 warps 12.8 ms (32 x 32 14.2, 32 x 64 13.3, 64 x 64 4 warps 18.0)."""
    return ((32, 64), (4, 1)) if K <= 64 else ((64, 64), (8, 1))


@triton.jit
def dplr_bwd_kernel(q, k, v, a, b, gc, gp, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, dAqk, dAqb, dAak, dAab, dq_s, dk_s,
                    da_s, db_s, dq, dk, dv, da, db, dgk, dga, cu_seqlens, chunk_indices, scale, H: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, DOT_PRECISION: tl.constexpr, DIAG_PRECISION: tl.constexpr,
                    SPAN: tl.constexpr):
    """DOT_PRECISION serves the local part and the whole-chunk path (its [BT, BT] fp32 operands:
    3 x TF32 there would need more shared memory than the H200 has), DIAG_PRECISION the diagonal
    sub-chunks of the sub-chunk path."""
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_c, bos, T = chunk_bounds(i_t, cu_seqlens, chunk_indices)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_dqk, b_dqb, b_dak, b_dab = local_grads(q, k, v, gc, gp, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, dv, dq_s, dk_s,
                                             da_s, db_s, i_t, i_c, bos, T, i_h, scale, H, K, V, BT, BK, BV,
                                             DOT_PRECISION)
    tl.debug_barrier()
    if _chunk_span(gc, gp, bos, o_t, m_t, i_h, H, K, BK) < SPAN:
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            b_g = _load_rows(gc, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_gp = _load_rows(gp, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            _, b_ref = span_ref(b_gp, b_g, m_tk)
            b_q = _load_rows(q, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_k = _load_rows(k, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_a = _load_rows(a, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_b = _load_rows(b, bos, o_t, m_t, i_h, o_k, m_k, H, K)
            b_z = tl.zeros([BT, BK], dtype=tl.float32)
            b_dq, b_dk, b_da, b_db = _factored_bwd(b_q, b_k, b_a, b_b, b_g, b_gp, b_ref, b_z, b_z, b_z, b_z, b_dqk,
                                                   b_dqb, b_dak, b_dab, m_tk, scale, DOT_PRECISION)
            p_t = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
            _bwd_finish(b_q, b_k, b_a, b_b, b_dq, b_dk, b_da, b_db, p_t, m_tk, scale, dq_s, dk_s, da_s, db_s, dq, dk,
                        da, db, dgk, dga)
    else:
        p_A = ((bos + o_t) * H + i_h)[:, None] * BT + tl.arange(0, BT)[None, :]
        tl.store(dAqk + p_A, b_dqk, mask=m_t[:, None])
        tl.store(dAqb + p_A, b_dqb, mask=m_t[:, None])
        tl.store(dAak + p_A, b_dak, mask=m_t[:, None])
        tl.store(dAab + p_A, b_dab, mask=m_t[:, None])
        tl.debug_barrier()
        for i_k in range(0, tl.cdiv(K, BK)):
            for i_i in range(0, BT // BC):
                if i_c * BT + i_i * BC < T:
                    _bwd_sub(q, k, a, b, gc, gp, dAqk, dAqb, dAak, dAab, dq_s, dk_s, da_s, db_s, dq, dk, da, db, dgk,
                             dga, scale, i_k, i_c, i_i, bos, T, i_h, H, K, BT, BC, BK, DOT_PRECISION, DIAG_PRECISION,
                             SPAN)


def dplr_bwd(q, k, v, a, b, gc, gp, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, scale: float, chunks: Chunks):
    """dq, dk, dv, da, db (inputs' dtypes) and the per-token gate terms dgk, dga [1, T, H, K] fp32."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    blocks, config = launch_config(K)
    BK, BV = BLOCKS or blocks
    BK, BV = min(BK, max(16, triton.next_power_of_2(K))), min(BV, max(16, triton.next_power_of_2(V)))
    warps, stages = CONFIG or config
    dq, dk, dv, da, db = (torch.empty_like(x) for x in (q, k, v, a, b))
    f32 = dict(dtype=torch.float32, device=q.device)
    # the dA's are written only by chunks that take the sub-chunk path; the scratch by every chunk
    dAs = [torch.empty(1, T, H, chunks.BT, **f32) for _ in range(4)]
    scratch = [torch.empty(1, T, H, K, **f32) for _ in range(4)]
    dgk, dga = torch.empty(1, T, H, K, **f32), torch.empty(1, T, H, K, **f32)
    dplr_bwd_kernel[(chunks.NC, H)](
        q, k, v, a, b, gc, gp, Ai, Aqk, Aak, w, u, ut, h, dh, du, do, *dAs, *scratch, dq, dk, dv, da, db, dgk, dga,
        chunks.cu_seqlens, chunks.chunk_indices, scale, H=H, K=K, V=V, BT=chunks.BT, BC=16, BK=BK, BV=BV,
        DOT_PRECISION=dot_precision(q.dtype), DIAG_PRECISION=diag_precision(q.dtype), SPAN=decay_intra.SAFE_SPAN,
        num_warps=warps, num_stages=stages)
    return dq, dk, dv, da, db, dgk, dga
