#!/bin/bash
# Issue 19, the Zoology grid past its one column: MQAR at length 256 (16 pairs, batch 256, 4 epochs of 100,000
# examples: 1,562 steps) at widths 64 and 128, every mixer of the group, lr 2.15e-3 (the grid point the column used),
# seed 0: 16 runs (~1,700 s of one process by --estimate), 12 sharing the GPU, resumable: carry ["runs/zoo256"]
# (unpack $OUT/zoo256.tgz here first) and call again. Results: $OUT/zoo256.tgz, $OUT/log.txt.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p runs/zoo256
timeout ${T:-500} python -m fastweight.cli eval --full --groups zoology --lengths 256 --widths 64,128 --lrs 2.1544e-3 \
  --jobs 12 --threads 1 --time-limit ${LIMIT:-300} --no-progress --out runs/zoo256 2>&1 | grep -v -i warn | tail -30 \
  | tee $OUT/log.txt
tar -czf $OUT/zoo256.tgz runs/zoo256; du -sh $OUT/zoo256.tgz
