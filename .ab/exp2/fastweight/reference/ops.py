"""The public ops served by the per-token definitions (``backend="reference"``), by op name.

``fastweight.reference.ops.<op>`` is the ``reference`` its mechanism file declares
(``fastweight.mechanisms.get_op(op).reference``). Same signature as every other backend (see
``fastweight.dispatch``): tensors by name, then ``scale``, ``initial_state``,
``output_final_state``, ``cu_seqlens``; inputs arrive validated, with the key-side tensors
already expanded to the value heads. Each runs the recurrence of the mechanism it is, written
as in its paper; ``dplr_delta_rule`` and ``rwkv7`` take DPLR factors in fla's meaning
(``S_t = (Diag(exp gk) + b a^T) S + k v^T``: fla's ``a`` is read against S).
"""


def __getattr__(name: str):
    from fastweight.mechanisms import OPS
    if name in OPS:
        return OPS[name].reference
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    from fastweight.mechanisms import OPS
    return sorted(OPS)
