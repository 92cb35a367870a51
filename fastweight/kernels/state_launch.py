"""The state passes' launch table (``state.py``): blocks, warps and stages by transition and shape."""

from __future__ import annotations

import triton

from fastweight.kernels.common import dot_block

TRANSITIONS = {"decay": 0, "delta": 1, "dplr": 2}


def launch_config(transition: str, K: int, V: int, itemsize: int, backward: bool = False,
                  per_channel: bool = False, block_v: int | None = None,
                  inference: bool = False) -> tuple[int, int, int, int]:
    """(BK, BV, num_warps, num_stages) of a state pass: the one table, by transition and shape.

    The value block is 64 (a smaller V padded, masked) for DECAY and DELTA: Triton 3.6 on the
    H200 addresses shared memory out of range in 16-bit dots over narrower blocks (``common.
    dot_block``). DECAY tiles K by 64 (8 warps, 3 stages: the fastest of `python -m
    fastweight.bench.gpu_sweep`). DELTA holds all of K: 8 warps for K = 256 (the [K, BV] fp32
    state in registers) and for the per-channel (KDA) backward at K = 128, else 4; two stages of
    prefetch while a chunk's q, k, w tiles fit twice in the H200's 227 KiB of shared memory (up to
    256 bytes a row), else one; without a per-channel gate in 16 bits, the backward at K = 128 8 warps
    and 3 stages (GDN: -4% forward+backward), the forward at K <= 64 3 stages (DeltaNet's inference
    forward -14% on the H100), at K = 128 only for ``inference`` (no h kept, the read formed in the
    pass, a scalar gate: GDN -6.5% on the H100; the training forward lost 6% with them). DPLR holds
    all of K and narrows BV
    to a small V (16 at least); 4 warps 2 stages up to K = 64, else 8 warps and 2 stages (1 at K =
    256; the forward with its output fused 2 only while a key row fits 256 bytes: fp32 K = 128 would
    need 262 KB of shared memory): the fastest for RWKV-7 (the fused forward at 16-bit K = 128 spilled
    400 B a thread at 1 stage and was 7% slower on the H100). Measurements: docs/bench/delta.md,
    decay_dplr.md."""
    if transition == "decay":
        return 64, dot_block(block_v or 64), 8, 3
    if transition == "delta":
        BK = triton.next_power_of_2(K)
        if backward and BK == 128 and itemsize == 2 and not per_channel:
            return BK, block_v or 64, 8, 3
        if not backward and (BK <= 64 or (BK == 128 and inference)) and itemsize == 2 and not per_channel:
            return BK, block_v or 64, 4, 3
        warps = 8 if K > 128 or (backward and per_channel and K == 128) else 4
        return BK, block_v or 64, warps, 2 if BK * itemsize <= 256 else 1
    if transition == "dplr":
        BK = max(16, triton.next_power_of_2(K))
        BV = min(block_v or 64, max(16, triton.next_power_of_2(V)))
        if BK <= 64:
            return BK, BV, 4, 2
        if backward:
            return BK, BV, 8, 2 if BK <= 128 else 1
        return BK, BV, 8, 2 if BK * itemsize <= 256 else 1
    raise ValueError(f"transition must be one of {tuple(TRANSITIONS)}, got {transition!r}")
