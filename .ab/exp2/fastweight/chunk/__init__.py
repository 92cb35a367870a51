"""Pure PyTorch chunkwise algorithms (the readable spec of the kernels; the fast path on CPU).

Three generic algorithms: ``decay.decay_chunk`` (the decay family), ``delta.delta_chunk`` (the
delta family through the UT transform), ``dplr.dplr_chunk`` (generic DPLR); solve_tril.py: the
unit-lower solve; common.py: the shared stages (varlen layout, decayed intra-chunk scores, state
passing). Each op's mechanism file maps its arguments onto one of them, and
``fastweight.chunk.chunk_<op>`` is that map (``fastweight.mechanisms.get_op(op).torch.fn``), with
the dispatch signature (``fastweight.dispatch``).
"""
from fastweight.chunk.decay import decay_chunk  # noqa: F401
from fastweight.chunk.delta import delta_chunk  # noqa: F401
from fastweight.chunk.solve_tril import solve_unit_lower  # noqa: F401
from fastweight.chunk.dplr import dplr_chunk  # noqa: F401
from fastweight.chunk.parallel import attention_map, gated_delta_attention_map  # noqa: F401


def __getattr__(name: str):
    from fastweight.mechanisms import OPS
    op = OPS.get(name[len("chunk_"):]) if name.startswith("chunk_") else None
    if op is not None and op.torch is not None:
        return op.torch.fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
