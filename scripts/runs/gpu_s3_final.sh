#!/usr/bin/env bash
# Session 3's last H200 call (nvidia-h200-x2): checks and timings after the padded blocks and the
# swept launch configurations. Outputs packed per lane under $OUT.
#   GPU 0: decay/DPLR checks (bf16/fp16/fp32, varlen, small heads) and timings; the Mamba-2 model check
#   GPU 1: delta-family checks (bf16, incl. K = 256 and small heads) and timings with peak memory
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"/decay "$OUT"/delta
LIMIT=${LIMIT:-420}
(export CUDA_VISIBLE_DEVICES=0
 OUT="$OUT/decay" CHECK_OPS=simple_gla,gla,retention,rwkv7 TIME_CASES=simple_gla:gdn1.3b,gla:rwkv7paper,rwkv7:gdn1.3b \
   timeout $(( LIMIT - 100 )) python -m fastweight.bench.gpu_decay_dplr check time
 timeout 90 python scripts/gpu_mamba2.py full) > "$OUT/gpu0.log" 2>&1 &
(export CUDA_VISIBLE_DEVICES=1
 timeout $(( LIMIT - 10 )) python -m fastweight.bench.gpu_delta --quick --ops gated_delta_rule,kda,delta_rule --stages none \
   --heads 256x256,64x16,16x64 --heads-ops gated_delta_rule,delta_rule,kda --budget $(( LIMIT - 60 )) --out "$OUT/delta") \
   > "$OUT/gpu1.log" 2>&1 &
wait
tar czf "$OUT/lanes.tgz" -C "$OUT" decay delta && rm -rf "${OUT:?}/decay" "${OUT:?}/delta"
grep -v Warning "$OUT/gpu0.log" | grep -v "^  " | tail -45; echo ====; grep -v Warning "$OUT/gpu1.log" | tail -40
