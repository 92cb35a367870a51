#!/usr/bin/env bash
# Launch-configuration sweeps on two GPUs (nvidia-h200-x2), then the fixed small-head case.
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
sweep() { timeout $(( $3 + 45 )) python -m fastweight.bench.gpu_sweep $1 $2 --warps 4,8 --stages 1,2,3 --budget $3 --out "$OUT"; }
(export CUDA_VISIBLE_DEVICES=0; sweep gated_delta_rule gdn1.3b 150; sweep simple_gla gdn1.3b 90
 CUDA_LAUNCH_BLOCKING=1 python scripts/gpu_stages.py delta_rule 16 64 | grep RESULT) > "$OUT/gpu0.log" 2>&1 &
(export CUDA_VISIBLE_DEVICES=1; sweep gla rwkv7paper 140; sweep kda gdn1.3b 100) > "$OUT/gpu1.log" 2>&1 &
wait
grep -v Warning "$OUT/gpu0.log" "$OUT/gpu1.log" | cut -c1-400
