"""Stages shared by the chunkwise algorithms of the decay and delta families.

- :func:`to_chunks` / :func:`from_chunks`: ``[B, T, H, ...]`` (or packed varlen with
  ``cu_seqlens``) <-> ``[N, H, NT, C, ...]``, one row per sequence, the tail zero padded.
  A padded token has k = v = 0, beta = 0 and log decay 0: it leaves the state unchanged,
  so the final state of a sequence is the state after its last real token.
- :func:`local_cumsum`: ``G_r = sum_{j <= r} g_j`` inside each chunk (log of ``gamma^r``), kept in
  float64: a difference ``G_r - G_i`` of sums that reach -1000 keeps fp32 accuracy only so.
  Exponentials are taken after the difference, in the compute dtype (:func:`exp_to`).
- :func:`decayed_scores`: the intra-chunk matrix ``M_ri = sum_k x_r[k] y_i[k] exp(Gx_r[k] - Gy_i[k])``
  on and below the diagonal, without ever forming ``exp(-G)`` (which overflows for strong
  decays): for scalar gates the [C, C] matrix of pairwise differences; for per-channel gates
  secondary chunking, halving the chunk down to single tokens with a reference point at each
  boundary.
- :func:`pass_states`: the only sequential step, the state carried from chunk to chunk.

Gates are ``[..., C, 1]`` (scalar per token, broadcast over K) or ``[..., C, K]`` (per channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from fastweight.checks import host_bounds
from fastweight.reference.recurrence import compute_dtype

# sub-chunk size of the secondary chunking in the DPLR path (dplr.py)
SUB_CHUNK = 16


@dataclass(frozen=True)
class Layout:
    """How ``[B, T, ...]`` maps onto ``[N, H, NT, C, ...]`` (see :func:`to_chunks`)."""
    B: int
    T: int
    N: int
    NT: int
    C: int
    positions: torch.Tensor | None  # varlen: [T] row of each packed token in the [N * NT * C] layout


def chunk_layout(B: int, T: int, C: int, cu_seqlens: torch.Tensor | None, device) -> Layout:
    if cu_seqlens is None:
        return Layout(B, T, B, max(1, -(-T // C)), C, None)
    bounds = host_bounds(cu_seqlens)
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    N, NT = len(lengths), max(1, -(-max(lengths) // C))
    positions = torch.cat([torch.arange(n, device=device) + i * NT * C for i, n in enumerate(lengths)])
    return Layout(B, T, N, NT, C, positions)


def to_chunks(x: torch.Tensor | None, layout: Layout, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, T, H, ...] -> [N, H, NT, C, ...] in ``dtype``, zero padded (a scalar gate gets a trailing 1)."""
    if x is None:
        return None
    x = x.to(dtype)
    if x.dim() == 3:
        x = x[..., None]
    N, NT, C = layout.N, layout.NT, layout.C
    if layout.positions is None:
        # one copy into the contiguous chunked layout (a strided view would be copied again
        # by every matmul)
        x = x.transpose(1, 2)
        if NT * C == layout.T:
            x = x.contiguous()
        else:
            x = torch.nn.functional.pad(x, (0, 0, 0, NT * C - layout.T))
        return x.view(N, x.shape[1], NT, C, x.shape[-1])
    x = x.new_zeros(N * NT * C, *x.shape[2:]).index_copy(0, layout.positions, x[0])
    return x.reshape(N, NT, C, *x.shape[-2:]).permute(0, 3, 1, 2, 4).contiguous()


def from_chunks(o: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[N, H, NT, C, V] -> [B, T, H, V]."""
    N, H, NT, C, V = o.shape
    o = o.permute(0, 2, 3, 1, 4).reshape(N, NT * C, H, V)
    if layout.positions is None:
        return o[:, :layout.T]
    return o.reshape(N * NT * C, H, V)[layout.positions][None]


def local_cumsum(g: torch.Tensor) -> torch.Tensor:
    """G_r = sum_{j <= r} g_j within each chunk, in float64: [..., C, K or 1]."""
    return g.double().cumsum(-2)


def exp_to(log_decay: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of a (float64) log decay or difference of log decays, in ``dtype``."""
    return log_decay.to(dtype).exp()


def _causal_mask(C: int, strict: bool, dtype, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=dtype, device=device).tril(-1 if strict else 0)


class _PairwiseDecay(torch.autograd.Function):
    """Gamma_ri = exp(Gx_r - Gy_i) on the 0/1 ``mask`` (i on or before r), 0 elsewhere.

    Gx: [..., C, K], Gy: [..., C', K] (float64) -> [..., C, C', K] in the mask's dtype. The
    difference is taken in float64 and stored in the compute dtype; the exponent is clamped at 0
    (off the mask it may be positive and overflow; on the mask it is <= 0 already). Backward:
    with P = dGamma * Gamma, dGx_r = sum_i P_ri and dGy_i = -sum_r P_ri.
    """

    @staticmethod
    def forward(ctx, Gx, Gy, mask):
        Gamma = torch.empty(*Gx.shape[:-1], Gy.shape[-2], Gx.shape[-1], dtype=mask.dtype, device=Gx.device)
        torch.sub(Gx[..., :, None, :], Gy[..., None, :, :], out=Gamma)
        Gamma.clamp_(max=0).exp_().mul_(mask[..., None])
        ctx.save_for_backward(Gamma)
        return Gamma

    @staticmethod
    @once_differentiable
    def backward(ctx, dGamma):
        (Gamma,) = ctx.saved_tensors
        P = (dGamma * Gamma).double()
        return P.sum(-2), -P.sum(-3), None


def _pairwise_decay(Gx: torch.Tensor, Gy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _PairwiseDecay.apply(Gx, Gy, mask)


def decayed_scores(xs, y: torch.Tensor, Gx: torch.Tensor, Gy: torch.Tensor, strict: bool = False):
    """M_ri = sum_k x_r[k] y_i[k] exp(Gx_r[k] - Gy_i[k]) for i <= r (i < r if ``strict``), else 0.

    xs: one [..., C, K] tensor or a list of them (they share the decays: one Gamma for all);
    y: [..., C, K]; Gx, Gy: [..., C, K] or [..., C, 1] (scalar gates). Needs Gy non-increasing
    along C and ``Gx_r <= Gy_{r'}`` for every r' < r (r' <= r unless ``strict``), true for
    ``Gx = Gy = G`` and for the exclusive ``Gx = G - g`` with ``Gy = G`` and ``strict``.
    C: a power of two for per-channel gates. Returns [..., C, C] (a list for a list).
    """
    if isinstance(xs, torch.Tensor):
        return decayed_scores([xs], y, Gx, Gy, strict)[0]
    C, dtype = y.shape[-2], y.dtype
    if Gx.shape[-1] == 1 and Gy.shape[-1] == 1:
        mask = _causal_mask(C, strict, dtype, y.device)
        Gamma = _pairwise_decay(Gx, Gy, mask)[..., 0]  # one [C, C] Gamma for all of xs
        return [(x @ y.transpose(-1, -2)) * Gamma for x in xs]
    # per-channel gates: secondary chunking, halving down to single tokens. At each level the
    # rows of every second half and the columns of the first half decay towards the boundary
    # between them (G at the first half's last position): both exponents are <= 0.
    Ms = [x.new_zeros(*x.shape[:-1], C) for x in xs]
    h = C // 2
    while h >= 1:
        def halves(t, i):
            return t.unflatten(-2, (C // (2 * h), 2, h))[..., i, :, :]  # [..., C / 2h, h, K]

        ref = halves(Gy, 0)[..., h - 1:, :]
        y_ref = halves(y, 0) * exp_to(ref - halves(Gy, 0), dtype)
        x_decay = exp_to(halves(Gx, 1) - ref, dtype)
        for x, M in zip(xs, Ms):
            _below_diagonal_blocks(M, h).copy_((halves(x, 1) * x_decay) @ y_ref.transpose(-1, -2))
        h //= 2
    if not strict:
        for x, M in zip(xs, Ms):
            M.diagonal(dim1=-2, dim2=-1).copy_((x * y * exp_to(Gx - Gy, dtype)).sum(-1))
    return Ms


def _below_diagonal_blocks(M: torch.Tensor, h: int) -> torch.Tensor:
    """View of the h x h blocks of M [..., C, C] with rows in the second and columns in the first
    half of each 2h-block on the diagonal: [..., C / 2h, h, h]."""
    C = M.shape[-1]
    nb = C // (2 * h)
    blocks = M.view(*M.shape[:-2], nb, 2, h, nb, 2, h)[..., :, 1, :, :, 0, :]  # [..., nb, h, nb, h]
    return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def pass_states(U: torch.Tensor, W: torch.Tensor | None, k_end: torch.Tensor, decay_end: torch.Tensor,
                S0: torch.Tensor):
    """The state from chunk to chunk (the only sequential step).

        v_tilde_n = U_n - W_n S_n          (U_n when W is None: the decay family)
        S_{n+1}   = Diag(decay_end_n) S_n + k_end_n^T v_tilde_n

    U: [N, H, NT, C, V]; W, k_end: [N, H, NT, C, K]; decay_end: [N, H, NT, K or 1]; S0: [N, H, K, V].
    Returns (S_n at every chunk start [N, H, NT, K, V], v_tilde [N, H, NT, C, V], final state).
    """
    N, H, NT, C, V = U.shape
    K = k_end.shape[-1]
    # flatten (N, H) into one batch for baddbmm, and unbind once: slicing chunk n out of a
    # stacked tensor in the loop would cost a full-size zero-filled gradient per slice in
    # backward (quadratic in T)
    decay_end = decay_end.flatten(0, 1)[..., None].unbind(1)  # [N*H, K or 1, 1] each
    S = S0.reshape(N * H, K, V)
    if W is None:
        writes = (k_end.transpose(-1, -2) @ U).flatten(0, 1).unbind(1)  # [N*H, K, V] each
    else:
        U, W = U.flatten(0, 1).unbind(1), W.flatten(0, 1).unbind(1)
        k_end_T = k_end.transpose(-1, -2).flatten(0, 1).unbind(1)
    states, v_tilde = [], []
    for n in range(NT):
        states.append(S)
        if W is None:
            S = decay_end[n] * S + writes[n]
        else:
            v_n = torch.baddbmm(U[n], W[n], S, alpha=-1)  # U_n - W_n S
            v_tilde.append(v_n)
            S = torch.baddbmm(decay_end[n] * S, k_end_T[n], v_n)
    v_tilde = U if W is None else torch.stack(v_tilde, dim=1).view(N, H, NT, C, V)
    return torch.stack(states, dim=1).view(N, H, NT, K, V), v_tilde, S.view(N, H, K, V)


def initial(initial_state: torch.Tensor | None, N: int, H: int, K: int, V: int, dtype, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(N, H, K, V, dtype=dtype, device=device)
    return initial_state.to(dtype)


def scaled_sum(X1, Y1, X2, Y2, scale: float) -> torch.Tensor:
    """scale (X1 Y1 + X2 Y2) for batched matrices [..., m, n] (one fused matmul-add)."""
    out = X1 @ Y1
    out.flatten(0, -3).baddbmm_(X2.flatten(0, -3), Y2.flatten(0, -3), beta=scale, alpha=scale)
    return out


def finish(o: torch.Tensor, S: torch.Tensor, layout: Layout, out_dtype: torch.dtype, output_final_state: bool):
    """Back to [B, T, H, V] in ``out_dtype``; the final state in fp32 (fp64 for fp64 inputs)."""
    final = None
    if output_final_state:
        final = S.to(torch.float64 if S.dtype == torch.float64 else torch.float32)
    return from_chunks(o, layout).to(out_dtype), final


__all__ = ["Layout", "chunk_layout", "to_chunks", "from_chunks", "local_cumsum", "exp_to", "decayed_scores",
           "pass_states", "initial", "scaled_sum", "finish", "compute_dtype"]
