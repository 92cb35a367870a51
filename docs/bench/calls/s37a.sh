#!/bin/bash
# Next call (issue 17): KDA's solve in its intra kernel with product-form diagonal blocks (`pi`) against main's stages
# (`m`) in ONE call, at K = 64 where session 36 measured it 7.6% faster than session 35's main (across calls) and at
# K = 128 where it lost 31%. Needs the branch's tree as _kda/ (not committed): mkdir _kda && git archive
# wip/kda-intra-solve | tar -x -C _kda. Results: $OUT/log.txt. ~5 minutes.
cd _kda; L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
set_(){ sed -i "s/^$2 = .*/$2 = $3/" $1; grep -q "^$2 = $3\$" $1 || { echo "sed failed: $1 $2" | tee -a $L; exit 1; }; }
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; set_ $T/$1/fastweight/kernels/delta.py INTRA_SOLVE_DTYPES "$2"; }
tree m "()"; tree pi "(torch.bfloat16,)"
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
K="kda:8,16384,64,64;kda:4,8192,16,128;kda:8,2048,16,64"
for t in m pi; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$K" --warm >/dev/null 2>&1) & done
(cd $T/pi && timeout 200 python -m fastweight.bench.gpu_fuzz --ops kda --dtypes bf16 --modes chunk --budget 160 --grace 30 --seed 37001 --workers 4 --out /tmp/fz > /tmp/fz.txt 2>&1) &
wait; tail -2 /tmp/fz.txt | tee -a $L
for r in 1 2 3; do for t in m pi; do [ $SECONDS -lt ${G:-450} ] && ot $t --cases "$K" --rep 100; done; done
[ $SECONDS -lt $((${G:-450} + 60)) ] && ot pi --cases "kda:8,16384,64,64" --profile fwd
[ $SECONDS -lt $((${G:-450} + 100)) ] && ot m --cases "kda:8,16384,64,64" --profile fwd
