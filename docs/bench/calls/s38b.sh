#!/bin/bash
# Issue 19: Grazzi et al.'s parity and modular arithmetic at the full setting (20,000 steps of 256, 2 layers of
# width 64) at three seeds, the paper's best-of-3: `fastweight eval --full --groups grazzi --seeds 3` (24 runs,
# ~8,600 s of one process by --estimate) as 12 processes sharing the GPU. The runs checkpoint every 100 steps and
# resume: carry ["runs/grazzi"] (unpack the previous call's $OUT/grazzi.tgz, checkpoints included, here first)
# and call again until the table is whole. Results: $OUT/grazzi.tgz, $OUT/log.txt.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p runs/grazzi
timeout ${T:-500} python -m fastweight.cli eval --full --groups grazzi --seeds 3 --jobs 12 --threads 1 \
  --time-limit ${LIMIT:-300} --no-progress --out runs/grazzi 2>&1 | grep -v -i warn | tail -40 | tee $OUT/log.txt
tar -czf $OUT/grazzi.tgz runs/grazzi; du -sh $OUT/grazzi.tgz
