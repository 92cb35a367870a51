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
  decays): pairwise differences inside 16-token sub-chunks, and a reference point at the
  sub-chunk boundary between sub-chunks (secondary chunking).
- :func:`pass_states`: the only sequential step, the state carried from chunk to chunk.

Gates are ``[..., C, 1]`` (scalar per token, broadcast over K) or ``[..., C, K]`` (per channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastweight.reference.recurrence import compute_dtype

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
    bounds = cu_seqlens.tolist()
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
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, NT * C - layout.T))
    else:
        x = x.new_zeros(N * NT * C, *x.shape[2:]).index_copy(0, layout.positions, x[0])
    return x.reshape(N, NT, C, *x.shape[-2:]).permute(0, 3, 1, 2, 4)


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


def _causal_mask(C: int, strict: bool, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _pairwise_decay(Gx: torch.Tensor, Gy: torch.Tensor, mask: torch.Tensor, dtype) -> torch.Tensor:
    """exp(Gx_r - Gy_i) where ``mask`` (i on or before r), 0 elsewhere: [..., C, C, K]."""
    diff = Gx[..., :, None, :] - Gy[..., None, :, :]
    return exp_to(diff.masked_fill(~mask[..., None], float("-inf")), dtype)


def decayed_scores(x: torch.Tensor, y: torch.Tensor, Gx: torch.Tensor, Gy: torch.Tensor,
                   strict: bool = False) -> torch.Tensor:
    """M_ri = sum_k x_r[k] y_i[k] exp(Gx_r[k] - Gy_i[k]) for i <= r (i < r if ``strict``), else 0.

    x, y: [..., C, K]; Gx, Gy: [..., C, K] or [..., C, 1] (scalar gates). Needs Gy non-increasing
    along C and ``Gx_r <= Gy_{r'}`` for every r' < r, true for ``Gx = Gy = G`` and for the
    exclusive ``Gx = G - g`` with ``Gy = G``. Returns [..., C, C].
    """
    C = x.shape[-2]
    mask = _causal_mask(C, strict, x.device)
    if Gx.shape[-1] == 1 and Gy.shape[-1] == 1:
        return (x @ y.transpose(-1, -2)) * _pairwise_decay(Gx, Gy, mask, x.dtype)[..., 0]
    S = min(SUB_CHUNK, C)
    rows = []
    for s in range(0, C, S):
        x_s, Gx_s = x[..., s:s + S, :], Gx[..., s:s + S, :]
        # inside the sub-chunk: pairwise differences, every exponent <= 0
        diag = torch.einsum("...rk,...ik,...rik->...ri", x_s, y[..., s:s + S, :],
                            _pairwise_decay(Gx_s, Gy[..., s:s + S, :], mask[:S, :S], x.dtype))
        blocks = [diag, x.new_zeros(*diag.shape[:-1], C - s - S)]
        if s > 0:
            # earlier sub-chunks: both factors decay towards the reference point G_{s-1}
            ref = Gy[..., s - 1:s, :]
            x_ref = x_s * exp_to(Gx_s - ref, x.dtype)
            y_ref = y[..., :s, :] * exp_to(ref - Gy[..., :s, :], x.dtype)
            blocks.insert(0, x_ref @ y_ref.transpose(-1, -2))
        rows.append(torch.cat(blocks, dim=-1))
    return torch.cat(rows, dim=-2)


def pass_states(U: torch.Tensor, W: torch.Tensor | None, k_end: torch.Tensor, decay_end: torch.Tensor,
                S0: torch.Tensor):
    """The state from chunk to chunk (the only sequential step).

        v_tilde_n = U_n - W_n S_n          (U_n when W is None: the decay family)
        S_{n+1}   = Diag(decay_end_n) S_n + k_end_n^T v_tilde_n

    U: [N, H, NT, C, V]; W, k_end: [N, H, NT, C, K]; decay_end: [N, H, NT, K or 1]; S0: [N, H, K, V].
    Returns (S_n at every chunk start [N, H, NT, K, V], v_tilde [N, H, NT, C, V], final state).
    """
    NT = U.shape[2]
    if W is None:
        writes = k_end.transpose(-1, -2) @ U  # [N, H, NT, K, V]
    states, v_tilde, S = [], [], S0
    for n in range(NT):
        states.append(S)
        if W is None:
            S = decay_end[:, :, n, :, None] * S + writes[:, :, n]
        else:
            v_n = U[:, :, n] - W[:, :, n] @ S
            v_tilde.append(v_n)
            S = decay_end[:, :, n, :, None] * S + k_end[:, :, n].transpose(-1, -2) @ v_n
    v_tilde = U if W is None else torch.stack(v_tilde, dim=2)
    return torch.stack(states, dim=2), v_tilde, S


def initial(initial_state: torch.Tensor | None, N: int, H: int, K: int, V: int, dtype, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(N, H, K, V, dtype=dtype, device=device)
    return initial_state.to(dtype)


def finish(o: torch.Tensor, S: torch.Tensor, layout: Layout, out_dtype: torch.dtype, output_final_state: bool):
    """Back to [B, T, H, V] in ``out_dtype``; the final state in fp32 (fp64 for fp64 inputs)."""
    final = None
    if output_final_state:
        final = S.to(torch.float64 if S.dtype == torch.float64 else torch.float32)
    return from_chunks(o, layout).to(out_dtype), final


__all__ = ["Layout", "chunk_layout", "to_chunks", "from_chunks", "local_cumsum", "exp_to", "decayed_scores",
           "pass_states", "initial", "finish", "compute_dtype"]
