#!/usr/bin/env bash
# One H200 run of the full evaluation suite (issue 7) and its plots; results land in $OUT.
#   bash scripts/gpu_eval_full.sh       (on the device machine, from the repo root)
set -o pipefail
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 MPLBACKEND=Agg
OUT=${OUT:-runs/gpu}; R=${RUNS:-/tmp/full}; mkdir -p "$OUT"
fw() { python -m fastweight.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
timeout "${EVAL_LIMIT:-540}" python -m fastweight.cli eval --full --out "$R" 2>&1 | tee "$OUT/eval_full.log"
echo "eval wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/eval_full.log"
cp "$R/table.md" "$R/suite.json" "$OUT/" 2>/dev/null
fw plot niah-length --suite "$R/suite.json" --out "$OUT/full_niah_length.png"
fw plot attention --checkpoint "$R/mqar-gdn/checkpoint.pt" --out "$OUT/full_attention_mqar_gdn.png"
fw plot trained-spectra --checkpoint "$R/parity-deltanet-neg/checkpoint.pt" --out "$OUT/full_spectra_parity_deltanet_neg.png"
fw plot state-norm --mechanisms rwkv7,rwkv6,gla --length 4096 --out "$OUT/full_state_norm.png"
tar czf "$OUT/runs.tgz" --exclude='*.pt' -C "$(dirname "$R")" "$(basename "$R")"
for m in deltanet gdn; do  # the S-NIAH-1 lookup: the last tokens read the needle's columns
  fw plot attention --checkpoint "$R/niah-$m/checkpoint.pt" --out "$OUT/full_attention_niah_$m.png"
done
ls -la "$OUT"
