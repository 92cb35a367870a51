#!/bin/bash
# Issue 19: should the suite's recall group take Zoology's MQAR data? Every recall mixer on the suite's MQAR
# (T 256, 16 pairs, d 128, 2 layers, batch 32, 3000 steps) with Zoology's generator and vocabulary 8192, with and
# without the MLP (Zoology's models have none), lr 2.15e-3 (Zoology's grid point), seed 0. Attention solved this
# without the MLP on 4 seeds of 4 (session 37) and not with it (session 38). 14 processes sharing the GPU, ~4 min.
# Results: $OUT/zrecall.tgz, $OUT/log.txt.
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p runs/zrecall; task="mqar:seq_len=256,n_pairs=16,vocab_size=8192,power_a=0.01,distinct_values=1"
for m in attn mamba2 gla deltanet gdn kda rwkv7; do for mlp in true false; do
  timeout ${T:-420} python -m fastweight.cli train --task "$task" --eval-tasks "$task" --mixer $m --d-model 128 \
    --n-layers 2 --n-heads 2 --batch-size 32 --steps 3000 --warmup 20 --lr 2.15e-3 --seed 0 --threads 1 \
    --model-args use_mlp=$mlp --no-progress --out-dir runs/zrecall/$m-mlp$mlp > runs/zrecall/$m-mlp$mlp.txt 2>&1 &
done; done
wait
for f in runs/zrecall/*.txt; do echo "== $f"; grep -v -i warn $f | tail -1; done | tee $OUT/log.txt
tar -czf $OUT/zrecall.tgz --exclude=checkpoint.pt runs/zrecall
