"""The decay family, chunkwise: linear attention, RetNet, Mamba-2 (simple GLA), GLA, RWKV-6, HGRN2.

One algorithm (:func:`decay_chunk`) for

    S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T          o_t = S_t^T (scale q_t)
    (RWKV-6, bonus u given:  o_t = S_{t-1}^T (scale q_t) + (scale q_t . (u * k_t)) v_t)

with g none, one scalar per token (broadcast over K) or one per key channel. Inside a chunk
of C tokens, with ``G_r = sum_{j<=r} g_j`` (``gamma^r = exp G_r``) and ``G^q`` the decay the
query sees (``G_r``, or ``G_{r-1}`` for RWKV-6 which reads the state before the token's write):

    O = (Q * exp G^q) S + ((Q K^T * Gamma) * M) V        Gamma_ri = exp(G^q_r - G_i)
    S <- exp(G_C) S + (K * exp(G_C - G))^T V

``M`` is the causal mask (strict for RWKV-6, whose own token enters through the bonus).
The delta family (``delta.py``) is this with V replaced by the pseudo values ``v_tilde``.

Each op of the family maps its arguments onto :func:`decay_chunk` in its mechanism file
(``fastweight.mechanisms``): ``(o [B, T, H, V], final state [N, H, K, V] or None)``.
q, k, per-channel gates: [B, T, H, K]; v: [B, T, H, V]; scalar gates [B, T, H]; per-head
constants [H]. ``initial_state``: [N, H, K, V]; ``cu_seqlens`` ([N+1], B = 1) packs N sequences.
"""

from __future__ import annotations



from fastweight.checks import check_chunk_size
from fastweight.chunk.common import (chunk_layout, compute_dtype, decayed_scores, finish, initial,
                                     exp_to, local_cumsum, pass_states, scaled_sum, to_chunks)


def decay_chunk(q, k, v, g=None, u=None, *, scale, initial_state=None, output_final_state=False,
                cu_seqlens=None, chunk_size=64):
    """The generic decay-family chunk algorithm (module docstring). ``g``: None, [B, T, H] or
    [B, T, H, K]; ``u``: None or RWKV-6's bonus [H, K]."""
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    dt = compute_dtype(q, k, v, g, u)
    layout = chunk_layout(B, T, check_chunk_size(chunk_size), cu_seqlens, q.device)
    q, k, v, g = (to_chunks(x, layout, dt) for x in (q, k, v, g))

    # 1. gates: G_r = log gamma^r inside the chunk; G^q is the decay the query sees
    if g is None:
        g = q.new_zeros(*q.shape[:-1], 1)
    G = local_cumsum(g)
    G_q = G if u is None else G - g

    # 2. chunk states: S <- exp(G_C) S + (K * exp(G_C - G))^T V
    G_end = G[..., -1:, :]
    S0 = initial(initial_state, layout.N, H, K, V, dt, q.device)
    states, _, S = pass_states(v, None, k * exp_to(G_end - G, dt), exp_to(G_end.squeeze(-2), dt), S0)

    # 3. output: O = scale ((Q * exp G^q) S + (Q K^T * Gamma * M) V)
    A_qk = decayed_scores(q, k, G_q, G, strict=u is not None)
    o = scaled_sum(q * exp_to(G_q, dt), states, A_qk, v, scale)

    # 4. RWKV-6's bonus: the current token through u instead of the state
    if u is not None:
        o = o + scale * (q * u.to(dt)[None, :, None, None, :] * k).sum(-1, keepdim=True) * v
    return finish(o, S, layout, out_dtype, output_final_state)
