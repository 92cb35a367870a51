#!/usr/bin/env bash
# Session 4's fourth H200 call, nvidia-h200-x2: the fused backward's variants (hold T / A_qk / A_ak
# in registers or not, K / V blocks, warps), each checked in bf16 and timed at both anchor shapes,
# half on each GPU (scripts/gpu_dplr_variants.py bwd). Outputs packed per lane under $OUT.
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/a "$OUT"/b
T0=$(date +%s); LIMIT=${LIMIT:-500}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(CUDA_VISIBLE_DEVICES=0 OUT="$OUT/a" python scripts/gpu_dplr_variants.py bwd ${LANE_A:-1,64,64,8 1,32,64,8 1,32,64,4 1,32,32,8}) \
    > "$OUT/laneA.log" 2>&1 &
A=$!
(CUDA_VISIBLE_DEVICES=1 OUT="$OUT/b" python scripts/gpu_dplr_variants.py bwd ${LANE_B:-0,64,64,8 0,32,64,4 0,32,64,8 1,64,64,4}) \
    > "$OUT/laneB.log" 2>&1 &
B=$!
while { kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; } && [ "$(left)" -gt 12 ]; do sleep 2; done
kill $A $B 2>/dev/null
for d in a b; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
grep "==\|^time\|FAIL\|failed" "$OUT/laneA.log" "$OUT/laneB.log"
