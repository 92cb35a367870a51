"""Generic DPLR, chunkwise, in PyTorch: RWKV-7 and fla's ``chunk_dplr_delta_rule``.

    S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T        o_t = S_t^T (scale q_t)

Core names (DESIGN.md): ``a`` is the low-rank write direction, ``b`` is read against
the *undecayed* state. fla's ``chunk_dplr_delta_rule(q, k, v, a, b, gk)`` and
``chunk_rwkv7(r, w, k, v, a, b)`` name them the other way round; their mechanism files
(``mechanisms/dplr.py``, ``rwkv7.py``) keep fla's meaning and swap.

Inside a chunk of C tokens starting from the state S (G = cumulative log decay from the
chunk start, G^- the same one step earlier; derivation in docs/dplr_chunk.md):

    1. intra-chunk matrices, decays folded in as exp(G_t - G_s) <= 1 (G^- for rows read at t - 1):
       A_ba = strictLower(b a^T), A_bk = strictLower(b k^T)    rows read at t - 1
       A_qa = lower(q a^T),       A_qk = lower(q k^T)          rows read at t
    2. WY form of the low-rank reads u_t = b_t^T S_{t-1} (the UT transform):
       u = W S + U~,   W = (I - A_ba)^{-1} (b * exp(G^-)),   U~ = (I - A_ba)^{-1} A_bk V
    3. output:  O = (q * exp(G) + A_qa W) S + A_qa U~ + A_qk V
    4. state:   S <- Diag(exp G_C) S + (a * exp(G_C - G))^T u + (k * exp(G_C - G))^T V

Steps 1-3 (all but the ``S`` products) run for every chunk at once; step 4 is the only
sequential loop, over chunks. Per-token states are never formed.

Numerical safety without clamping gates: no exponential can overflow. Pairs (t, s) in
different 16-token sub-chunks go through the sub-chunks' start/end references, three factors
each <= 1; pairs inside one sub-chunk do the same while its decay span is small, else take
the pairwise difference ([16, 16, K] per sub-chunk; :func:`precise_decayed_scores`). The
cumulative log gates and their differences are float64: over a chunk G reaches -1e3 with
strong gates, and an fp32 prefix sum carries an absolute error of ulp(|G|) ~ 6e-5 into
every factor (100x the fp32 recurrence's error, mostly in d gk).
"""

from __future__ import annotations

from math import inf

import torch
import torch.nn.functional as F

from fastweight.checks import check_chunk_size
from fastweight.chunk.common import SUB_CHUNK, chunk_layout, compute_dtype, finish, initial, to_chunks
from fastweight.chunk.solve_tril import solve_unit_lower

# largest decay span (-log of the decay) across one 16-token sub-chunk that is factored through
# its start. Overflow would allow ~80; precision does not: the backward pass cancels factors
# exp(+-span), and fp32 errors grew from 1.2e-7 (pairwise) to 2.8e-7 at span 20, 6.9e-7 at 40.
# RWKV-7's decay (>= -0.607 per step, span <= 9.7) is always factored.
MAX_FACTORED_SPAN = 20.0


def precise_decayed_scores(x: torch.Tensor, ys: tuple, Gx: torch.Tensor, Gy: torch.Tensor,
                           strict: bool = False) -> list:
    """M_ts = sum_c x_t[c] y_s[c] exp(Gx_t[c] - Gy_s[c]) for s <= t (s < t if ``strict``), else 0,
    for each y in ``ys`` (the decay factors are formed once and shared).

    ``chunk.common.decayed_scores`` with the log-gate differences taken in float64: x, y
    [..., C, K] in the compute dtype; Gx, Gy [..., C, K] or [..., C, 1] (scalar gates), float64.
    Gy is the inclusive cumulative log decay from the chunk start, Gx is Gy at t or t - 1 (0
    before the chunk). Returns a list of [..., C, C] in x's dtype.

    Every sub-chunk i has the start reference r_i = Gy at the end of sub-chunk i - 1 (0 for
    i = 0) and the end reference e_i = Gy at its last token. A pair (t in i, s in j < i) factors
    into three exponentials with exponents <= 0:

        exp(Gx_t - Gy_s) = exp(Gx_t - r_i) * exp(r_i - e_j) * exp(e_j - Gy_s)
                           [row, C x K]      [block, NS x NS]  [column, C x K]

    so the float64 work is on [C, K]-sized tensors and the rest is one matmul. Within one
    sub-chunk (j = i) the block factor is exp(r_i - e_i) = exp(span_i) >= 1, safe while every
    span is <= ``MAX_FACTORED_SPAN``; past that (strong gates) the diagonal blocks take
    pairwise differences instead, [..., NS, BS, BS, K], every exponent <= 0. Masked
    exponents are -inf (exactly 0, forward and backward). Each factor is exponentiated in
    float64 and then rounded: rounding an exponent of 20 to fp32 first would cost 1e-6.
    """
    C = x.shape[-2]
    BS = min(SUB_CHUNK, C)
    NS = C // BS
    if Gx.shape[-1] == 1 and Gy.shape[-1] == 1:
        m_all = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
        e = (Gx - Gy.transpose(-1, -2)).masked_fill_(~m_all, -inf).exp().to(x.dtype)
        return [(x @ y.transpose(-1, -2)) * e for y in ys]
    Gx_s, Gy_s = Gx.unflatten(-2, (NS, BS)), Gy.unflatten(-2, (NS, BS))  # [..., NS, BS, K]
    G_end = Gy_s[..., -1, :]  # [..., NS, K]
    G_start = F.pad(G_end[..., :-1, :], (0, 0, 1, 0))
    factored = bool(((G_start - G_end) <= MAX_FACTORED_SPAN).all())
    i_sub = torch.arange(NS, device=x.device)
    m_blk = (i_sub[:, None] >= i_sub[None, :]) if factored else (i_sub[:, None] > i_sub[None, :])
    x_row = x.unflatten(-2, (NS, BS)) * (Gx_s - G_start[..., None, :]).exp().to(x.dtype)
    blk = (G_start[..., :, None, :] - G_end[..., None, :, :]).masked_fill_(~m_blk[..., None], -inf)
    blk = blk.exp().to(x.dtype)[..., :, :, None, :]  # [..., NS (i), NS (j), 1, K]
    to_end = (G_end[..., None, :] - Gy_s).exp().to(x.dtype)  # [..., NS, BS, K]
    y_cols = [(blk * (y.unflatten(-2, (NS, BS)) * to_end)[..., None, :, :, :]).flatten(-3, -2) for y in ys]
    M = [(x_row @ y_c.transpose(-1, -2)).flatten(-3, -2) for y_c in y_cols]  # [..., C, C]
    if factored:
        causal = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
        return [m * causal for m in M]
    i_t = torch.arange(BS, device=x.device)
    m_diag = (i_t[:, None] > i_t[None, :]) if strict else (i_t[:, None] >= i_t[None, :])
    e_diag = (Gx_s[..., :, None, :] - Gy_s[..., None, :, :]).masked_fill_(~m_diag[..., None], -inf)
    x_diag = x.unflatten(-2, (NS, BS))[..., :, None, :] * e_diag.to(x.dtype).exp()
    eye = torch.eye(NS, dtype=x.dtype, device=x.device)
    out = []
    for m, y in zip(M, ys):
        M_diag = (x_diag * y.unflatten(-2, (NS, BS))[..., None, :, :]).sum(-1)  # [..., NS, BS, BS]
        out.append(m + (M_diag[..., :, :, None, :] * eye[:, None, :, None]).flatten(-4, -3).flatten(-2, -1))
    return out


def dplr_chunk(q, k, v, a=None, b=None, gk=None, *, scale: float, u=None, initial_state=None,
               output_final_state: bool = False, cu_seqlens=None, chunk_size: int = 64):
    """The generic DPLR recurrence, chunkwise (core names: ``a`` write direction, ``b`` read).

        S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T
        o_t = S_t^T (scale q_t)                                    (u is None)
        o_t = S_{t-1}^T (scale q_t) + (scale q_t . (u * k_t)) v_t    (u given: RWKV-6's bonus)

    q, k, a, b: [B, T, H, K]; gk: [B, T, H, K], [B, T, H] (scalar decay) or None (no decay);
    a, b: None for no low-rank term; v: [B, T, H, V]; u: [H, K]. ``initial_state``
    [N, H, K, V]; ``cu_seqlens`` [N+1] packs N sequences along T (B = 1). Any T: each
    sequence is zero-padded to a multiple of ``chunk_size`` (16, 32 or 64), which is exact
    (a padded token leaves the state unchanged). Computes in fp32 (fp64 for fp64 inputs).

    Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32/fp64 or None).
    """
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    dt = compute_dtype(q, k, v, a, b, gk)
    layout = chunk_layout(B, T, check_chunk_size(chunk_size), cu_seqlens, q.device)
    low_rank = a is not None and b is not None
    if gk is None:
        gk = q.new_zeros(B, T, H)
    q, k, v = (to_chunks(x, layout, dt) for x in (q, k, v))  # [N, H, NT, C, *]
    gk = to_chunks(gk, layout, torch.float64)  # [N, H, NT, C, K or 1]
    q = q * scale

    # 1. cumulative log decays from the chunk start (float64), the intra-chunk matrices
    G = gk.cumsum(-2)
    G_prev = F.pad(G, (0, 0, 1, 0))[..., :-1, :]  # one token earlier (0 at the chunk start)
    G_end = G[..., -1:, :]
    bonus = u is not None
    G_q = G_prev if bonus else G  # RWKV-6's bonus: the query reads S_{t-1}
    to_end = (G_end - G).to(dt).exp()
    q_start = q * G_q.to(dt).exp()
    if low_rank:
        a, b = to_chunks(a, layout, dt), to_chunks(b, layout, dt)
        A_qk, A_qa = precise_decayed_scores(q, (k, a), G_q, G, strict=bonus)
        A_bk, A_ba = precise_decayed_scores(b, (k, a), G_prev, G, strict=True)
    else:
        A_qk, = precise_decayed_scores(q, (k,), G_q, G, strict=bonus)
    o_intra = A_qk @ v
    if bonus:
        o_intra = o_intra + (q * u.to(dt)[None, :, None, None, :] * k).sum(-1, keepdim=True) * v
    if low_rank:
        # 2. WY form of the reads u_t = b_t^T S_{t-1}:  u = W S + U~  (the UT transform)
        T_ut = solve_unit_lower(-A_ba)
        W = T_ut @ (b * G_prev.to(dt).exp())
        U_tilde = T_ut @ (A_bk @ v)
        # 3. output, all but the state products
        q_start = q_start + A_qa @ W
        o_intra = o_intra + A_qa @ U_tilde
        a_end = (a * to_end).transpose(-1, -2)
    k_end = (k * to_end).transpose(-1, -2)
    decay_end = G_end.to(dt).exp().transpose(-1, -2)  # [N, H, NT, K or 1, 1]

    # 4. state passing, the only sequential step (unbind: one backward for all chunk slices)
    S = initial(initial_state, layout.N, H, K, V, dt, q.device)
    writes = (k_end @ v).unbind(2)  # [N, H, K, V] per chunk
    q_start, o_intra, decay_end = q_start.unbind(2), o_intra.unbind(2), decay_end.unbind(2)
    if low_rank:
        W, U_tilde, a_end = W.unbind(2), U_tilde.unbind(2), a_end.unbind(2)
    o = []
    for n in range(layout.NT):
        o.append(q_start[n] @ S + o_intra[n])
        S_next = decay_end[n] * S + writes[n]
        if low_rank:
            S_next = S_next + a_end[n] @ (W[n] @ S + U_tilde[n])
        S = S_next
    return finish(torch.stack(o, dim=2), S, layout, out_dtype, output_final_state)
