#!/usr/bin/env bash
# Session 4's fifth H200 call, nvidia-h200-x2: variants of the intra forward (two programs per chunk,
# wide chunks in their own kernel or not, BK / warps / stages; forward timed alone) on GPU 0 and of
# the fused backward (blocks / warps) on GPU 1, each checked in bf16 (K = 64, 128) and in fp32 with
# strong gates (scripts/gpu_dplr_variants.py). Outputs packed per lane under $OUT.
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/a "$OUT"/b
T0=$(date +%s); LIMIT=${LIMIT:-420}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(CUDA_VISIBLE_DEVICES=0 OUT="$OUT/a" python scripts/gpu_dplr_variants.py fwd ${LANE_A:?}) > "$OUT/laneA.log" 2>&1 &
A=$!
(CUDA_VISIBLE_DEVICES=1 OUT="$OUT/b" python scripts/gpu_dplr_variants.py bwd ${LANE_B:?}) > "$OUT/laneB.log" 2>&1 &
B=$!
while { kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; } && [ "$(left)" -gt 12 ]; do sleep 2; done
kill $A $B 2>/dev/null
for d in a b; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
grep "==\|^time\|FAIL\|failed" "$OUT/laneA.log" "$OUT/laneB.log"
