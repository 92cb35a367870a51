"""The mechanism registry: one short file per mechanism (see ``base.py`` for the spec), and the
ops and mixers those files declare (``OPS``, ``MIXERS``: what every list of ops or mixers reads)."""

from fastweight.mechanisms.base import (MIXERS, OPS, REGISTRY, Impl, Mechanism, Mixer, Op, Preconditioner, get,
                                        get_op, register)
from fastweight.mechanisms import (  # noqa: F401  (each registers itself, in this order)
    linear_attention,
    retnet,
    mamba2,
    gla,
    rwkv6,
    hgrn2,
    deltanet,
    gated_deltanet,
    gated_deltaproduct,
    kda,
    comba,
    longhorn,
    rwkv7,
    dplr,
)

__all__ = ["MIXERS", "OPS", "REGISTRY", "Impl", "Mechanism", "Mixer", "Op", "Preconditioner", "get", "get_op",
           "register"]
