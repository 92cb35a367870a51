#!/usr/bin/env bash
# Session 4's second H200 call, nvidia-h200-x2, two lanes (outputs packed in one .tgz per lane under $OUT):
#   GPU 0: DPLR / RWKV-7 checks with the fused per-chunk backward (bf16/fp16/fp32, varlen, strong gates:
#          the sub-chunk path, small heads), timing at both anchor shapes, per-kernel profile, T = 65536
#   GPU 1: sweeps of the fused backward and the state passes (BV 64) at both shapes, then simple_gla
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/a "$OUT"/sweep
T0=$(date +%s); LIMIT=${LIMIT:-560}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  CHECK_OPS=dplr_delta_rule,rwkv7 TIME_CASES=rwkv7:gdn1.3b,rwkv7:rwkv7paper OUT="$OUT/a" \
      python -m fastweight.bench.gpu_decay_dplr check time long
  python -c "
from fastweight.bench import gpu_decay_dplr as dd
for s in ('gdn1.3b', 'rwkv7paper'):
    dd.profile('rwkv7', s, 'fused backward')
"
) > "$OUT/laneA.log" 2>&1 &
A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  K=dplr_bwd.dplr_bwd_kernel,dplr_state.dplr_state_fwd_kernel,dplr_state.dplr_state_bwd_kernel
  for job in "rwkv7 gdn1.3b 110 $K" "rwkv7 rwkv7paper 150 $K" "simple_gla gdn1.3b 120 "; do
    set -- $job
    echo "== sweep $1 $2 ($(left) s left)"
    timeout $(( $3 + 60 )) python -m fastweight.bench.gpu_sweep $1 $2 --warps 4,8 --stages 1,2,3 --budget $3 \
        --out "$OUT/sweep" ${4:+--kernels $4}
  done
  echo "== lane B done $(left) s left"
) > "$OUT/laneB.log" 2>&1 &
B=$!
while { kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; } && [ "$(left)" -gt 12 ]; do sleep 2; done
kill $A $B 2>/dev/null
for d in a sweep; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
grep -v Warning "$OUT/laneA.log" | tail -30; grep -v Warning "$OUT/laneB.log" | tail -30
