#!/bin/bash
# Session 34's second device call: the side by side with fla 0.6.0 (issue 17's rows on this card). Carry [".whl"]
# (`pip download --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0 -d .whl`) and, if it exists, ".ab" with
# atune.tgz (fla's autotuning choices from an earlier call on the same card: saves 100-250 s an op). Up to 9 minutes;
# a cut run goes on where it stopped (below).
L=$OUT/log.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
# fla's choices are kept only for the card they were tuned on (.ab/atune.card holds its name)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$card" | tee -a $L
mkdir -p /tmp/tcs; [ -f .ab/atune.tgz ] && [ "$(cat .ab/atune.card 2>/dev/null)" = "$card" ] && tar -xzf .ab/atune.tgz -C /tmp/tcs
echo "$card" > $OUT/atune.card
save(){ (cd /tmp/tcs && find . -name '*.autotune.json' | tar -czf $OUT/atune.tgz -T -); }
trap save EXIT
left=$((540 - SECONDS))
# a cut run goes on: copy its side_by_side.json (and atune.tgz, atune.card) into .ab/ and carry .ab
resume=; [ -f .ab/side_by_side.json ] && resume="--resume .ab/side_by_side.json"
PYTHONPATH=$PWD:/tmp/site TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcs timeout $left python -m fastweight.bench.side_by_side \
  --ops gated_delta_rule,simple_gla,kda,gla,delta_rule --shapes gdn1.3b,short --rep 100 --out $OUT $resume 2>&1 | grep -v -i warn | tail -12 | tee -a $L
