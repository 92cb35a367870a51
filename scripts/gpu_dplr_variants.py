"""Session 4, RWKV-7 on the H200: variants of the DPLR kernels, each checked in bf16 against
float64 and timed at both anchor shapes.

    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py state_bv   # state passes' BV
    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py bwd_blocks [BK,BV ...]
    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py bwd [HOLD,BK,BV,WARPS ...]
    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py fwd [BK,WARPS,STAGES,WIDE ...]

state_bv (run 1): per-kernel time at both shapes, then the state passes with BV 16 / 32 / 64.
bwd_blocks (run 3): the fused backward (``dplr_bwd``) with the given (BK, BV) blocks.
bwd (run 4): the fused backward holding T, A_qk, A_ak (HOLD 1) or not, blocks, num_warps (1 stage);
the HOLD 0 option (loading them where used) was removed after that run (it never won): only 1 runs now.
fwd (run 5): the intra forward (two programs per chunk) with BK, warps, stages, the wide chunks in
their own kernel (WIDE 1) or in the main one; forward timed alone. Every variant is also checked
in fp32 with strong gates (the sub-chunk path).
Rows go to $OUT/gpu_decay_dplr.json (``fastweight.bench.gpu_decay_dplr``'s format).
"""

import sys

import torch

from fastweight.bench import gpu_decay_dplr as dd
from fastweight.kernels import dplr_bwd, dplr_intra, dplr_state


def variant(label, module, attr, value, fwd_only=False, **more):
    setattr(module, attr, value)
    for k, v in more.items():
        setattr(module, k, v)
    print(f"== {label}", flush=True)
    try:
        for K in (64, 128):
            dd.check("rwkv7", torch.bfloat16, T=200, H=3, K=K)
        dd.check("rwkv7", torch.float32, strong=True)
        for shape in ("gdn1.3b", "rwkv7paper"):
            if fwd_only:
                ms = dd.bench("rwkv7", shape, False)
                dd.record(dict(kind="time", op="rwkv7", shape=shape, variant=label, fwd_ms=ms))
                print(f"time rwkv7 {shape}: fwd {ms:.3f} ms", flush=True)
            else:
                dd.timing("rwkv7", shape)
    except Exception as e:  # a variant that fails to build is reported, not fatal
        print(f"{label} failed: {e!r}"[:400], flush=True)
    setattr(module, attr, None)
    for k in more:
        setattr(module, k, DEFAULTS[k])


DEFAULTS = dict(CONFIG=None, WIDE_KERNEL=True)


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
    elif argv[0] == "fwd":
        for spec in argv[1:]:
            bk, warps, stages, wide = (int(x) for x in spec.split(","))
            variant(f"intra forward BK {bk}, {warps} warps, {stages} stages, wide kernel {wide}", dplr_intra,
                    "FWD_OVERRIDE", (bk, (warps, stages)), fwd_only=True, WIDE_KERNEL=bool(wide))


if __name__ == "__main__":
    main(sys.argv[1:])
