#!/bin/bash
# Session 35's speed call: KDA's solve in its intra kernel (`is`: delta.INTRA_SOLVE_DTYPES = bf16) against main
# (`m`), its GPU fuzz, and the profiles the next steps need (GDN's fwd+bwd, KDA's forward). Run from the
# repository root on the device: `bash docs/bench/calls/s35b.sh`. ~7 minutes. Predictions: docs/bench/runs-2026-12-07-s35.md.
L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
log(){ echo "[$SECONDS] $*" | tee -a $L; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; }
tree m; tree is
sed -i "s/^INTRA_SOLVE_DTYPES = ()/INTRA_SOLVE_DTYPES = (torch.bfloat16,)/" $T/is/fastweight/kernels/delta.py
grep -q "^INTRA_SOLVE_DTYPES = (torch.bfloat16,)" $T/is/fastweight/kernels/delta.py || { log "sed failed for is"; exit 1; }
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
KDA="kda:4,8192,16,128"; KDA64="kda:8,16384,64,64"; GDN="gated_delta_rule:4,8192,16,128"
for t in m is; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$KDA;$KDA64;$GDN" --warm >/dev/null 2>&1) & done
mkdir -p $OUT/fz
(cd $T/is && timeout 170 python -m fastweight.bench.gpu_fuzz --ops kda --dtypes bf16 --modes chunk --budget 130 --grace 30 --seed 35001 --workers 4 --out $OUT/fz > $OUT/fz.txt 2>&1) &
wait; log "compiled"; tail -2 $OUT/fz.txt | tee -a $L
for r in 1 2; do [ $SECONDS -lt 400 ] || break
  for t in m is; do [ $SECONDS -lt 430 ] && ot $t --cases "$KDA;$KDA64" --rep 100; done
  if [ $r = 1 ]; then
    ot is --cases "$KDA" --profile fwd
    ot m --cases "$GDN" --profile fb
  fi
done
log end
