"""Session 4, RWKV-7 on the H200: where its time goes now (per kernel, both anchor shapes) and
the state passes' V block (16 / 32 / 64) checked in bf16 against float64 and timed.

    OUT=dir FASTWEIGHT_VALUE_CHECKS=0 python scripts/gpu_dplr_variants.py

Rows go to $OUT/gpu_decay_dplr.json (``fastweight.bench.gpu_decay_dplr``'s format).
"""

import torch

from fastweight.bench import gpu_decay_dplr as dd
from fastweight.kernels import dplr_state


def main():
    torch.manual_seed(0)
    for shape in ("gdn1.3b", "rwkv7paper"):
        dd.profile("rwkv7", shape, "per-chunk intra kernels")
    for bv in (16, 32, 64):
        dplr_state.BLOCK_V = bv
        print(f"== state passes with BV = {bv}", flush=True)
        try:
            for K in (64, 128):
                dd.check("rwkv7", torch.bfloat16, T=200, H=3, K=K)
            dd.check("rwkv7", torch.float32, T=200, H=3, K=128)
            for shape in ("gdn1.3b", "rwkv7paper"):
                dd.timing("rwkv7", shape)
        except Exception as e:  # a block that fails to build is reported, not fatal
            print(f"BV={bv} failed: {e!r}"[:400], flush=True)
    dplr_state.BLOCK_V = None


if __name__ == "__main__":
    main()
