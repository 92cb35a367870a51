#!/bin/bash
# Issue 19, S-NIAH-3. (1) The retrieval group at seed 0 in a fresh folder (s38c's read back a stale one): S-NIAH-3's
# 40-67% of answer tokens in the suite's mixture, by answer position (`position_acc`). (2) S-NIAH-3 trained alone
# past s38c's 1200 steps: 32-character values for 6000 steps, 16-character ones for 3000 (DeltaNet, GDN): does the
# plateau at 2.46 break with steps, and from which end of the value? ~5 minutes, 9 processes sharing the GPU.
# Results: $OUT/ret.tgz, $OUT/niah3.tgz, $OUT/log.txt.
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf runs/ret_pos39; mkdir -p runs/ret_pos39 runs/niah3b
python -m fastweight.cli eval --full --groups retrieval --jobs 5 --threads 1 --time-limit 60 --no-progress --rerun \
  --out runs/ret_pos39 2>&1 | grep -v -i warn | tail -12 > /tmp/ret.txt &
for m in gdn deltanet; do for VS in 32:6000 16:3000; do V=${VS%:*}; S=${VS#*:}
  timeout ${T:-420} python -m fastweight.cli train --task "s_niah_3:context_len=512,value_len=$V" \
    --curriculum "s_niah_3:context_len=128,value_len=$V" --curriculum-steps 300 \
    --eval-tasks "s_niah_3:context_len=512,value_len=$V;s_niah_3:context_len=1024,value_len=$V" --mixer $m \
    --d-model 128 --n-layers 2 --n-heads 2 --batch-size 32 --steps $S --warmup 20 --lr 1e-3 --eval-examples 128 \
    --threads 1 --no-progress --out-dir runs/niah3b/$m-v$V > runs/niah3b/$m-v$V.txt 2>&1 &
done; done
wait
{ cat /tmp/ret.txt; for f in runs/niah3b/*.txt; do echo "== $f"; grep -v -i warn $f | tail -2; done; } | tee $OUT/log.txt
tar -czf $OUT/ret.tgz --exclude=checkpoint.pt runs/ret_pos39; tar -czf $OUT/niah3.tgz --exclude=checkpoint.pt runs/niah3b
