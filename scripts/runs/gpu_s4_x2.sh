#!/usr/bin/env bash
# Session 4's first H200 call, nvidia-h200-x2, two lanes (outputs packed in one .tgz per lane under $OUT):
#   GPU 0: the DPLR / RWKV-7 checks (bf16/fp16/fp32, varlen, strong gates, small heads) with the
#          per-chunk intra kernels, then scripts/gpu_dplr_variants.py (per-kernel time, state BV)
#   GPU 1: launch-configuration sweeps of RWKV-7 at both anchor shapes
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/a "$OUT"/sweep
T0=$(date +%s); LIMIT=${LIMIT:-560}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  CHECK_OPS=dplr_delta_rule,rwkv7 OUT="$OUT/a" python -m fastweight.bench.gpu_decay_dplr check
  mv "$OUT/a/gpu_decay_dplr.json" "$OUT/a/checks.json"
  OUT="$OUT/a" python scripts/gpu_dplr_variants.py
) > "$OUT/laneA.log" 2>&1 &
A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  for job in "rwkv7 gdn1.3b ${SWEEP1:-200}" "rwkv7 rwkv7paper ${SWEEP2:-200}"; do
    set -- $job
    echo "== sweep $1 $2 ($(left) s left)"
    timeout $(( $3 + 60 )) python -m fastweight.bench.gpu_sweep $1 $2 --warps 4,8 --stages 1,2,3 --budget $3 \
        --out "$OUT/sweep"
  done
  echo "== lane B done $(left) s left"
) > "$OUT/laneB.log" 2>&1 &
B=$!
while { kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; } && [ "$(left)" -gt 12 ]; do sleep 2; done
kill $A $B 2>/dev/null
for d in a sweep; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
grep -v Warning "$OUT/laneA.log" | tail -40; grep -v Warning "$OUT/laneB.log" | tail -40
