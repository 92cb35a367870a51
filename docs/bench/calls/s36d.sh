#!/bin/bash
# Session 36: the branch wip/kda-intra-solve's KDA and DPLR variants (kda_products.sh, dplr_products.sh) in one call,
# fewer trees: m (main's paths), pi, w4 (KDA), r4w, r8w (RWKV-7). The branch's tree travels as _kda/. Results:
# $OUT/log.txt. G (default 440): no timing starts after G seconds; FB (100): the fuzz's budget.
cd _kda; L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
set_(){ sed -i "s/^$2 = .*/$2 = $3/" $1; grep -q "^$2 = $3\$" $1 || { echo "sed failed: $1 $2" | tee -a $L; exit 1; }; }
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; d=$T/$1/fastweight/kernels
  set_ $d/delta.py INTRA_SOLVE_DTYPES "$2"; set_ $d/intra.py SOLVE_PRODUCTS "\"$3\""
  set_ $d/delta.py SOLVE_WU_KDA "$4"; set_ $d/delta.py SOLVE_WU_KDA_WARPS "$5"; set_ $d/delta.py SOLVE_WU_KDA_PRODUCTS "\"$6\""
  set_ $d/dplr_wy.py SOLVE_WY_CONFIG "$7"; set_ $d/dplr_wy.py SOLVE_WY_PRODUCTS "\"$8\""; }
tree m "()" ieee False 1 "" "(1, 32, 32)" ""
tree pi "(torch.bfloat16,)" ieee False 1 "" "(1, 32, 32)" ""
tree w4 "()" ieee True 4 ieee "(1, 32, 32)" ""
tree r4w "()" ieee False 1 "" "(4, 64, 64)" ieee
tree r8w "()" ieee False 1 "" "(8, 64, 64)" ieee
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
K="kda:4,8192,16,128;kda:8,16384,64,64"; R="rwkv7:8,16384,64,64;rwkv7:4,8192,16,128"
(cd $T/m && python -m fastweight.bench.ops_time --cases "$K;$R" --warm >/dev/null 2>&1) &
for t in pi w4; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$K" --warm >/dev/null 2>&1) & done
for t in r4w r8w; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$R" --warm >/dev/null 2>&1) & done
(cd $T/w4 && timeout 140 python -m fastweight.bench.gpu_fuzz --ops kda --dtypes bf16 --modes chunk --budget ${FB:-100} --grace 30 --seed 36002 --workers 2 --out /tmp/fz/w4 > /tmp/fz_w4.txt 2>&1) &
(cd $T/pi && timeout 140 python -m fastweight.bench.gpu_fuzz --ops kda --dtypes bf16 --modes chunk --budget ${FB:-100} --grace 30 --seed 36001 --workers 2 --out /tmp/fz/pi > /tmp/fz_pi.txt 2>&1) &
(cd $T/r4w && timeout 140 python -m fastweight.bench.gpu_fuzz --ops rwkv7,dplr_delta_rule --dtypes bf16 --modes chunk --budget ${FB:-100} --grace 30 --seed 36003 --workers 2 --out /tmp/fz/r4w > /tmp/fz_r4w.txt 2>&1) &
wait; for f in /tmp/fz_*.txt; do echo "== $f"; tail -2 $f; done | tee -a $L
for r in 1 2; do
  for t in m pi w4; do [ $SECONDS -lt ${G:-440} ] && ot $t --cases "$K" --rep 100; done
  for t in m r4w r8w; do [ $SECONDS -lt ${G:-440} ] && ot $t --cases "$R" --rep 100; done
done
[ $SECONDS -lt $((${G:-440} + 60)) ] && ot r4w --cases "rwkv7:8,16384,64,64" --profile fwd
[ $SECONDS -lt $((${G:-440} + 90)) ] && ot w4 --cases "kda:4,8192,16,128" --profile fwd
