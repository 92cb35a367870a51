#!/bin/bash
# Session 34's first device call, trimmed from s34.sh after six refused starts left 18 device minutes: the variants
# most likely to merge (r128, p34, fg, kg) against main, their fuzz, and the two forward profiles. ~7 minutes.
# Run from the repository root on the device: `bash docs/bench/calls/s34c.sh`.
L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
log(){ echo "[$SECONDS] $*" | tee -a $L; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
tree(){ rm -rf $T/$1; mkdir -p $T/$1; cp -r fastweight $T/$1/; }
tree m
tree r128   # the decay dq/dk kernel at 8 warps capped at 128 registers: two programs an SM
sed -i "s/                                             num_stages=BWD_DQK_CONFIG\[1\])/                                             num_stages=BWD_DQK_CONFIG[1], maxnreg=128)/" $T/r128/fastweight/kernels/decay_output.py
grep -q "maxnreg=128)" $T/r128/fastweight/kernels/decay_output.py || { log "sed failed for r128"; exit 1; }
tree p34    # linear attention's key sum: chunk loop pipelined, 3 stages, 4 warps, one 128-wide value block
f=$T/p34/fastweight/kernels/key_sum.py
sed -i "s/^LOOP_STAGES = None/LOOP_STAGES = 3/; s/^BT, BV = 64, 64/BT, BV = 64, 128/" $f
grep -q "^LOOP_STAGES = 3" $f && grep -q "^BT, BV = 64, 128" $f || { log "sed failed for p34"; exit 1; }
tree fg     # RWKV-7's forward state pass forms its gate sums: the intra kernel stores none
sed -i "s/^FWD_GATE_SUMS_MAX_K = 0/FWD_GATE_SUMS_MAX_K = 64/" $T/fg/fastweight/kernels/dplr.py
grep -q "^FWD_GATE_SUMS_MAX_K = 64" $T/fg/fastweight/kernels/dplr.py || { log "sed failed for fg"; exit 1; }
tree kg     # KDA's forward forms its gate sums in the intra kernel: no chunk_cumsum pass before it
sed -i "s/^INTRA_GATE_SUMS_DTYPES = ()/INTRA_GATE_SUMS_DTYPES = (torch.bfloat16,)/" $T/kg/fastweight/kernels/delta.py
grep -q "^INTRA_GATE_SUMS_DTYPES = (torch.bfloat16,)" $T/kg/fastweight/kernels/delta.py || { log "sed failed for kg"; exit 1; }
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
SG="simple_gla:8,16384,64,64;simple_gla:4,8192,16,128"; LA="linear_attn:8,16384,64,64;linear_attn:4,8192,16,128"
RW="rwkv7:8,16384,64,64"; KD="kda:4,8192,16,128"
# 1. compile every tree in parallel, and fuzz the variants (a merge needs its fuzz)
(cd $T/m && python -m fastweight.bench.ops_time --cases "$SG;$LA;$RW;kda:4,8192,16,128" --warm >/dev/null 2>&1) &
(cd $T/r128 && python -m fastweight.bench.ops_time --cases "$SG" --warm >/dev/null 2>&1) &
(cd $T/p34 && python -m fastweight.bench.ops_time --cases "$LA" --warm >/dev/null 2>&1) &
(cd $T/fg && python -m fastweight.bench.ops_time --cases "$RW" --warm >/dev/null 2>&1) &
(cd $T/kg && python -m fastweight.bench.ops_time --cases "$KD" --warm >/dev/null 2>&1) &
fz(){ mkdir -p $OUT/$1; (cd $T/$2 && timeout 130 python -m fastweight.bench.gpu_fuzz --ops $3 --dtypes $4 --modes chunk \
  --budget 95 --grace 30 --seed $5 --workers 3 --out $OUT/$1 > $OUT/$1.txt 2>&1) & }
fz fz r128 simple_gla,retention bf16,fp16 34001; fz fzk p34 linear_attn bf16,fp16 34002; fz fzg fg rwkv7,dplr_delta_rule bf16 34003
fz fzd kg kda bf16 34004
wait; log "compiled"; for f in fz fzk fzg fzd; do tail -2 $OUT/$f.txt | tee -a $L; done
# 2. A/B, alternated; the profiles after the first round
for r in 1 2; do [ $SECONDS -lt 330 ] || break
  ot m --cases "$SG" --rep 100; ot r128 --cases "$SG" --rep 100
  ot m --cases "$LA" --rep 100; ot p34 --cases "$LA" --rep 100
  ot m --cases "$RW" --rep 400; ot fg --cases "$RW" --rep 400
  ot m --cases "$KD" --rep 100; ot kg --cases "$KD" --rep 100
  if [ $r = 1 ]; then
    ot r128 --cases "simple_gla:8,16384,64,64" --profile fb
    # where KDA's forward and RWKV-7's time go now (issue 17's KDA forward, issue 18)
    ot m --cases "$KD;$RW" --profile fwd
  fi
done
echo "[$SECONDS] end" | tee -a $L
