"""Triton kernels, by stage (cumsum, intra-chunk, solve, WY, state, output) and family (``decay*``,
the delta family unprefixed, ``dplr*``), with one generic fused recurrent kernel; the generic
entry points are ``decay.chunk_decay``, ``delta.chunk_delta``, ``dplr.chunk_dplr`` and
``fused_recurrent.fused_recurrent``. Each op's mechanism file maps its arguments onto them. Outside
the registry's ops: the layers' short convolution (``conv``), norms, SwiGLU, rotary, and fla's HGRN-1
scan (``hgrn``: a state of D floats, nothing to chunk).

``fastweight.kernels.chunk_<op>`` / ``fused_recurrent_<op>`` is that op's Triton implementation
(``fastweight.mechanisms.get_op(op).triton_chunk.fn``), for callers that skip ``fastweight.ops``'
validation and dispatch (tests, benchmarks).
"""


def __getattr__(name: str):
    from fastweight.mechanisms import OPS
    for mode in ("chunk", "fused_recurrent"):
        op = OPS.get(name[len(mode) + 1:]) if name.startswith(mode + "_") else None
        if op is not None:
            impl = op.triton_chunk if mode == "chunk" else op.triton_fused_recurrent
            if impl is not None:
                return impl.fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
