"""The delta family, chunkwise: DeltaNet, Gated DeltaNet, KDA, Comba, Longhorn.

One algorithm (:func:`delta_chunk`) for

    S_t = D_t S_{t-1} + k_t u_t^T,     u_t = beta_t (v_t - r_t^T S~_{t-1}),     o_t = S_t^T (scale q_t)

with ``D_t = Diag(exp g_t)`` (g: none, one scalar per token, or one per key channel),
the read key ``r_t`` (``k_t``, or Comba's ``p_t``) and ``S~_{t-1}`` the state it reads:
``D_t S_{t-1}`` (decay, then one SGD step: GDN, KDA) or ``S_{t-1}`` (Comba).
``u_t`` is the seed's pseudo value: the learning rate times the prediction residual.

Inside a chunk of C tokens, with ``G_r = sum_{j<=r} g_j`` (``gamma^r = exp G_r``) and
``G~_r`` the decay the read key sees (``G_r`` or ``G_{r-1}``), unrolling gives (seed
sections 2-3, derivation in docs/chunk.md):

    (I + strictLower(diag(beta) (R K^T * Gamma))) U~ = diag(beta) (V - (R * exp G~) S)
    Gamma_ri = exp(G~_r - G_i)

so with the UT transform ``T = (I + strictLower(...))^{-1} diag(beta)``:

    W = T (R * exp G~)      U = T V      v_tilde = U - W S            (the pseudo values)
    O = scale ((Q * exp G) S + ((Q K^T * Gamma) * M) v_tilde)          Gamma_ri = exp(G_r - G_i)
    S <- exp(G_C) S + (K * exp(G_C - G))^T v_tilde

:func:`delta_chunk` (each op of the family maps onto it in its mechanism file) returns
``(o [B, T, H, V], final state [N, H, K, V] or None)``.
q, k (and p, per-channel g): [B, T, H, K]; v: [B, T, H, V]; beta, scalar g: [B, T, H].
``initial_state``: [N, H, K, V]; ``cu_seqlens`` ([N+1], B = 1) packs N sequences along T.
Gradients flow to every input (autograd through the chunk loop; the solve and the pairwise
decay matrix have their own backward).
"""

from __future__ import annotations

from fastweight.checks import check_chunk_size
from fastweight.chunk.common import (chunk_layout, compute_dtype, decayed_scores, finish, initial,
                                     exp_to, local_cumsum, pass_states, scaled_sum, to_chunks)
from fastweight.chunk.solve_tril import solve_unit_lower


def delta_chunk(q, k, v, beta, g=None, read_key=None, read_after_decay=True, *, scale, initial_state=None,
                output_final_state=False, cu_seqlens=None, chunk_size=64):
    """The generic delta-family chunk algorithm (module docstring). ``g``: None, [B, T, H] or
    [B, T, H, K]; ``read_key``: None (use k) or [B, T, H, K]."""
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    dt = compute_dtype(q, k, v, beta, g, read_key)
    layout = chunk_layout(B, T, check_chunk_size(chunk_size), cu_seqlens, q.device)
    q, k, v, beta, g, r = (to_chunks(x, layout, dt) for x in (q, k, v, beta, g, read_key))
    r = k if r is None else r

    # 1. gates: G_r = log gamma^r inside the chunk; G~ is the decay the read key sees
    if g is None:
        g = q.new_zeros(*q.shape[:-1], 1)
    G = local_cumsum(g)
    G_read = G if read_after_decay else G - g

    # 2. intra-chunk scores (Q K^T * Gamma * M) and the UT transform
    #    T = (I + strictLower(diag(beta) (R K^T * Gamma)))^{-1} diag(beta)
    if read_after_decay:
        # same decays on both: one Gamma; the solve reads only the strictly lower part
        A_kk, A_qk = decayed_scores([r, q], k, G, G)
    else:
        A_kk, A_qk = decayed_scores(r, k, G_read, G, strict=True), decayed_scores(q, k, G, G)
    T_ut = solve_unit_lower(beta * A_kk) * beta.transpose(-1, -2)
    W = T_ut @ (r * exp_to(G_read, dt))
    U = T_ut @ v

    # 3. state passing: v_tilde = U - W S, S <- exp(G_C) S + K_end^T v_tilde
    G_end = G[..., -1:, :]
    S0 = initial(initial_state, layout.N, H, K, V, dt, q.device)
    states, v_tilde, S = pass_states(U, W, k * exp_to(G_end - G, dt), exp_to(G_end.squeeze(-2), dt), S0)

    # 4. output: O = scale ((Q * gamma) S + (Q K^T * Gamma * M) v_tilde)
    o = scaled_sum(q * exp_to(G, dt), states, A_qk, v_tilde, scale)
    return finish(o, S, layout, out_dtype, output_final_state)
