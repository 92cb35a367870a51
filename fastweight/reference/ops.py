"""The public ops served by the per-token definitions (``backend="reference"``).

Same signatures as every other backend (see ``fastweight.dispatch``); inputs arrive
validated, with q/k already expanded to the value heads.
"""

from __future__ import annotations

from fastweight.mechanisms import get
from fastweight.reference.recurrence import dplr_recurrent


def gated_delta_rule(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False,
                     cu_seqlens=None, **_):
    return get("gated_deltanet").recurrent(dict(q=q, k=k, v=v, g=g, beta=beta), scale=scale,
                                           initial_state=initial_state,
                                           output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def dplr_delta_rule(q, k, v, a, b, gk, *, scale, initial_state=None, output_final_state=False,
                    cu_seqlens=None, **_):
    """fla's meaning: S_t = (Diag(exp gk) + b a^T) S + k v^T (fla's ``a`` is read against S)."""
    return dplr_recurrent(q, k, v, a=b, b=a, gk=gk, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
