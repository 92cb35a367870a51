#!/bin/bash
# Session 34's first device call (planned in session 33; predictions in docs/bench/runs-2026-12-07-s33.md,
# "Next call"). Run from the repository root on the device: `bash docs/bench/calls/s34.sh`, carry [".whl"]
# (fla 0.6.0 wheels: `pip download --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0 -d .whl`) and, if it
# exists, ".ab" holding atune.tgz (fla's autotuning choices from an earlier call). ~9 minutes.
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
for w in 2 8; do tree ks$w
  sed -i "s/WHILE_LOOP=while_loops(), num_warps=4)/WHILE_LOOP=while_loops(), num_warps=$w)/" $T/ks$w/fastweight/kernels/key_sum.py
  grep -q "num_warps=$w)" $T/ks$w/fastweight/kernels/key_sum.py || { log "sed failed for ks$w"; exit 1; }
done
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
SG64="simple_gla:8,16384,64,64"; SG128="simple_gla:4,8192,16,128"; LA="linear_attn:8,16384,64,64"
# 1. compile every tree in parallel (and the fuzz of the variants, which must pass before any merge)
for t in m q41 q82 r128; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$SG64;$SG128" --warm >/dev/null 2>&1) & done
for t in m ks2 ks8; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$LA" --warm >/dev/null 2>&1) & done
mkdir -p $OUT/fz
(cd $T/r128 && timeout 150 python -m fastweight.bench.gpu_fuzz --ops simple_gla,retention,linear_attn --dtypes bf16,fp16 --modes chunk --budget 110 --grace 30 --seed 34001 --workers 6 --out $OUT/fz > $OUT/fz.txt 2>&1) &
wait; log "compiled"; tail -2 $OUT/fz.txt | tee -a $L
# 2. A/B, alternated
for r in 1 2; do [ $SECONDS -lt 330 ] || break
  for t in m q41 q82 r128; do ot $t --cases "$SG64;$SG128" --rep 100; done
  for t in m ks2 ks8; do ot $t --cases "$LA" --rep 100; done
done
[ $SECONDS -lt 360 ] && ot r128 --cases "$SG64" --profile fb
# where KDA's forward and RWKV-7's time go now (issue 17's KDA forward, issue 18)
[ $SECONDS -lt 380 ] && ot m --cases "kda:4,8192,16,128;rwkv7:8,16384,64,64" --profile fwd
# 3. side by side with fla (re-takes issue 17's rows on this card) with what is left
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
mkdir -p /tmp/tcs; [ -f .ab/atune.tgz ] && tar -xzf .ab/atune.tgz -C /tmp/tcs
save(){ (cd /tmp/tcs && find . -name '*.autotune.json' | tar -czf $OUT/atune.tgz -T -); }
trap save EXIT
left=$((540 - SECONDS)); [ $left -gt 60 ] || exit 0
PYTHONPATH=$PWD:/tmp/site TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcs timeout $left python -m fastweight.bench.side_by_side \
  --ops gated_delta_rule,simple_gla,kda,gla --shapes gdn1.3b --rep 100 --out $OUT 2>&1 | grep -v -i warn | tail -12 | tee -a $L
