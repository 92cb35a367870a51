"""Session 4, RWKV-7 on the H200: variants of the DPLR kernels, each checked in bf16 against
float64 and timed at both anchor shapes.

    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py state_bv   # state passes' BV
    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py bwd_blocks [BK,BV ...]
    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py bwd [HOLD,BK,BV,WARPS ...]

state_bv (run 1): per-kernel time at both shapes, then the state passes with BV 16 / 32 / 64.
bwd_blocks (run 3): the fused backward (``dplr_bwd``) with the given (BK, BV) blocks.
bwd (run 4): the fused backward holding T, A_qk, A_ak (HOLD 1) or not, blocks, num_warps (1 stage);
the HOLD 0 option (loading them where used) was removed after that run (it never won): only 1 runs now.
Rows go to $OUT/gpu_decay_dplr.json (``fastweight.bench.gpu_decay_dplr``'s format).
"""

import sys

import torch

from fastweight.bench import gpu_decay_dplr as dd
from fastweight.kernels import dplr_bwd, dplr_state


def variant(label, module, attr, value, **more):
    setattr(module, attr, value)
    for k, v in more.items():
        setattr(module, k, v)
    print(f"== {label}", flush=True)
    try:
        for K in (64, 128):
            dd.check("rwkv7", torch.bfloat16, T=200, H=3, K=K)
        for shape in ("gdn1.3b", "rwkv7paper"):
            dd.timing("rwkv7", shape)
    except Exception as e:  # a variant that fails to build is reported, not fatal
        print(f"{label} failed: {e!r}"[:400], flush=True)
    setattr(module, attr, None)
    for k in more:
        setattr(module, k, DEFAULTS[k])


DEFAULTS = dict(CONFIG=None)


def main(argv):
    torch.manual_seed(0)
    if argv[0] == "state_bv":
        for shape in ("gdn1.3b", "rwkv7paper"):
            dd.profile("rwkv7", shape, "per-chunk intra kernels")
        for bv in (16, 32, 64):
            variant(f"state passes with BV = {bv}", dplr_state, "BLOCK_V", bv)
    elif argv[0] == "bwd_blocks":
        for spec in argv[1:]:
            bk, bv = (int(x) for x in spec.split(","))
            variant(f"fused backward with BK, BV = {bk}, {bv}", dplr_bwd, "BLOCKS", (bk, bv))
    elif argv[0] == "bwd":
        for spec in argv[1:]:
            hold, bk, bv, warps = (int(x) for x in spec.split(","))
            assert hold == 1, "HOLD 0 was removed after run 4"
            variant(f"fused backward HOLD {hold}, BK, BV = {bk}, {bv}, {warps} warps", dplr_bwd, "BLOCKS", (bk, bv),
                    CONFIG=(warps, 1))


if __name__ == "__main__":
    main(sys.argv[1:])
