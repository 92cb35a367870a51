"""The fully parallel form: a recurrent mechanism's attention map (seed section 2.4).

For S_0 = 0 every mechanism's output is linear in the values, o_i = sum_{j <= i} A_ij v_j, with

    A_ij = q_i^T P_i P_{i-1} ... P_{j+1} k_j          P_t = Diag(exp gk_t) + a_t b_t^T

(scale folded into q; RWKV-6 reads S_{i-1}, so its product stops at P_{i-1} and its diagonal
is the bonus q_i . (u * k_i)). Closed form: A = A_qk + A_qa (I - A_ba)^{-1} A_bk, the
matrices of docs/dplr_chunk.md taken over the whole sequence; for the delta rule it is
A = (Q K^T * M) T, for the gated delta rule A = (Q K^T * Gamma * M) T_Gamma. Derivation:
docs/parallel_form.md.

:func:`attention_map` serves every registered mechanism through its ``to_dplr`` map. It
computes A as the chunkwise algorithm's output for the values v_j = e_j (the identity):
O(T^2 K) time, O(T^2) memory per head, safe for any decay. Meant for analysis (plots of
a recurrent model's attention), fine for T up to a few thousand.
"""

from __future__ import annotations

import torch

from fastweight.chunk.dplr import dplr_chunk
from fastweight.reference.recurrence import compute_dtype


def attention_map(mechanism, inputs: dict, scale: float | None = None, chunk_size: int = 64) -> torch.Tensor:
    """The attention map A [B, H, T, T] of ``mechanism`` on ``inputs``: A @ V is its output
    ([B, H, T, T * n] for a mechanism whose token takes n DPLR steps, V then its T * n values).

    mechanism: a registry name or a :class:`fastweight.mechanisms.Mechanism`; inputs: as its
    ``sample`` returns them (``[B, T, H, ...]``). ``scale`` defaults to K ** -0.5 as the
    mechanism's own recurrence does. A[b, h, i, j] is the weight of the value written at j in
    the output at i (zero for j > i); with V = ``to_dplr(inputs)['v']`` (the mechanism's
    own v for every row of the DPLR table), ``A @ V`` (as [B, H, T, V]) is the recurrent
    output from a zero initial state. Computed in fp32 (fp64 for fp64 inputs).
    """
    from fastweight.mechanisms import get

    mech = get(mechanism) if isinstance(mechanism, str) else mechanism
    d = mech.to_dplr(inputs)
    A = dplr_attention_map(d["q"], d["k"], d.get("a"), d.get("b"), d.get("gk"), u=d.get("u"), scale=scale,
                           chunk_size=chunk_size)
    n = mech.steps(inputs)
    # a token of n steps (Gated DeltaProduct) reads the state after its last: [B, H, T, T * n]
    return A if n == 1 else A[:, :, n - 1::n]


def dplr_attention_map(q, k, a=None, b=None, gk=None, *, u=None, scale: float | None = None,
                       chunk_size: int = 64) -> torch.Tensor:
    """A [B, H, T, T] of S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    Core names (``a`` write direction, ``b`` read); q, k, a, b: [B, T, H, K]; gk: [B, T, H, K],
    [B, T, H] or None; u: [H, K] (RWKV-6's bonus, output read from S_{t-1}).
    """
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    dt = compute_dtype(q, k, a, b, gk)
    eye = torch.eye(T, dtype=dt, device=q.device)[None, :, None, :].expand(B, T, H, T)
    A, _ = dplr_chunk(q, k, eye, a, b, gk, scale=scale, u=u, chunk_size=chunk_size)
    return A.transpose(1, 2)


def gated_delta_attention_map(q, k, beta, g=None, *, scale: float | None = None) -> torch.Tensor:
    """The seed's closed form for the (gated) delta rule: A = (Q K^T * Gamma * M) T_Gamma.

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
        T_Gamma = (I + strictLower(Diag(beta) (K K^T * Gamma)))^{-1} Diag(beta)
        Gamma_ij = exp(G_i - G_j) (G the cumulative sum of g; all ones for DeltaNet, g None)

    q, k: [B, T, H, K]; beta, g: [B, T, H]. Returns A [B, H, T, T]. O(T^3): one T x T solve.
    """
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    dt = compute_dtype(q, k, beta, g)
    q, k = (x.to(dt).transpose(1, 2) for x in (q, k))  # [B, H, T, K]
    beta = beta.to(dt).transpose(1, 2)  # [B, H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if g is None:
        Gamma = causal.to(dt)
    else:
        G = g.to(dt).transpose(1, 2).cumsum(-1)
        Gamma = torch.where(causal, G[..., :, None] - G[..., None, :], 0.0).exp() * causal
    KKt = (k @ k.transpose(-1, -2)) * Gamma
    eye = torch.eye(T, dtype=dt, device=q.device)
    T_Gamma = torch.linalg.solve_triangular(eye + (beta[..., :, None] * KKt).tril(-1), torch.diag_embed(beta),
                                            upper=False, unitriangular=True)
    return ((scale * q) @ k.transpose(-1, -2) * Gamma) @ T_Gamma
