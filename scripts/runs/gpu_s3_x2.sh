#!/usr/bin/env bash
# Session 3's second H200 call, nvidia-h200-x2, two lanes (each packs its outputs in one .tgz under $OUT):
#   GPU 0: the full evaluation suite and its plots (scripts/gpu_eval_full.sh), and beside it the
#          small-shape checks of the padded-block kernels (scripts/gpu_diag.sh, no timing)
#   GPU 1: launch-configuration sweeps (fastweight.bench.gpu_sweep) of GDN, GLA, simple_gla, KDA
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 MPLBACKEND=Agg PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/eval "$OUT"/diag "$OUT"/sweep
T0=$(date +%s); LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  OUT="$OUT/eval" EVAL_LIMIT=$(( LIMIT - 50 )) bash scripts/gpu_eval_full.sh
) > "$OUT/laneA.log" 2>&1 &
A=$!
(
  export CUDA_VISIBLE_DEVICES=0
  OUT="$OUT/diag" M2_LIMIT=1 P=6 bash scripts/gpu_diag.sh
) > "$OUT/laneD.log" 2>&1 &
D=$!
(
  export CUDA_VISIBLE_DEVICES=1
  for job in "gated_delta_rule gdn1.3b 140" "gla rwkv7paper 140" "simple_gla gdn1.3b 100" "kda gdn1.3b 110"; do
    set -- $job
    echo "== sweep $1 $2 ($(left) s left)"
    timeout $(( $3 + 40 )) python -m fastweight.bench.gpu_sweep $1 $2 --warps 4,8 --stages 1,2,3 --budget $3 \
        --out "$OUT/sweep"
  done
  echo "== lane B done $(left) s left"
) > "$OUT/laneB.log" 2>&1 &
B=$!
wait $B $D
sleep 1; while kill -0 $A 2>/dev/null && [ "$(left)" -gt 12 ]; do sleep 2; done
kill $A 2>/dev/null
for d in eval diag sweep; do tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"; done
tail -4 "$OUT/laneA.log"; grep "RESULT\|wall\|cases done" "$OUT/laneD.log"; grep -v Warning "$OUT/laneB.log" | tail -45
