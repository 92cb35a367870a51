#!/usr/bin/env bash
# Session 4's third H200 call, nvidia-h200-x2, two lanes (outputs packed in one .tgz per lane under $OUT):
#   GPU 0: DPLR / RWKV-7 checks (all dtypes, varlen, strong gates, small heads), timing of RWKV-7,
#          simple_gla and GLA at the anchor shapes, RWKV-7 over T = 65536, per-kernel profile
#   GPU 1: the fused backward's K / V blocks (scripts/gpu_dplr_variants.py bwd_blocks)
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/a "$OUT"/b
T0=$(date +%s); LIMIT=${LIMIT:-560}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  CHECK_OPS=dplr_delta_rule,rwkv7 TIME_CASES=rwkv7:gdn1.3b,rwkv7:rwkv7paper,simple_gla:gdn1.3b,gla:rwkv7paper \
      OUT="$OUT/a" python -m fastweight.bench.gpu_decay_dplr check time long
  python -c "
from fastweight.bench import gpu_decay_dplr as dd
for s in ('gdn1.3b', 'rwkv7paper'):
    dd.profile('rwkv7', s, 'fused backward, 32x32 blocks')
"
) > "$OUT/laneA.log" 2>&1 &
A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  OUT="$OUT/b" python scripts/gpu_dplr_variants.py bwd_blocks ${BLOCKS:-64,64 64,32 32,64}
) > "$OUT/laneB.log" 2>&1 &
B=$!
while { kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; } && [ "$(left)" -gt 12 ]; do sleep 2; done
kill $A $B 2>/dev/null
for d in a b; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
grep -v "Warning\|warn_once" "$OUT/laneA.log" | tail -32; grep -v "Warning\|warn_once" "$OUT/laneB.log" | tail -20
