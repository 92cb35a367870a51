#!/bin/bash
# Issue 19's suite rerun (`fastweight eval --full`, 27 runs, ~1290 s by `--estimate` for one process) as nine
# processes sharing the one GPU: the runs are launch-bound (d_model 128, ~17 ms a step), so the GPU idles
# between one process's launches. Every process writes its own run folders under runs/suite (the folder names
# are the runs' identities; seeds do not depend on the split). Run from the repository root on the device;
# a second call carries ["runs/suite"] (copy $OUT/suite to runs/suite first) and finishes what is left.
LIMIT=${LIMIT:-400}
mkdir -p runs/suite $OUT/logs
ev(){ name=$1; shift; python -m fastweight.cli eval --full --time-limit $LIMIT --no-progress --threads 2 \
        --out runs/suite "$@" > $OUT/logs/$name.txt 2>&1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
ev retrieval --groups retrieval &
ev state --groups state-tracking &
for m in attn mamba2 gla deltanet gdn kda rwkv7; do ev recall-$m --groups recall --mixers $m & done
wait
echo "processes done at ${SECONDS} s"
# the whole table: every finished run is read back; a run not finished is left for the next call
python -m fastweight.cli eval --full --estimate --out runs/suite 2>&1 | grep -v -i warn | tail -3
python -m fastweight.cli eval --full --time-limit 0.01 --no-progress --out runs/suite 2>&1 | grep -v -i warn | tail -40
cp -r runs/suite $OUT/
