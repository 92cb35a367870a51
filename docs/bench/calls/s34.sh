#!/bin/bash
# Session 34's first device call (planned in session 33; predictions in docs/bench/runs-2026-12-07-s33.md,
# "Next call"). Run from the repository root on the device: `bash docs/bench/calls/s34.sh`. ~8 minutes.
# The side by side with fla is the second call, `s34b.sh`.
# Trees are built here from ./fastweight: m (as committed) and the decay dq/dk kernel's launch variants.
L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
log(){ echo "[$SECONDS] $*" | tee -a $L; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; }
tree m
for c in 41 82; do tree q$c
  sed -i "s/^OUTPUT_FWD_CONFIG, BWD_DV_CONFIG, BWD_DQK_CONFIG = (4, 3), (4, 3), (8, 1)/OUTPUT_FWD_CONFIG, BWD_DV_CONFIG, BWD_DQK_CONFIG = (4, 3), (4, 3), (${c:0:1}, ${c:1:1})/" $T/q$c/fastweight/kernels/decay_output.py
  grep -q "BWD_DQK_CONFIG = (4, 3), (4, 3), (${c:0:1}, ${c:1:1})" $T/q$c/fastweight/kernels/decay_output.py || { log "sed failed for q$c"; exit 1; }
done
tree r128   # 8 warps capped at 128 registers: two programs an SM (sm_90: 248 B of stack at K = 64)
sed -i "s/                                             num_stages=BWD_DQK_CONFIG\[1\])/                                             num_stages=BWD_DQK_CONFIG[1], maxnreg=128)/" $T/r128/fastweight/kernels/decay_output.py
grep -q "maxnreg=128)" $T/r128/fastweight/kernels/decay_output.py || { log "sed failed for r128"; exit 1; }
# linear attention's key sum: the chunk loop pipelined (LOOP_STAGES), its warps, one 128-wide value block
ks(){ tree $1; f=$T/$1/fastweight/kernels/key_sum.py
  sed -i "s/^LOOP_STAGES = None/LOOP_STAGES = $2/; s/^NUM_WARPS = 4/NUM_WARPS = $3/; s/^BT, BV = 64, 64/BT, BV = 64, $4/" $f
  grep -q "^LOOP_STAGES = $2" $f && grep -q "^NUM_WARPS = $3" $f && grep -q "^BT, BV = 64, $4" $f || { log "sed failed for $1"; exit 1; }; }
ks ks8 None 8 64; ks p34 3 4 128; ks p38 3 8 128; ks p28 2 8 128
tree fg     # RWKV-7's forward state pass forms its gate sums (session 34): the intra kernel stores none
sed -i "s/^FWD_GATE_SUMS_MAX_K = 0/FWD_GATE_SUMS_MAX_K = 64/" $T/fg/fastweight/kernels/dplr.py
grep -q "^FWD_GATE_SUMS_MAX_K = 64" $T/fg/fastweight/kernels/dplr.py || { log "sed failed for fg"; exit 1; }
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
SG64="simple_gla:8,16384,64,64"; SG128="simple_gla:4,8192,16,128"; LA="linear_attn:8,16384,64,64;linear_attn:4,8192,16,128"
RW="rwkv7:8,16384,64,64"
# 1. compile every tree in parallel (and the fuzz of the variants, which must pass before any merge)
for t in m q41 q82 r128; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$SG64;$SG128" --warm >/dev/null 2>&1) & done
for t in m ks8 p34 p38 p28; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$LA" --warm >/dev/null 2>&1) & done
for t in m fg; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$RW;kda:4,8192,16,128" --warm >/dev/null 2>&1) & done
mkdir -p $OUT/fz
(cd $T/r128 && timeout 150 python -m fastweight.bench.gpu_fuzz --ops simple_gla,retention --dtypes bf16,fp16 --modes chunk --budget 110 --grace 30 --seed 34001 --workers 4 --out $OUT/fz > $OUT/fz.txt 2>&1) &
mkdir -p $OUT/fzk
(cd $T/p34 && timeout 150 python -m fastweight.bench.gpu_fuzz --ops linear_attn --dtypes bf16,fp16 --modes chunk,fused_recurrent --budget 110 --grace 30 --seed 34002 --workers 3 --out $OUT/fzk > $OUT/fzk.txt 2>&1) &
mkdir -p $OUT/fzg
(cd $T/fg && timeout 150 python -m fastweight.bench.gpu_fuzz --ops rwkv7,dplr_delta_rule --dtypes bf16 --modes chunk --budget 110 --grace 30 --seed 34003 --workers 3 --out $OUT/fzg > $OUT/fzg.txt 2>&1) &
wait; log "compiled"; for f in fz fzk fzg; do tail -2 $OUT/$f.txt | tee -a $L; done
# 2. A/B, alternated; the profiles after the first round
for r in 1 2; do [ $SECONDS -lt 440 ] || break
  for t in m q41 q82 r128; do [ $SECONDS -lt 500 ] && ot $t --cases "$SG64;$SG128" --rep 100; done
  for t in m ks8 p34 p38 p28; do [ $SECONDS -lt 500 ] && ot $t --cases "$LA" --rep 100; done
  for t in m fg; do [ $SECONDS -lt 500 ] && ot $t --cases "$RW" --rep 400; done
  if [ $r = 1 ]; then
    ot r128 --cases "$SG64" --profile fb
    # where KDA's forward and RWKV-7's time go now (issue 17's KDA forward, issue 18)
    ot m --cases "kda:4,8192,16,128;$RW" --profile fwd
  fi
done
echo "[$SECONDS] end" | tee -a $L
