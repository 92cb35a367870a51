#!/bin/bash
# Issue 19: why S-NIAH-3 scores 0% for every mixer. (1) The retrieval group at seed 0 again, now that scores carry
# position_acc (the accuracy of each answer token: does a model copy the UUID's first characters and lose the
# rest?); (2) GDN and DeltaNet trained on S-NIAH-3 alone (the suite's mixture gives it a third of 900 steps) for
# the suite's 1200 steps, 36-token UUIDs and 8-character ones; (3) below. 11 processes sharing the GPU, ~4 minutes.
# Results: $OUT/ret.tgz, $OUT/niah3.tgz, $OUT/log.txt.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p runs/ret_pos runs/niah3
python -m fastweight.cli eval --full --groups retrieval --jobs 5 --threads 2 --time-limit 60 --no-progress \
  --out runs/ret_pos 2>&1 | grep -v -i warn | tail -12 > /tmp/ret.txt &
for m in gdn deltanet; do for V in 32 8; do
  timeout ${T:-400} python -m fastweight.cli train --task "s_niah_3:context_len=512,value_len=$V" \
    --curriculum "s_niah_3:context_len=128,value_len=$V" --curriculum-steps 300 \
    --eval-tasks "s_niah_3:context_len=512,value_len=$V;s_niah_3:context_len=1024,value_len=$V" --mixer $m \
    --d-model 128 --n-layers 2 --n-heads 2 --batch-size 32 --steps 1200 --warmup 20 --lr 1e-3 --eval-examples 128 \
    --no-progress --out-dir runs/niah3/$m-v$V > runs/niah3/$m-v$V.txt 2>&1 &
done; done
# (3) S5 with a length curriculum (1500 steps at 8 tokens, then 32): one layer that can carry S5 (Gated
# DeltaProduct, 4 Householder steps a token, [-1,1]) against one that cannot (DeltaNet [-1,1], one step), at the
# CPU scale of published.md's word-problem table (d 64, 2 heads, batch 64, 4000 steps; no curriculum: both 0).
if [ "${S5:-0}" = 1 ]; then  # (run on the CPU in session 38 instead: gdp does not learn S5 at 8 tokens)
C="--d-model 64 --n-layers 1 --n-heads 2 --batch-size 64 --lr 1e-3 --weight-decay 0.01 --steps 4000 --warmup 100
  --eval-examples 256 --no-progress --curriculum s5:seq_len=8 --curriculum-steps 1500 --allow-neg-eigval"
E="s5:seq_len=32;s5:seq_len=64"
timeout ${T:-400} python -m fastweight.cli train --task s5:seq_len=32 --eval-tasks "$E" --mixer gdp $C \
  --model-args use_short_conv=false,num_householder=4 --out-dir runs/niah3/s5-gdp4 > runs/niah3/s5-gdp4.txt 2>&1 &
timeout ${T:-400} python -m fastweight.cli train --task s5:seq_len=32 --eval-tasks "$E" --mixer deltanet $C \
  --model-args use_short_conv=false --out-dir runs/niah3/s5-deltanet > runs/niah3/s5-deltanet.txt 2>&1 &
fi
wait
{ cat /tmp/ret.txt; for f in runs/niah3/*.txt; do echo "== $f"; grep -v -i warn $f | tail -2; done; } | tee $OUT/log.txt
tar -czf $OUT/ret.tgz --exclude=checkpoint.pt runs/ret_pos; tar -czf $OUT/niah3.tgz --exclude=checkpoint.pt runs/niah3
