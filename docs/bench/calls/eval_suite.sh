#!/bin/bash
# Issue 19's GPU set: `fastweight eval --full` with today's code (27 runs, ~1290 s of H200 time by `fastweight eval
# --full --estimate`), in calls of under ten minutes that go on where the last stopped. Run from the repository root
# on the device: `bash docs/bench/calls/eval_suite.sh`, carrying ["runs/suite"] from the second call on (copy the
# previous call's $OUT/suite to runs/suite here first). A finished run is read back and not trained again; a run cut
# by the call's limit starts over, so no new run starts after LIMIT seconds (default 450; the longest run, MQAR at
# 3000 steps, takes ~67 s). The table, curves and plots then go to docs/results/ (docs/evals.md, "Recording the GPU
# run").
mkdir -p runs/suite
python -m fastweight.cli eval --full --time-limit "${LIMIT:-450}" --no-progress --out runs/suite 2>&1 \
  | grep -v -i warn | tail -60 | tee $OUT/log.txt
cp -r runs/suite $OUT/
