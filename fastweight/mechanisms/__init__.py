"""The mechanism registry: one short file per mechanism (see ``base.py`` for the spec)."""

from fastweight.mechanisms.base import REGISTRY, Mechanism, Preconditioner, get, register
from fastweight.mechanisms import (  # noqa: F401  (each registers itself, in this order)
    linear_attention,
    retnet,
    mamba2,
    gla,
    rwkv6,
    hgrn2,
    deltanet,
    gated_deltanet,
    kda,
    comba,
    longhorn,
    rwkv7,
    dplr,
)

__all__ = ["REGISTRY", "Mechanism", "Preconditioner", "get", "register"]
