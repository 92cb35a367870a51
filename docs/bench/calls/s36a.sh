#!/bin/bash
# Session 36, call 1 (issue 19): the attention ablations (attn_mqar.sh) and the retrieval group at three seeds
# (eval_suite.sh --groups retrieval --seeds 3), sharing the GPU. Results: $OUT/attn/attn_mqar.tgz, $OUT/ret/suite.tgz.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/attn $OUT/ret
OUT=$OUT/attn bash docs/bench/calls/attn_mqar.sh > /tmp/attn.log 2>&1 &
OUT=$OUT/ret JOBS=5 bash docs/bench/calls/eval_suite.sh --groups retrieval --seeds 3 > /tmp/ret.log 2>&1 &
wait
cat $OUT/attn/log.txt; tail -30 $OUT/ret/log.txt
