#!/bin/bash
# Session 36, call 1 (issue 19), three sets sharing the GPU: the attention ablations (attn_mqar.sh, 6 processes),
# the retrieval group at three seeds (eval_suite.sh --groups retrieval --seeds 3, 3 processes), and seeds 1-2 of
# the zoology column's one-seed cells and GDN's seed 2 (d 128, T 128, lr 2.15e-3; 4 processes). Results:
# $OUT/attn/attn_mqar.tgz, $OUT/ret/suite.tgz, $OUT/zoo.tgz. Each set goes on where it stopped when run again with its folder carried.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/attn $OUT/ret runs/zoo
OUT=$OUT/attn bash docs/bench/calls/attn_mqar.sh > /tmp/attn.log 2>&1 &
OUT=$OUT/ret JOBS=3 LIMIT=330 bash docs/bench/calls/eval_suite.sh --groups retrieval --seeds 3 > /tmp/ret.log 2>&1 &
python -m fastweight.cli eval --full --groups zoology --lengths 128 --widths 128 --lrs 2.1544e-3 \
  --mixers attn,deltanet,rwkv7,kda --seed 1 --seeds 2 --jobs 3 --threads 2 --time-limit 330 --no-progress \
  --out runs/zoo 2>&1 | grep -v -i warn | tail -30 > $OUT/zoo.txt &
python -m fastweight.cli eval --full --groups zoology --lengths 128 --widths 128 --lrs 2.1544e-3 --mixers gdn \
  --seed 2 --seeds 1 --threads 2 --time-limit 330 --no-progress --out runs/zoo 2>&1 | grep -v -i warn | tail -5 > $OUT/zoo_gdn.txt &
wait
tar -czf $OUT/zoo.tgz --exclude=checkpoint.pt runs/zoo
cat $OUT/attn/log.txt; tail -30 $OUT/ret/log.txt; cat $OUT/zoo.txt $OUT/zoo_gdn.txt
