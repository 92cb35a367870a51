"""The mechanism registry: one short file per mechanism (see ``base.py`` for the spec)."""

from fastweight.mechanisms.base import REGISTRY, Mechanism, get, register
from fastweight.mechanisms import gated_deltanet  # noqa: F401  (registers itself)

__all__ = ["REGISTRY", "Mechanism", "get", "register"]
