"""The definitions: per-token loops, any dtype, float64 on the CPU is the truth.

Every mechanism is a ``step`` (its own recurrence, as in its paper) and a
``readout``; :func:`run_recurrence` drives them over ``[B, T, H, ...]`` inputs
with ``initial_state``, ``output_final_state`` and ``cu_seqlens``.
:func:`dplr_recurrent` is the one recurrence they all reduce to:

    S_t = (Diag(exp(gk_t)) + a_t b_t^T) S_{t-1} + k_t v_t^T        o_t = S_t^T (scale * q_t)

``b_t^T S`` reads the *undecayed* state. These are the core's own names
(DESIGN.md table): ``a`` is the low-rank write direction, ``b`` is read
against the state. fla's ``chunk_dplr_delta_rule`` names them the other way.
"""

from __future__ import annotations

from typing import Callable

import torch

Step = Callable[[torch.Tensor, dict], torch.Tensor]
Readout = Callable[[torch.Tensor, torch.Tensor, dict, float], torch.Tensor]


def compute_dtype(*tensors) -> torch.dtype:
    """float64 if any input is float64, else float32 (low precision inputs accumulate in fp32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def default_readout(S_prev: torch.Tensor, S: torch.Tensor, x: dict, scale: float) -> torch.Tensor:
    """o_t = S_t^T (scale q_t): [B, H, K, V], [B, H, K] -> [B, H, V]."""
    return torch.einsum("bhk,bhkv->bhv", x["q"] * scale, S)


def run_recurrence(step: Step, inputs: dict, *, key_dim: int, value_dim: int, scale: float,
                   readout: Readout = default_readout, initial_state: torch.Tensor | None = None,
                   output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None):
    """Drive ``step`` over time.

    inputs: name -> tensor ``[B, T, H, ...]`` (all with the same B, T, H) or a per-head
    parameter that does not vary in time, passed under a name starting with ``_`` (kept whole).
    The state is ``[B, H, K, V]`` in :func:`compute_dtype`; ``initial_state`` is ``[N, H, K, V]``
    (N = B, or the number of sequences with ``cu_seqlens``, where B must be 1).

    Returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)``; ``o`` in ``out_dtype``
    (default: the dtype of ``inputs['v']``), the state in fp32 (fp64 for fp64 inputs).
    """
    timed = {n: t for n, t in inputs.items() if not n.startswith("_") and t is not None}
    static = {n: t for n, t in inputs.items() if n.startswith("_")}
    ref = next(iter(timed.values()))
    B, T, H = ref.shape[:3]
    dt = compute_dtype(*timed.values())
    out_dtype = out_dtype or inputs["v"].dtype
    timed = {n: t.to(dt) for n, t in timed.items()}
    static = {n: (t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in static.items()}
    if cu_seqlens is None:
        spans = [(slice(None), 0, T, slice(None))]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(slice(0, 1), bounds[i], bounds[i + 1], slice(i, i + 1)) for i in range(len(bounds) - 1)]
    o = torch.zeros(B, T, H, value_dim, dtype=dt, device=ref.device)
    finals = []
    for rows, bos, eos, state_rows in spans:
        nb = B if cu_seqlens is None else 1
        if initial_state is None:
            S = torch.zeros(nb, H, key_dim, value_dim, dtype=dt, device=ref.device)
        else:
            S = initial_state[state_rows].to(dt)
        outs = []
        for t in range(bos, eos):
            x = {n: v[rows, t] for n, v in timed.items()}
            x.update(static)
            S_prev, S = S, step(S, x)
            outs.append(readout(S_prev, S, x, scale))
        if outs:
            o[rows, bos:eos] = torch.stack(outs, dim=1)
        finals.append(S)
    final = None
    if output_final_state:
        final = torch.cat(finals, dim=0).to(torch.float64 if dt == torch.float64 else torch.float32)
    return o.to(out_dtype), final


def dplr_step(S: torch.Tensor, x: dict) -> torch.Tensor:
    """S <- Diag(exp(gk)) S + a (b^T S) + k v^T, with b^T S on the undecayed S.

    gk: [B, H, K] or [B, H] (scalar decay); a, b: [B, H, K] or absent (zero).
    """
    gk = x.get("gk")
    if gk is None:
        decayed = S
    elif gk.dim() == S.dim() - 2:
        decayed = S * gk.exp()[..., None, None]
    else:
        decayed = S * gk.exp()[..., None]
    if x.get("a") is not None and x.get("b") is not None:
        decayed = decayed + x["a"][..., None] * torch.einsum("bhk,bhkv->bhv", x["b"], S)[..., None, :]
    return decayed + x["k"][..., None] * x["v"][..., None, :]


def bonus_readout(S_prev: torch.Tensor, S: torch.Tensor, x: dict, scale: float) -> torch.Tensor:
    """RWKV-6's readout: o_t = S_{t-1}^T (scale q) + (scale q . (u * k_t)) v_t (u: [H, K], passed as `_u`)."""
    q = x["q"] * scale
    return torch.einsum("bhk,bhkv->bhv", q, S_prev) + (q * x["_u"] * x["k"]).sum(-1, keepdim=True) * x["v"]


def dplr_recurrent(q, k, v, a=None, b=None, gk=None, scale=None, initial_state=None,
                   output_final_state=False, cu_seqlens=None, u=None):
    """The generic DPLR recurrence, one token at a time (the definition).

        S_t = (Diag(exp(gk_t)) + a_t b_t^T) S_{t-1} + k_t v_t^T
        o_t = S_t^T (scale q_t)                            (u is None)
        o_t = S_{t-1}^T (scale q_t) + (scale q_t . (u * k_t)) v_t   (u given: RWKV-6's bonus)

    q, k, a, b, gk: [B, T, H, K] (gk may be [B, T, H]: a scalar decay); v: [B, T, H, V];
    u: [H, K]. ``initial_state``: [N, H, K, V]; ``cu_seqlens``: [N+1] (B = 1).
    Returns (o [B, T, H, V], final state [N, H, K, V] or None).
    """
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    inputs = dict(q=q, k=k, v=v, a=a, b=b, gk=gk)
    readout = default_readout
    if u is not None:
        inputs["_u"] = u
        readout = bonus_readout
    return run_recurrence(dplr_step, inputs, key_dim=K, value_dim=v.shape[-1], scale=scale,
                          readout=readout, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
