"""Generic DPLR, chunkwise, in PyTorch: RWKV-7 and fla's ``chunk_dplr_delta_rule``.

    S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T        o_t = S_t^T (scale q_t)

Core names (DESIGN.md): ``a`` is the low-rank write direction, ``b`` is read against
the *undecayed* state. fla's ``chunk_dplr_delta_rule(q, k, v, a, b, gk)`` and
``chunk_rwkv7(r, w, k, v, a, b)`` name them the other way round; the two functions with
fla's names at the end of this file keep fla's meaning and swap.

Inside a chunk of C tokens starting from the state S (G = cumulative log decay from the
chunk start, G^- the same one step earlier; derivation in docs/dplr_chunk.md):

    1. intra-chunk matrices, decays folded in as exp(G_t - G_s) <= 1:
       A_ba = strictLower(b a^T), A_bk = strictLower(b k^T)    rows read at t - 1
       A_qa = lower(q a^T),       A_qk = lower(q k^T)          rows read at t
    2. WY form of the low-rank reads u_t = b_t^T S_{t-1} (the UT transform):
       u = W S + U~,   W = (I - A_ba)^{-1} (b * exp(G^-)),   U~ = (I - A_ba)^{-1} A_bk V
    3. output:  O = (q * exp(G) + A_qa W) S + A_qa U~ + A_qk V
    4. state:   S <- Diag(exp G_C) S + (a * exp(G_C - G))^T u + (k * exp(G_C - G))^T V

Steps 1-3 (all but the ``S`` products) run for every chunk at once; step 4 is the only
sequential loop, over chunks. Per-token states are never formed.

Numerical safety without clamping gates: every exponent taken is <= 0. Pairs (t, s) in
different 16-token sub-chunks factor exp(G_t - G_s) = exp(G_t - G_r) exp(G_r - G_s) with r
the end of the sub-chunk before t's (both factors <= 1); pairs inside one sub-chunk take
the pairwise difference directly ([16, 16, K] per sub-chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastweight.checks import check_chunk_size
from fastweight.reference.recurrence import compute_dtype

SUB_CHUNK = 16


def decayed_scores(x: torch.Tensor, g_row: torch.Tensor, y: torch.Tensor, g_col: torch.Tensor,
                   strict: bool) -> torch.Tensor:
    """A[t, s] = sum_c x[t, c] y[s, c] exp(g_row[t, c] - g_col[s, c]) for s <= t (s < t if strict).

    x, g_row, y, g_col: [..., C, K]; returns [..., C, C], zero above the (strict) diagonal.
    ``g_col`` is the inclusive cumulative log decay from the chunk start (<= 0, non-increasing)
    and ``g_row[t]`` is g_col at t or t - 1 (0 before the chunk start), so g_row[t] <= g_col[s]
    wherever A[t, s] is kept and every exponential below has an argument <= 0.
    """
    C, K = x.shape[-2:]
    BS = min(SUB_CHUNK, C)
    NS = C // BS
    # off-diagonal sub-chunk blocks: reference r_i = g_col at the end of sub-chunk i - 1 (0 for i = 0)
    g_ref = F.pad(g_col[..., BS - 1::BS, :][..., :-1, :], (0, 0, 1, 0))  # [..., NS, K]
    x_off = x.unflatten(-2, (NS, BS)) * (g_row.unflatten(-2, (NS, BS)) - g_ref[..., None, :]).exp()
    m_off = (torch.arange(C, device=x.device)[None, :] < torch.arange(NS, device=x.device)[:, None] * BS)
    e_off = torch.where(m_off[..., None], g_ref[..., :, None, :] - g_col[..., None, :, :], 0.0)
    y_off = y[..., None, :, :] * e_off.exp() * m_off[..., None]  # [..., NS, C, K]
    A = torch.einsum("...itc,...isc->...its", x_off, y_off).flatten(-3, -2)  # [..., C, C]
    # diagonal sub-chunk blocks: pairwise differences
    i_t = torch.arange(BS, device=x.device)
    m_diag = (i_t[:, None] > i_t[None, :]) if strict else (i_t[:, None] >= i_t[None, :])
    xs, ys = x.unflatten(-2, (NS, BS)), y.unflatten(-2, (NS, BS))
    gr, gc = g_row.unflatten(-2, (NS, BS)), g_col.unflatten(-2, (NS, BS))
    e_diag = torch.where(m_diag[..., None], gr[..., :, None, :] - gc[..., None, :, :], 0.0)
    A_diag = (xs[..., :, None, :] * ys[..., None, :, :] * e_diag.exp()).sum(-1) * m_diag  # [..., NS, BS, BS]
    eye = torch.eye(NS, dtype=A.dtype, device=A.device)
    return A + (A_diag[..., :, :, None, :] * eye[:, None, :, None]).flatten(-4, -3).flatten(-2, -1)


def _to_chunks(x: torch.Tensor, NT: int, C: int, dt: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, NT, C, D], zero-padded at the end of T."""
    x = x.to(dt)
    x = F.pad(x, (0, 0, 0, 0, 0, NT * C - x.shape[1]))
    return x.transpose(1, 2).unflatten(2, (NT, C))


def dplr_chunk(q, k, v, a=None, b=None, gk=None, *, scale: float, u=None, initial_state=None,
               output_final_state: bool = False, cu_seqlens=None, chunk_size: int = 64):
    """The generic DPLR recurrence, chunkwise (core names: ``a`` write direction, ``b`` read).

        S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T
        o_t = S_t^T (scale q_t)                                    (u is None)
        o_t = S_{t-1}^T (scale q_t) + (scale q_t . (u * k_t)) v_t    (u given: RWKV-6's bonus)

    q, k, a, b: [B, T, H, K]; gk: [B, T, H, K], [B, T, H] (scalar decay) or None (no decay);
    a, b: None for no low-rank term; v: [B, T, H, V]; u: [H, K]. ``initial_state``
    [N, H, K, V]; ``cu_seqlens`` [N+1] packs N sequences along T (B = 1). Any T; T is
    zero-padded to a multiple of ``chunk_size`` (16, 32 or 64), which is exact: a padded
    token does not change the state. Computes in fp32 (fp64 for fp64 inputs).

    Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32/fp64 or None).
    """
    C = check_chunk_size(chunk_size)
    if cu_seqlens is not None:
        return _varlen(q, k, v, a, b, gk, scale=scale, u=u, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=C)
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    dt = compute_dtype(q, k, v, a, b, gk, u, initial_state)
    low_rank = a is not None and b is not None
    if gk is None:
        gk = q.new_zeros(B, T, H, K)
    elif gk.dim() == 3:
        gk = gk[..., None].expand(B, T, H, K)
    NT = max(-(-T // C), 1)
    q, k, v, gk = (_to_chunks(x, NT, C, dt) for x in (q, k, v, gk))  # [B, H, NT, C, *]
    q = q * scale

    # 1. cumulative log decays from the chunk start, and the intra-chunk matrices
    G = gk.cumsum(-2)
    G_prev = F.pad(G, (0, 0, 1, 0))[..., :-1, :]
    G_last = G[..., -1:, :]
    bonus = u is not None
    G_q = G_prev if bonus else G
    A_qk = decayed_scores(q, G_q, k, G, strict=bonus)
    q_eff = q * G_q.exp()
    k_end = k * (G_last - G).exp()
    o_intra = A_qk @ v
    if bonus:
        o_intra = o_intra + (q * u.to(dt)[:, None, None, :] * k).sum(-1, keepdim=True) * v
    if low_rank:
        a, b = _to_chunks(a, NT, C, dt), _to_chunks(b, NT, C, dt)
        A_ba = decayed_scores(b, G_prev, a, G, strict=True)
        A_bk = decayed_scores(b, G_prev, k, G, strict=True)
        A_qa = decayed_scores(q, G_q, a, G, strict=bonus)
        # 2. WY form of u_t = b_t^T S_{t-1}: one unit-lower solve for W and U~ together
        I_minus = torch.eye(C, dtype=dt, device=q.device) - A_ba
        WU = torch.linalg.solve_triangular(I_minus, torch.cat([b * G_prev.exp(), A_bk @ v], -1),
                                           upper=False, unitriangular=True)
        W, U_tilde = WU[..., :K], WU[..., K:]
        # 3. output, everything but the S products
        q_eff = q_eff + A_qa @ W
        o_intra = o_intra + A_qa @ U_tilde
        a_end = a * (G_last - G).exp()
    decay_last = G_last.exp().transpose(-1, -2)  # [B, H, NT, K, 1]

    # 4. state passing, chunk by chunk
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dt)
    outs = []
    for n in range(NT):
        outs.append(q_eff[:, :, n] @ S + o_intra[:, :, n])
        S_next = decay_last[:, :, n] * S + k_end[:, :, n].transpose(-1, -2) @ v[:, :, n]
        if low_rank:
            S_next = S_next + a_end[:, :, n].transpose(-1, -2) @ (W[:, :, n] @ S + U_tilde[:, :, n])
        S = S_next
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), (S if output_final_state else None)


def _varlen(q, k, v, a, b, gk, *, scale, u, initial_state, output_final_state, cu_seqlens, chunk_size):
    """Packed sequences: gather each into a zero-padded row of a [N, L, H, *] batch, run, scatter back."""
    bounds = cu_seqlens.tolist()
    starts = torch.tensor(bounds[:-1], device=q.device)
    lens = torch.tensor([e - s for s, e in zip(bounds[:-1], bounds[1:])], device=q.device)
    T = q.shape[1]
    L = max(int(lens.max()) if len(lens) else 0, 1)
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < lens[:, None]  # [N, L]
    idx = (starts[:, None] + pos[None, :]).clamp(max=max(T - 1, 0))

    def gather(x):
        if x is None:
            return None
        if T == 0:
            return x.new_zeros(len(lens), L, *x.shape[2:])
        return x[0][idx] * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)

    o, S = dplr_chunk(gather(q), gather(k), gather(v), gather(a), gather(b), gather(gk), scale=scale,
                      u=u, initial_state=initial_state, output_final_state=output_final_state,
                      chunk_size=chunk_size)
    return o[valid][None], S


def chunk_dplr_delta_rule(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False,
                          cu_seqlens=None, chunk_size=64, **_):
    """fla's meaning: S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    fla's ``a`` is read against the state and ``b`` is the write direction (the core's b, a).
    q, k, a, b, gk: [B, T, H, K]; v: [B, T, H, V]. Returns (o, final state or None).
    """
    return dplr_chunk(q, k, v, a=b, b=a, gk=gk, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def chunk_rwkv7(r, w, k, v, a, b, *, scale, initial_state=None, output_final_state=False,
                cu_seqlens=None, chunk_size=64, **_):
    """RWKV-7 with fla's arguments: ``chunk_dplr_delta_rule(q=r, k, v, a, b, gk=w)``.

    w: log decay [B, T, H, K] (RWKV-7's w_t = exp(-exp(-0.5) sigmoid(.)) gives w in [-0.607, 0]);
    a = -kappa-hat (read against S), b = kappa-hat * iclr (write direction), as fla passes them.
    """
    return chunk_dplr_delta_rule(r, k, v, a, b, w, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                 chunk_size=chunk_size)
