"""The public ops served by the per-token definitions (``backend="reference"``).

Same signatures as every other backend (see ``fastweight.dispatch``); inputs arrive
validated, with the key-side tensors already expanded to the value heads. Each op runs the
recurrence of the mechanism it is (``fastweight.mechanisms``), written as in its paper;
``dplr_delta_rule`` and ``rwkv7`` take already-prepared DPLR factors in fla's meaning
(``S_t = (Diag(exp gk) + b a^T) S + k v^T``: fla's ``a`` is read against S) and run the core.
"""

from __future__ import annotations

import torch

from fastweight.mechanisms import get
from fastweight.reference.recurrence import dplr_recurrent


def _run(mechanism, inputs, scale, initial_state, output_final_state, cu_seqlens):
    return get(mechanism).recurrent(inputs, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def linear_attn(q, k, v, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("linear_attention", dict(q=q, k=k, v=v), scale, initial_state, output_final_state, cu_seqlens)


def retention(q, k, v, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    from fastweight.mechanisms.retnet import retnet_log_gamma
    log_gamma = retnet_log_gamma(v.shape[2], dtype=torch.float64, device=v.device)
    return _run("retnet", dict(q=q, k=k, v=v, _log_gamma=log_gamma), scale, initial_state,
                output_final_state, cu_seqlens)


def simple_gla(q, k, v, g=None, g_gamma=None, *, scale, initial_state=None, output_final_state=False,
               cu_seqlens=None, **_):
    """A scalar gate per head is GLA's vector gate, constant across the key channels."""
    B, T, H, K = q.shape
    gk = torch.zeros(B, T, H, dtype=torch.float64 if v.dtype == torch.float64 else torch.float32,
                     device=v.device)
    if g is not None:
        gk = gk + g
    if g_gamma is not None:
        gk = gk + g_gamma
    return _run("gla", dict(q=q, k=k, v=v, g=gk[..., None].expand(B, T, H, K)), scale, initial_state,
                output_final_state, cu_seqlens)


def gla(q, k, v, g, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("gla", dict(q=q, k=k, v=v, g=g), scale, initial_state, output_final_state, cu_seqlens)


def rwkv6(r, k, v, w, u, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("rwkv6", dict(q=r, k=k, v=v, w=w, _u=u), scale, initial_state, output_final_state, cu_seqlens)


def hgrn2(q, v, g, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("hgrn2", dict(q=q, v=v, g=g), scale, initial_state, output_final_state, cu_seqlens)


def delta_rule(q, k, v, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("deltanet", dict(q=q, k=k, v=v, beta=beta), scale, initial_state, output_final_state,
                cu_seqlens)


def gated_delta_rule(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False,
                     cu_seqlens=None, **_):
    return _run("gated_deltanet", dict(q=q, k=k, v=v, g=g, beta=beta), scale, initial_state,
                output_final_state, cu_seqlens)


def kda(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("kda", dict(q=q, k=k, v=v, g=g, beta=beta), scale, initial_state, output_final_state,
                cu_seqlens)


def comba(q, k, v, p, g, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("comba", dict(q=q, k=k, v=v, p=p, g=g, beta=beta), scale, initial_state,
                output_final_state, cu_seqlens)


def longhorn(q, k, v, beta, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return _run("longhorn", dict(q=q, k=k, v=v, beta=beta), scale, initial_state, output_final_state,
                cu_seqlens)


def dplr_delta_rule(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False,
                    cu_seqlens=None, **_):
    """fla's meaning: S_t = (Diag(exp gk) + b a^T) S + k v^T (fla's ``a`` is read against S)."""
    return dplr_recurrent(q, k, v, a=b, b=a, gk=gk, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def rwkv7(r, w, k, v, a, b, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """fla's chunk_rwkv7 meaning: S_t = (Diag(exp w) + b a^T) S + k v^T, o_t = S_t^T (scale r_t)."""
    return dplr_recurrent(r, k, v, a=b, b=a, gk=w, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
