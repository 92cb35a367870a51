#!/bin/bash
# Branch wip/kda-intra-solve: KDA's solve in its intra kernel with the diagonal blocks as products of powers
# (intra.SOLVE_PRODUCTS) against main's separate solve. Run from the repository root of a checkout of this branch
# on the device. Trees: m (delta.INTRA_SOLVE_DTYPES = (): main's path), pi (fused, products in fp32 "ieee"), pt
# (fused, products "tf32"), sb (fused, substitution: session 35's +4.8%). ~5 minutes.
L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; d=$T/$1/fastweight/kernels
  sed -i "s/^INTRA_SOLVE_DTYPES = ()/INTRA_SOLVE_DTYPES = $2/" $d/delta.py
  sed -i "s/^SOLVE_PRODUCTS = \"ieee\"/SOLVE_PRODUCTS = \"$3\"/" $d/intra.py
  grep -q "^INTRA_SOLVE_DTYPES = $2" $d/delta.py && grep -q "^SOLVE_PRODUCTS = \"$3\"" $d/intra.py || { echo "sed failed: $1" | tee -a $L; exit 1; }; }
tree m "()" ieee; tree pi "(torch.bfloat16,)" ieee; tree pt "(torch.bfloat16,)" tf32; tree sb "(torch.bfloat16,)" ""
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
C="kda:4,8192,16,128;kda:8,16384,64,64"
for t in m pi pt sb; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$C" --warm >/dev/null 2>&1) & done
mkdir -p $OUT/fz
(cd $T/pi && timeout 170 python -m fastweight.bench.gpu_fuzz --ops kda --dtypes bf16 --modes chunk --budget 130 --grace 30 --seed 36001 --workers 4 --out $OUT/fz > $OUT/fz.txt 2>&1) &
wait; tail -2 $OUT/fz.txt | tee -a $L
for r in 1 2; do for t in m pi pt sb; do [ $SECONDS -lt 420 ] && ot $t --cases "$C" --rep 100; done; done
ot pi --cases "kda:4,8192,16,128" --profile fwd
