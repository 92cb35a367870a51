"""Public functional API, fla's names and arguments.

Every op returns ``(o, final_state_or_None)``. Layout: q, k (and gates per key channel)
``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads); scalar
gates and beta ``[B, T, HV]``; states ``[N, HV, K, V]`` in float32 (float64 for float64
inputs); o in the dtype of v. Gates are log decays
(``g = log alpha <= 0``). ``scale`` defaults to ``K ** -0.5`` (``1.0`` for RWKV-7, as fla).
``initial_state`` ``[N, HV, K, V]`` starts each sequence; ``output_final_state`` returns the
state after the last token. ``cu_seqlens`` (int64 or int32, ``[N+1]``, B must be 1) packs N sequences
along T as in flash-attn. ``backend`` picks the implementation (``"triton"``, ``"torch"``,
``"reference"``; None = best for the device; float64 inputs take the PyTorch chunk path on every
device, exact in float64, and ``"triton"`` refuses them). Every argument is validated here
(``fastweight.checks``) before any kernel runs; the checks that read tensor values (NaN, gate
sign, beta's range) run by default for CPU tensors only, so a default CUDA call syncs only to read
``cu_seqlens`` (``FASTWEIGHT_VALUE_CHECKS=1`` turns them on everywhere). ``allow_neg_eigval`` (delta
family): beta may lie in [0, 2] instead of [0, 1], so the transition's eigenvalue along k, 1 - beta,
may be negative.
"""

from __future__ import annotations

from fastweight import mechanisms
from fastweight.ops.decay import *  # noqa: F401,F403  (each family module's __all__: its public functions)
from fastweight.ops.decay import _normalize_output  # noqa: F401  (context parallelism divides by it)
from fastweight.ops.delta import *  # noqa: F401,F403
from fastweight.ops.dplr import *  # noqa: F401,F403

OPS = tuple(mechanisms.OPS)   # every op above, in the registry's order
