#!/bin/bash
# Issue 19's GPU sets: `fastweight eval --full` (27 runs, ~1290 s of one process by `--estimate`) as nine processes
# sharing the GPU (`--jobs 9`: the runs are launch-bound; session 35 ran them in 294 s on an H100). Run from the
# repository root on the device: `bash docs/bench/calls/eval_suite.sh [extra eval arguments, e.g. --groups
# retrieval --seeds 3]`. A cut call goes on where it stopped: carry ["runs/suite"] (unpack the previous call's
# $OUT/suite.tgz here first); finished runs are read back, not trained again. The results come back as one file
# (the device returns at most 8): suite.tgz, run folders without checkpoints. The table, curves and plots then
# go to docs/results/ (docs/evals.md, "Recording the GPU run").
mkdir -p runs/suite
python -m fastweight.cli eval --full --jobs "${JOBS:-9}" --threads 2 --time-limit "${LIMIT:-450}" --no-progress \
  --out runs/suite "$@" 2>&1 | grep -v -i warn | tail -60 | tee $OUT/log.txt
tar -czf $OUT/suite.tgz --exclude=checkpoint.pt runs/suite
