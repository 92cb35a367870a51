#!/usr/bin/env bash
# Session 2's last H200 call, on two GPUs of one host (nvidia-h200-x2), two lanes in parallel:
#   GPU 0: the full evaluation suite and its plots (scripts/gpu_eval_full.sh)
#   GPU 1: delta-family checks/timings, the language-model bench, decay/DPLR checks/timings
# Each lane's outputs are packed into one .tgz under $OUT (the device returns at most 8 files).
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 MPLBACKEND=Agg
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/eval "$OUT"/delta "$OUT"/model "$OUT"/decay
T0=$(date +%s); LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  OUT="$OUT/eval" EVAL_LIMIT=$(( LIMIT - 60 )) bash scripts/gpu_eval_full.sh
) > "$OUT/laneA.log" 2>&1 &
A=$!
(
  export CUDA_VISIBLE_DEVICES=1
  echo "== delta $(left) s left"
  timeout 230 python -m fastweight.bench.gpu_delta --quick --ops gated_delta_rule,kda --stages none \
      --heads 256x512,128x16,64x16,16x16 --varlen-bv32 gated_delta_rule,delta_rule --budget 200 --out "$OUT/delta"
  echo "== model $(left) s left"
  timeout 240 python -m fastweight.bench.gpu_model --out "$OUT/model" --budget 170
  echo "== decay $(left) s left"
  OUT="$OUT/decay" CHECK_OPS=gla,rwkv7 TIME_CASES=gla:rwkv7paper,rwkv7:gdn1.3b \
      timeout $(( $(left) - 15 )) python -m fastweight.bench.gpu_decay_dplr check time
  echo "== lane B done $(left) s left"
) > "$OUT/laneB.log" 2>&1 &
B=$!
wait $B
# the eval lane gets what is left
sleep 1; while kill -0 $A 2>/dev/null && [ "$(left)" -gt 12 ]; do sleep 2; done
kill $A 2>/dev/null
for d in eval delta model decay; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
tail -5 "$OUT/laneA.log"; grep -v Warning "$OUT/laneB.log" | tail -60
