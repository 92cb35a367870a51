#!/bin/bash
# Session 37, call 3, sharing the GPU (no timings: correctness and training only).
# Issue 17: KDA's fused intra solve, default on main for bf16 at K <= 64 since 1974e58: the GPU fuzz of KDA
# (bf16, fp16, fp32), and gpu_delta's checks against float64 at K x V 64x64 and 32x32 for main (`f`) and for
# main with the switch off (`s`, the stages), so their bf16 errors sit side by side.
# Issue 18: RWKV-7's peak memory the anchor's way (gpu_memory, paper shape).
# Issue 19: which of the four Zoology differences, with zoology's generator, the suite's attention needs to leave
# the plateau: all four (4 of 4 seeds solved in s36a/s37b) with one left out each (MLP back, vocabulary 1024,
# lr 1e-3), seeds 0 and 1 (ATTN=0 leaves them out; T, FB, GD: time limits in s). Results: $OUT/log.txt, $OUT/attn.tgz, $OUT/fz.json.
L=$OUT/log.txt; nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
mkdir -p runs/attn /tmp/s; cp -r fastweight /tmp/s/
sed -i "s/^INTRA_SOLVE_DTYPES = .*/INTRA_SOLVE_DTYPES = ()/" /tmp/s/fastweight/kernels/delta.py
grep -q "^INTRA_SOLVE_DTYPES = ()$" /tmp/s/fastweight/kernels/delta.py || { echo "sed failed" | tee -a $L; exit 1; }
V="vocab_size=8192,power_a=0.01,distinct_values=1"; V1="vocab_size=1024,power_a=0.01,distinct_values=1"
run(){ name=$1; task="mqar:seq_len=256,n_pairs=16,$2"; lr=$3; shift 3
  for s in 0 1; do timeout ${T:-420} python -m fastweight.cli train --task "$task" --eval-tasks "$task" --mixer attn \
    --d-model 128 --n-layers 2 --n-heads 2 --batch-size 32 --steps 3000 --warmup 20 --lr $lr --seed $s --no-progress \
    --out-dir runs/attn/$name-seed$s "$@" > runs/attn/$name-seed$s.txt 2>&1 & done; }
if [ "${ATTN:-1}" = 1 ]; then
  run mlp "$V" 2.15e-3
  run v1024 "$V1" 2.15e-3 --model-args use_mlp=false
  run lr1e3 "$V" 1e-3 --model-args use_mlp=false
fi
timeout $((${FB:-200} + 60)) python -m fastweight.bench.gpu_fuzz --ops kda --dtypes bf16,fp16,fp32 --modes chunk \
  --budget ${FB:-200} --grace 40 --seed 37003 --workers 4 --out /tmp/fz > /tmp/fz.txt 2>&1 &
for t in f s; do d=.; [ $t = s ] && d=/tmp/s
  (cd $d && timeout ${GD:-300} python -m fastweight.bench.gpu_delta --ops kda --heads 64x64,32x32 --heads-ops kda --quick \
    --budget ${GB:-60} --out /tmp/gd_$t 2>&1 | grep -v -i warn | sed "s/^/$t /" > /tmp/gd_$t.txt) & done
# issue 18: the memory target's measure (peak on top of the inputs and dO), not re-taken since session 22
timeout 200 python -m fastweight.bench.gpu_memory --op rwkv7 --shape 8,16384,64,64 --top 12 > /tmp/mem.txt 2>&1 &
wait
cat /tmp/gd_f.txt /tmp/gd_s.txt /tmp/mem.txt >> $L; tail -25 /tmp/fz.txt >> $L; cp /tmp/fz/gpu_fuzz.json $OUT/fz.json
for f in runs/attn/*.txt; do echo "== $f"; grep -v -i warn $f | tail -1; done >> $L
tar -czf $OUT/attn.tgz --exclude=checkpoint.pt runs/attn; cat $L
