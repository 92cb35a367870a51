#!/bin/bash
# Issue 17: KDA's inference forward with its read formed in the state pass (`f`: kda_fuse_wy.patch, from the branch
# wip/kda-fuse-wy, with delta.KDA_FUSE_WY_DTYPES = (bf16,)) against main (`m`), alternated three times in one call:
# recompute_w_u (0.479 ms of 1.769 at (4, 8192, 16, 128) on the H100) goes; the state pass forms K exp(G), the
# decayed write keys and q exp(G) itself (8 warps at K 128: 255 registers, 224 B of stack; 4 warps at K 64, 40 B).
# Then the KDA fuse of `f` (bf16, fp16) and both profiles. Results: $OUT/log.txt. ~6 minutes.
L=$OUT/log.txt; T=/tmp/trees; export TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $L
set_(){ sed -i "s/^$2 = .*/$2 = $3/" $1; grep -q "^$2 = $3\$" $1 || { echo "sed failed: $1 $2" | tee -a $L; exit 1; }; }
rm -rf $T; mkdir -p $T/m $T/f; cp -r fastweight $T/m/; cp -r fastweight $T/f/
(cd $T/f && patch -p1 -s < $OLDPWD/docs/bench/calls/kda_fuse_wy.patch) || { echo "patch failed" | tee -a $L; exit 1; }
set_ $T/f/fastweight/kernels/delta.py KDA_FUSE_WY_DTYPES "(torch.bfloat16,)"
ot(){ t=$1; shift; (cd $T/$t && python -m fastweight.bench.ops_time "$@" --label $t 2>&1 | grep -v -i warn | tee -a $L); }
K="kda:4,8192,16,128;kda:8,16384,64,64;kda:8,2048,16,64"
for t in m f; do (cd $T/$t && python -m fastweight.bench.ops_time --cases "$K" --warm --forward-only >/dev/null 2>&1) & done
(cd $T/f && timeout 200 python -m fastweight.bench.gpu_fuzz --ops kda --dtypes bf16,fp16 --modes chunk --budget 150 \
  --grace 30 --seed 39005 --workers 4 --out /tmp/fz > /tmp/fz.txt 2>&1) &
wait; tail -14 /tmp/fz.txt | tee -a $L
for r in 1 2 3; do for t in m f; do [ $SECONDS -lt ${G:-420} ] && ot $t --cases "$K" --rep 100 --forward-only; done; done
[ $SECONDS -lt $((${G:-420} + 40)) ] && ot f --cases "kda:4,8192,16,128" --profile fwd
[ $SECONDS -lt $((${G:-420} + 70)) ] && ot m --cases "kda:4,8192,16,128" --profile fwd
