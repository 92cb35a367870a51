#!/usr/bin/env bash
# Session 3 diagnostics on the device (one process per case, 6 at a time; logs packed in $OUT):
#   bash scripts/gpu_diag.sh        cases: scripts/gpu_diag_cases.txt (one gpu_stages.py argument list a line)
export PYTHONPATH=. PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0
OUT=${OUT:-runs/diag}; L=/tmp/diag; mkdir -p "$OUT" $L
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null; command -v compute-sanitizer
start=$(date +%s)
(timeout ${M2_LIMIT:-200} python scripts/gpu_mamba2.py full > $L/mamba2.log 2>&1; echo "mamba2 rc $?" >> $L/mamba2.log) &
i=0
while read -r line; do
  [ -z "$line" ] && continue; i=$((i+1))
  echo "CUDA_LAUNCH_BLOCKING=1 timeout 120 python scripts/gpu_stages.py $line > $L/case$i.log 2>&1"
done < "${CASES:-scripts/gpu_diag_cases.txt}" | xargs -P ${P:-5} -I{} bash -c "{}"
echo "cases done: $(( $(date +%s) - start )) s"
grep -h "^RESULT" $L/case*.log | sort
if [ -n "$SANITIZE" ]; then
  timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python scripts/gpu_stages.py $SANITIZE > $L/sanitizer.log 2>&1
  grep -m 30 -i "invalid\|error\|at 0x\|in .*kernel\|RESULT" $L/sanitizer.log
fi
wait
cat $L/mamba2.log | grep -v Warning | tail -40
echo "wall: $(( $(date +%s) - start )) s"
tar czf "$OUT/diag_logs.tgz" -C /tmp diag
