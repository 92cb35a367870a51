#!/bin/bash
# Session 37, call 2 (issue 19): attention's plateau exit, three sets sharing the GPU. (1) s36a's one run that
# solved the suite's MQAR (all four Zoology differences: vocabulary 8192, zoology's generator, lr 2.15e-3, no MLP)
# at seeds 1-3; (2) the Zoology point's attention (d 128, T 128, lr 2.15e-3), whose seeds 1-2 stayed at 13%, at
# 4x the steps (3125), as Mamba-2 was in the fifth GPU batch; (3) the retrieval group's two runs s36a left unstarted
# (carry ["runs/suite"], unpacked from s36a's ret/suite.tgz). Results: $OUT/attn.tgz, $OUT/zoo4x.tgz,
# $OUT/suite.tgz and their logs. A set cut by the limit goes on where it stopped when run again.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p runs/attn runs/zoo4x runs/suite
M8="mqar:seq_len=256,n_pairs=16,vocab_size=8192,power_a=0.01,distinct_values=1"
for s in 1 2 3; do
  timeout ${T:-500} python -m fastweight.cli train --task "$M8" --eval-tasks "$M8" --mixer attn --d-model 128 \
    --n-layers 2 --n-heads 2 --batch-size 32 --steps 3000 --warmup 20 --lr 2.15e-3 --model-args use_mlp=false \
    --seed $s --no-progress --out-dir runs/attn/all4-seed$s > runs/attn/all4-seed$s.txt 2>&1 &
done
timeout ${T:-500} python -m fastweight.cli eval --full --groups zoology --lengths 128 --widths 128 --lrs 2.1544e-3 \
  --mixers attn --steps 3125 --seed 1 --seeds 2 --jobs 2 --threads 2 --time-limit 60 --no-progress \
  --out runs/zoo4x 2>&1 | grep -v -i warn | tail -12 > $OUT/zoo4x.txt &
timeout ${T:-500} python -m fastweight.cli eval --full --groups retrieval --seeds 3 --jobs 2 --threads 2 \
  --time-limit 60 --no-progress --out runs/suite 2>&1 | grep -v -i warn | tail -12 > $OUT/ret.txt &
wait
for f in runs/attn/*.txt; do echo "== $f"; grep -v -i warn $f | tail -1; done | tee $OUT/attn.txt
tar -czf $OUT/attn.tgz --exclude=checkpoint.pt runs/attn; tar -czf $OUT/zoo4x.tgz --exclude=checkpoint.pt runs/zoo4x
tar -czf $OUT/suite.tgz --exclude=checkpoint.pt runs/suite; cat $OUT/zoo4x.txt $OUT/ret.txt
