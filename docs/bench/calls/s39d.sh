#!/bin/bash
# Issue 19, word problems at the group's full setting (one layer, width 128, 4 heads, batch 512, 10,000 steps,
# lr 1e-3, weight decay 0.01, no short convolutions; trained at 32 tokens, scored at 32-256): S3, S5 and S5 of
# swaps for DeltaNet, GDN, Gated DeltaProduct n_h 2/3/4 ([-1,1]) and RWKV-7. At width 64 and batch 64 (CPU, sessions
# 20 and 38) nothing learned full S5, not even at 8 tokens; does 8x the batch, twice the width and 2.5x the steps
# let n_h 4 (which can carry any element of S5) learn it? 18 runs (~2,800 s of one process by --estimate), 12
# sharing the GPU, resumable: carry ["runs/dp"] (unpack $OUT/dp.tgz here first) and call again.
# Results: $OUT/dp.tgz, $OUT/log.txt.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p runs/dp
timeout ${T:-500} python -m fastweight.cli eval --full --groups deltaproduct --tasks s3,s5 --lrs 1e-3 --jobs 12 \
  --threads 1 --time-limit ${LIMIT:-300} --no-progress --out runs/dp 2>&1 | grep -v -i warn | tail -30 | tee $OUT/log.txt
tar -czf $OUT/dp.tgz runs/dp; du -sh $OUT/dp.tgz
