#!/usr/bin/env bash
# Session 4's last H200 call, nvidia-h200-x2 (outputs packed per lane under $OUT):
#   GPU 0: the DPLR / RWKV-7 checks (all dtypes, varlen, strong gates, small heads) and RWKV-7 over
#          T = 65536 with the final configuration, then RWKV-7 timed at both anchor shapes
#   GPU 1: simple_gla and GLA timed at their anchor shapes; the intra forward with the wide chunks
#          inside the main kernel (the other choice) timed; per-kernel profile of RWKV-7
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/a "$OUT"/b
T0=$(date +%s); LIMIT=${LIMIT:-330}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  CHECK_OPS=dplr_delta_rule,rwkv7 TIME_CASES=rwkv7:gdn1.3b,rwkv7:rwkv7paper OUT="$OUT/a" \
      python -m fastweight.bench.gpu_decay_dplr check long time
) > "$OUT/laneA.log" 2>&1 &
A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  TIME_CASES=simple_gla:gdn1.3b,gla:rwkv7paper OUT="$OUT/b" python -m fastweight.bench.gpu_decay_dplr time
  mv "$OUT/b/gpu_decay_dplr.json" "$OUT/b/time_decay.json"
  OUT="$OUT/b" python scripts/gpu_dplr_variants.py fwd 32,4,2,0
  mv "$OUT/b/gpu_decay_dplr.json" "$OUT/b/fwd_variant.json"
  OUT="$OUT/b" python -c "
from fastweight.bench import gpu_decay_dplr as dd
for s in ('gdn1.3b', 'rwkv7paper'):
    dd.profile('rwkv7', s, 'session 4 final')
"
) > "$OUT/laneB.log" 2>&1 &
B=$!
while { kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; } && [ "$(left)" -gt 10 ]; do sleep 2; done
kill $A $B 2>/dev/null
for d in a b; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
grep -v "Warning\|warn_once" "$OUT/laneA.log" | grep "check\|time\|long\||"; grep -v "Warning\|warn_once" "$OUT/laneB.log" | grep "==\|time\|variant\|FAIL\|failed\|check"
