"""Exact references: the per-token definitions every fast path is checked against."""

from fastweight.reference.recurrence import (
    dplr_recurrent,
    dplr_step,
    run_recurrence,
)

__all__ = ["dplr_recurrent", "dplr_step", "run_recurrence"]
