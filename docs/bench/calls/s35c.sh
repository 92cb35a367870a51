#!/bin/bash
# Session 35's third call: the GDN backward's three switches (delta.PARTIAL_DK_DTYPES: dk's output-stage part in
# bf16 (A); output.QK_FIRST: q, k read before output_bwd's V loop (B); delta.WY_GATE_GRAD: dg's reverse cumsum in
# wy_bwd (C)) on and off, their GPU fuzz, and the side by side with fla 0.6.0 (carry [".whl", ".ab"]: fla's
# autotuning choices for this card). Run from the repository root on the device. ~6 minutes.
L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
log(){ echo "[$SECONDS] $*" | tee -a $L; }
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card" | tee -a $L
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; }
sw(){ d=$T/$1/fastweight/kernels
  sed -i "s/^PARTIAL_DK_DTYPES = (torch.bfloat16,)/PARTIAL_DK_DTYPES = $2/; s/^WY_GATE_GRAD = True/WY_GATE_GRAD = $4/" $d/delta.py
  sed -i "s/^QK_FIRST = True/QK_FIRST = $3/" $d/output.py
  grep -q "^PARTIAL_DK_DTYPES = $2" $d/delta.py && grep -q "^WY_GATE_GRAD = $4" $d/delta.py && grep -q "^QK_FIRST = $3" $d/output.py \
    || { log "sed failed for $1"; exit 1; }; }
tree m; sw m "()" False False
tree g; sw g "(torch.bfloat16,)" True True
tree bc; sw bc "()" True True
tree c; sw c "()" False True
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
CASES="gated_delta_rule:4,8192,16,128;delta_rule:8,16384,64,64"
for t in m g bc c; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$CASES" --warm >/dev/null 2>&1) & done
mkdir -p $OUT/fz
(cd $T/g && timeout 200 python -m fastweight.bench.gpu_fuzz --ops gated_delta_rule,delta_rule,comba,longhorn --dtypes bf16,fp16 --modes chunk --budget 160 --grace 30 --seed 35002 --workers 4 --out $OUT/fz > $OUT/fz.txt 2>&1) &
wait; log "compiled"; tail -3 $OUT/fz.txt | tee -a $L
for r in 1 2; do [ $SECONDS -lt 380 ] || break
  for t in m g bc c; do [ $SECONDS -lt 400 ] && ot $t --cases "$CASES" --rep 100; done
  [ $r = 1 ] && ot g --cases "gated_delta_rule:4,8192,16,128" --profile fb
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
mkdir -p /tmp/tcs; [ -f .ab/atune.tgz ] && [ "$(cat .ab/atune.card 2>/dev/null)" = "$card" ] && tar -xzf .ab/atune.tgz -C /tmp/tcs && log "fla choices restored"
left=$((560 - SECONDS)); [ $left -gt 60 ] || exit
(cd $T/g && PYTHONPATH=$T/g:/tmp/site TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcs timeout $left python -m fastweight.bench.side_by_side \
  --ops gated_delta_rule --shapes gdn1.3b --rep 100 --out $OUT 2>&1 | grep -v -i warn | tail -8 | tee -a $L)
log end
