#!/bin/bash
# Session 35's fourth call: the GDN backward's dk in bf16 and dg in wy_bwd without the q/k-first read (ac) against
# all three switches (g) and none (m). Run from the repository root on the device. ~3 minutes.
L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
log(){ echo "[$SECONDS] $*" | tee -a $L; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; }
sw(){ d=$T/$1/fastweight/kernels
  sed -i "s/^PARTIAL_DK_DTYPES = (torch.bfloat16,)/PARTIAL_DK_DTYPES = $2/; s/^WY_GATE_GRAD = True/WY_GATE_GRAD = $4/" $d/delta.py
  sed -i "s/^QK_FIRST = True/QK_FIRST = $3/" $d/output.py
  grep -q "^PARTIAL_DK_DTYPES = $2" $d/delta.py && grep -q "^WY_GATE_GRAD = $4" $d/delta.py && grep -q "^QK_FIRST = $3" $d/output.py \
    || { log "sed failed for $1"; exit 1; }; }
tree m; sw m "()" False False
tree g; sw g "(torch.bfloat16,)" True True
tree ac; sw ac "(torch.bfloat16,)" False True
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
CASES="gated_delta_rule:4,8192,16,128;delta_rule:8,16384,64,64"
for t in m g ac; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$CASES" --warm >/dev/null 2>&1) & done
wait; log compiled
for r in 1 2; do for t in m g ac; do [ $SECONDS -lt 200 ] && ot $t --cases "$CASES" --rep 100; done; done
log end
