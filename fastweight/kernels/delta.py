"""The delta family's chunked ops on Triton: launchers and autograd.

One generic path serves them all (DESIGN.md section 2):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

with alpha_t = exp(g_t) (``g`` None: DeltaNet). KDA's per-channel gate (``g`` [B, T, H, K])
decays first: S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T. Comba reads
the undecayed state with its own key p: S_t = alpha_t S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T.
Longhorn is DeltaNet with beta replaced by eps = beta / (1 + beta k^T k).

Stages (one file each): chunk-local cumsum of g, the solve ``Ai = (I + A)^{-1}`` (kkt_solve;
with a per-channel gate A and the intra-chunk scores come from intra, which for bf16 at K <= 64 forms
Ai too, ``INTRA_SOLVE_DTYPES``), W and U (formed by the
solve's kernel from the inverse's blocks for a scalar or no gate, ``SOLVE_WU``; by wy otherwise),
the state pass fused with the output (state). The backward recomputes nothing per token: the forward
keeps the chunk-start states ``h`` and v_tilde; the dh pass (state), the per-chunk output
backward (output) and the WY backward (wy) give every gradient. Derivations: docs/kernels.md.
"""

from __future__ import annotations

import torch

from fastweight.kernels.common import prepare_chunks
from fastweight.kernels.cumsum import chunk_cumsum
from fastweight.kernels.intra import intra_bwd, intra_fwd
from fastweight.kernels.kkt_solve import BT_DELTA, kkt_solve, solve
from fastweight.kernels.l2norm import l2norm
from fastweight.kernels.output import output_bwd
from fastweight.kernels.state import state_bwd, state_fwd
from fastweight.kernels.wy import recompute_w_u, wy_bwd


MAX_K = 256
# W and U formed in the solve's kernel (``kkt_solve(v=...)``) instead of by ``recompute_w_u`` for a scalar
# or no gate and no p (H100, fwd+bwd: GDN (4, 8192, 16, 128) -1.4%, DeltaNet (8, 16384, 64, 64) -6.4%).
# SOLVE_WU_KDA: with a per-channel gate, W, U and the gated rows from ``solve(wu=...)``; off: its one-warp
# program gates three [64, K] tiles that ``recompute_w_u`` spreads over 8 warps (KDA forward +5%)
SOLVE_WU = True
SOLVE_WU_KDA = False
# the dtypes it is on for: timed in bf16; fp16's 3 x TF32 merge spills 24-160 B a thread in it and fp32's
# exact dots kilobytes (sm_90), untimed, so they keep recompute_w_u
SOLVE_WU_DTYPES = (torch.bfloat16,)
# the per-channel gate's chunk sums formed in the intra kernel (``intra_fwd(g=...)``) instead of by a
# ``chunk_cumsum`` pass before it (KDA without the gate's activation in the kernel), for these dtypes (H100,
# KDA (4, 8192, 16, 128) fwd 1.816 -> 1.768 ms, fwd+bwd 7.27 -> 7.23; fp16 and fp32 untimed)
INTRA_GATE_SUMS_DTYPES = (torch.bfloat16,)
# the output backward's part of dk, which the WY backward reads and completes (in fp32, stored once), kept in
# the inputs' dtype instead of fp32 for these dtypes, where dk itself is stored so (no grouped heads, no
# per-channel gate, no p): its [T, H, K] round trip in 16 bits (GDN (4, 8192, 16, 128) bf16: 268 MB less of the
# 1.7 + 1.1 GB the two stages move). dk is then rounded twice, once fewer than fla 0.6.0's (both parts rounded to
# bf16 and added in bf16); measurements: docs/bench/delta.md
PARTIAL_DK_DTYPES = (torch.bfloat16,)
# scalar or no gate: dbeta stored by the WY backward in beta's dtype, and a scalar gate's reverse cumsum of dg
# taken in its program (``wy_bwd(dg_dtype=...)``): a ``chunk_cumsum`` launch and a cast less
WY_GATE_GRAD = True
# the per-channel gate's solve Ai = (I + Diag(beta) Akk)^{-1} formed in the intra kernel from Akk's blocks in
# registers (``intra_fwd(beta=...)``) instead of by ``solve`` reading Akk back; Akk is stored for a backward only.
# On for these dtypes at key dims up to INTRA_SOLVE_MAX_K (H100, bf16, KDA forward: (8, 16384, 64, 64) 16.28 ->
# 15.42 ms, (8, 2048, 16, 64) 0.556 -> 0.524; at K 128 the fused kernel runs out of registers, 1.77 -> 2.31 ms;
# fp16 and fp32 untimed; docs/bench/delta.md)
INTRA_SOLVE_DTYPES = (torch.bfloat16,)
INTRA_SOLVE_MAX_K = 64


def _pack(x):
    """[B, T, H, ...] -> [1, B*T, H, ...] contiguous."""
    return None if x is None else x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _exclusive(g_cum, chunks):
    """The chunk-local sum one token earlier, g_cum[t - 1] (0 at a chunk's first token), as a shift of
    g_cum itself: g_cum - g rounds again, and the read key's factor exp(g_read_i - g_cum_j) at j = i - 1,
    exactly 1, would be exp(+-ulp |g_cum|) (3e-5 relative at |g_cum| ~ 500: Comba at g = -6 per token)."""
    T = g_cum.shape[1]
    pos = torch.arange(T, device=g_cum.device)
    cu = chunks.cu_seqlens
    start = (pos - cu[torch.searchsorted(cu[1:], pos, right=True)]) % chunks.BT == 0
    return torch.where(start.view(1, T, *([1] * (g_cum.dim() - 2))), 0., g_cum.roll(1, dims=1))


def delta_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, chunks, store_h, p=None, gate=(None, None),
              fuse_wy=None):
    """g: None, [1, T, H] (scalar gate) or [1, T, H, K] (per-channel gate, KDA); p: Comba's read key;
    gate: (A_log, dt_bias) when g is the pre-activation of Mamba-2's gate, computed in the cumsum;
    fuse_wy: the read R = U - W S formed in the state pass from Ai and the raw rows
    (``state.state_fwd(Ai=...)``), W and U never written, where it applies (no p, no per-channel
    gate); default: for inference only (``store_h`` False). On the H200 (GDN (4, 8192, 16, 128),
    bf16) it saves W/U's 0.18 ms and costs the state pass 0.11; keeping h it costs 0.20 there and a
    backward must recompute W (docs/bench/delta.md)."""
    g_cum = gk_cum = Aqk = Akk = g_read = w = u = Ai = None
    A_log, dt_bias = gate
    # the per-channel gate's solve in the intra kernel (SOLVE_WU_KDA, the solve's own W and U, keeps its kernel)
    fused_solve = (dict(beta=beta, store_akk=store_h) if k.dtype in INTRA_SOLVE_DTYPES
                   and k.shape[-1] <= INTRA_SOLVE_MAX_K and not SOLVE_WU_KDA else {})
    if g is not None and g.dim() == 4 and A_log is None and q.dtype in INTRA_GATE_SUMS_DTYPES:
        Aqk, Akk, gk_cum, *Ai = intra_fwd(q, k, None, chunks, g=g, **fused_solve)
    elif g is not None and g.dim() == 4:
        gk_cum = chunk_cumsum(g, chunks, A_log=A_log, dt_bias=dt_bias)
        Aqk, Akk, *Ai = intra_fwd(q, k, gk_cum, chunks, **fused_solve)
    else:
        g_cum = chunk_cumsum(g, chunks, A_log=A_log, dt_bias=dt_bias) if g is not None else None
        if p is not None:
            # Comba reads the undecayed state: its read key sees the exclusive cumsum
            g_read = _exclusive(g_cum, chunks) if g is not None else None
    if fuse_wy is None:
        fuse_wy = not store_h
    fuse_wy = fuse_wy and p is None and gk_cum is None
    # inference folds beta into Ai (the state pass then reads no beta); a backward needs Ai itself
    fold = fuse_wy and not store_h
    # W and U (and the per-channel gate's rows) formed in the solve's program from the inverse's blocks
    wu = ((SOLVE_WU_KDA if gk_cum is not None else SOLVE_WU) and p is None and not fuse_wy
          and k.dtype in SOLVE_WU_DTYPES)
    qs, ks = q, k
    if Ai:  # solved in the intra kernel
        Ai = Ai[0]
    elif gk_cum is not None and wu:
        Ai, w, u, qs, ks = solve(Akk, beta, chunks, dtype=k.dtype, precision_of=k.dtype, wu=(k, v, gk_cum, q))
    elif gk_cum is not None:
        Ai = solve(Akk, beta, chunks, dtype=k.dtype, precision_of=k.dtype)
    elif wu:
        Ai, w, u = kkt_solve(k, beta, g_cum, chunks, v=v)
    else:
        # inference also takes the output's scores from the solve's kernel, off the state pass's serial path
        solved = kkt_solve(k, beta, g_cum, chunks, p=p, g_read=g_read, fold_beta=fold, q=q if fold else None)
        Ai, Aqk = solved if fold else (solved, None)
    if fuse_wy:
        h, v_new, o, ht = state_fwd("delta", k, v, chunks, g=g_cum, q=q, A=Aqk, Ai=Ai, beta=None if fold else beta,
                                    scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                                    store_h=store_h, store_r=store_h, fuse_output=True)
        return o, ht, (g_cum, gk_cum, g_read, Ai, Aqk, Akk, None, h, v_new)
    if w is not None:  # formed by the solve above
        pass
    elif p is not None:
        w, u = recompute_w_u(p, v, beta, g_read, Ai, chunks)
    elif gk_cum is not None:
        # the per-channel gate's rows gated here, in parallel, not on the state pass's serial path
        w, u, qs, ks = recompute_w_u(k, v, beta, None, Ai, chunks, gk_cum=gk_cum, q=q)
    else:
        w, u = recompute_w_u(k, v, beta, g_cum, Ai, chunks)
    h, v_new, o, ht = state_fwd("delta", ks, u, chunks, g=g_cum if gk_cum is None else gk_cum, w=w, u=u, q=qs,
                                A=Aqk, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                                store_h=store_h, store_r=store_h, fuse_output=True, prescaled=gk_cum is not None)
    return o, ht, (g_cum, gk_cum, g_read, Ai, Aqk, Akk, w, h, v_new)


def delta_bwd(q, k, v, beta, saved, do, dht, scale, chunks, need_dh0, p=None, dg_dtype=torch.float32):
    """Every gradient of ``delta_fwd``'s inputs; dg, the log gate's, in ``dg_dtype`` (the reverse cumsum stores
    it so: the caller's gate dtype, or fp32 where Mamba-2's gate backward follows)."""
    g_cum, gk_cum, g_read, Ai, Aqk, Akk, w, h, v_new = saved
    if w is None:
        w, _ = recompute_w_u(k, v, beta, g_cum, Ai, chunks, need_u=False)
    dh, dv_tilde, dh0 = state_bwd("delta", q, do, chunks, g=g_cum if gk_cum is None else gk_cum, k=k, w=w, A=Aqk,
                                  scale=scale, dht=dht, need_dh0=need_dh0)
    # gradients still to be accumulated (grouped heads, the per-channel intra part) stay fp32
    final = q.dtype if gk_cum is None and p is None and q.shape[2] == v.shape[2] else torch.float32
    partial = final if final in PARTIAL_DK_DTYPES else torch.float32
    dq, dk, dw, dg_cum, dAqk = output_bwd(q, k, g_cum, h, dh, v_new, do, dv_tilde, scale, chunks, gk_cum=gk_cum,
                                          dq_dtype=final, dk_dtype=partial)
    sum_dg_in_wy = WY_GATE_GRAD and gk_cum is None
    dk, dv, dbeta, dAkk, dp, dg_cum = wy_bwd(k, v, beta, g_cum, Ai, dw, dv_tilde, dk, dg_cum, chunks, gk_cum=gk_cum,
                                             Akk=Akk, dk_dtype=final, p=p, g_read=g_read,
                                             dg_dtype=dg_dtype if sum_dg_in_wy else None,
                                             dbeta_dtype=beta.dtype if sum_dg_in_wy else torch.float32)
    if gk_cum is not None:
        # the last stage to add to dq, dk rounds them to q's dtype itself where no head sum follows (no cast after)
        out16 = q.dtype if q.dtype != torch.float32 and q.shape[2] == v.shape[2] else None
        rounded = intra_bwd(q, k, gk_cum, dAqk, dAkk, dq, dk, dg_cum, chunks, out_dtype=out16)
        if rounded is not None:
            dq, dk = rounded
    # dg_cum: already reverse-summed by wy_bwd (WY_GATE_GRAD), or None without a gate
    if sum_dg_in_wy or dg_cum is None:
        dg = dg_cum
    else:
        dg = chunk_cumsum(dg_cum, chunks, reverse=True, out_dtype=dg_dtype)
    return dq, dk, dv, dg, dbeta, dh0, dp


def _gate_backward(dg, x, A_log, dt_bias):
    """The VJP of g = -exp(A_log) softplus(x + dt_bias) (x: [B, T, H] or [B, T, H, K]); dg in fp32."""
    H = A_log.shape[0]
    bias = dt_bias.float().view(H, -1) if x.dim() == 4 else dt_bias.float()
    a = A_log.float().exp().view(H, 1) if x.dim() == 4 else A_log.float().exp()
    z = x.float() + bias
    dz = dg.float() * -a * torch.sigmoid(z)
    dA = (dg.float() * -a * torch.nn.functional.softplus(z)).sum(dim=(0, 1))
    dA = dA.sum(-1) if x.dim() == 4 else dA
    return dz.to(x.dtype), dA.to(A_log.dtype), dz.sum(dim=(0, 1)).reshape(dt_bias.shape).to(dt_bias.dtype)


class ChunkDeltaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, p, A_log, dt_bias,
                store_h):
        B, T = q.shape[:2]
        chunks = prepare_chunks(cu_seqlens, B, T, BT_DELTA, q.device)
        shapes = (q.shape, v.shape)
        qshape_k = q.shape[-1]
        q, k, v, g, beta, p = (_pack(x) for x in (q, k, v, g, beta, p))
        if initial_state is not None:
            initial_state = initial_state.contiguous()
        o, ht, saved = delta_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, chunks,
                                 store_h=store_h, p=p, gate=(A_log, dt_bias))
        ctx.save_for_backward(q, k, v, beta, p, g if A_log is not None else None, A_log, dt_bias, *saved)
        ctx.chunks, ctx.scale, ctx.shapes = chunks, scale, shapes
        ctx.has_h0 = initial_state is not None
        ctx.g_dtype = g.dtype if g is not None else None
        ctx.g_shape = shapes[1][:3] + ((qshape_k,) if g is not None and g.dim() == 4 else ())
        ctx.h0_dtype = initial_state.dtype if initial_state is not None else None
        return o.reshape(shapes[1]), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, p, g_raw, A_log, dt_bias, *saved = ctx.saved_tensors
        (qshape, vshape), chunks = ctx.shapes, ctx.chunks
        # autograd hands the cotangents in any strides (a loss through S.sum() gives a stride-0 dht,
        # one through S.mT a transposed one); the kernels index them as contiguous [1, T, H, V] and
        # [N, H, K, V] (a copy only when they are not)
        do, dht = _pack(do), (dht.contiguous() if dht is not None else None)
        # the gate's gradient stored in its own dtype by the reverse cumsum (no cast after), but in fp32 where
        # Mamba-2's gate backward reads it
        dg_dtype = torch.float32 if A_log is not None or ctx.g_dtype is None else ctx.g_dtype
        dq, dk, dv, dg, dbeta, dh0, dp = delta_bwd(q, k, v, beta, saved, do, dht, ctx.scale, chunks,
                                                   ctx.has_h0 and ctx.needs_input_grad[6], p=p, dg_dtype=dg_dtype)
        gshape = vshape[:3]
        if vshape[2] != qshape[2]:
            # grouped value heads: the key-side gradients summed over each group
            HK, G = qshape[2], vshape[2] // qshape[2]
            dq, dk = (x.view(*x.shape[:2], HK, G, x.shape[-1]).sum(3) for x in (dq, dk))
            if dp is not None:
                dp = dp.view(*dp.shape[:2], HK, G, dp.shape[-1]).sum(3)
        dp = dp.to(p.dtype).reshape(qshape) if dp is not None else None
        dq = dq.to(q.dtype).reshape(qshape)
        dk = dk.to(k.dtype).reshape(qshape)
        dv = dv.to(v.dtype).reshape(vshape)
        dA_log = d_dt_bias = None
        if A_log is not None:
            dg, dA_log, d_dt_bias = _gate_backward(dg.view(ctx.g_shape), g_raw.view(ctx.g_shape), A_log, dt_bias)
        dg = dg.to(ctx.g_dtype).reshape(ctx.g_shape) if dg is not None else None
        dbeta = dbeta.to(beta.dtype).reshape(gshape)
        dh0 = dh0.to(ctx.h0_dtype) if dh0 is not None else None
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, dp, dA_log, d_dt_bias, None


def chunk_delta(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
                use_qk_l2norm_in_kernel=False, p=None, A_log=None, dt_bias=None):
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T (g None: no decay), chunked.

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); g, beta: [B, T, HV];
    initial_state [N, HV, K, V]. Returns (o [B, T, HV, V], final state [N, HV, K, V] fp32 or None).
    """
    if k.shape[-1] > MAX_K:
        raise ValueError(f"`k` must have a head dim K <= {MAX_K} for the chunked delta kernels (the state pass "
                         f"holds all of K in one program), got K = {k.shape[-1]}")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
        p = l2norm(p) if p is not None else None
    # the chunk-start states are kept only when a backward can follow
    tensors = (q, k, v, g, beta, initial_state, p, A_log, dt_bias)
    store_h = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    o, ht = ChunkDeltaFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, p,
                                     A_log, dt_bias, store_h)
    return o, (ht if output_final_state else None)


def gate_params(use_gate_in_kernel, A_log, dt_bias):
    """``chunk_delta``'s A_log, dt_bias for the in-kernel gate (None, None without it)."""
    if not use_gate_in_kernel:
        return dict(A_log=None, dt_bias=None)
    if A_log is None or dt_bias is None:
        raise ValueError("`use_gate_in_kernel=True` needs `A_log` and `dt_bias`")
    return dict(A_log=A_log.contiguous(), dt_bias=dt_bias.contiguous())
