#!/bin/bash
# Session 35's fifth call (issue 19): RWKV-7's S-NIAH plateau against the budget (the suite's retrieval run at 3x the
# steps, and at its own 1200 with another seed), and attention's MQAR at Zoology's batch (512, 800 steps) instead of
# the suite's 32. Three processes share the GPU. Run from the repository root on the device. ~3 minutes.
mkdir -p runs/s35e
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log.txt
M="mqar:seq_len=256,n_pairs=16,vocab_size=1024"
python -m fastweight.cli eval --full --groups retrieval --mixers rwkv7 --steps 3600 --no-progress --out runs/s35e/niah3x > runs/s35e/niah3x.txt 2>&1 &
python -m fastweight.cli eval --full --groups retrieval --mixers rwkv7 --seed 1 --no-progress --out runs/s35e/niah_seed1 > runs/s35e/niah_seed1.txt 2>&1 &
python -m fastweight.cli train --task "$M" --eval-tasks "$M" --mixer attn --d-model 128 --n-layers 2 --n-heads 2 --batch-size 512 \
  --steps 800 --lr 1e-3 --warmup 20 --no-progress --out-dir runs/s35e/attn512 > runs/s35e/attn512.txt 2>&1 &
wait
for f in runs/s35e/*.txt; do echo "== $f"; grep -v -i warn $f | tail -6; done | tee -a $OUT/log.txt
tar -czf $OUT/s35e.tgz --exclude=checkpoint.pt runs/s35e
