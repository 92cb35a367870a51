#!/usr/bin/env bash
# Session 4's last check (nvidia-h200): RWKV-7 / DPLR at head sizes the anchor shapes do not reach,
# after the state passes went to BV = 64 at every K (was 16 / 32 at K = 256): bf16 at (256, 256),
# (80, 72), (128, 64); fp32 at (256, 256). Rows in $OUT/gpu_decay_dplr.json.
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
OUT=${OUT:-runs/gpu} timeout ${LIMIT:-200} python -c "
import torch
from fastweight.bench import gpu_decay_dplr as dd
for K, V, dtype in ((256, 256, torch.bfloat16), (80, 72, torch.bfloat16), (128, 64, torch.bfloat16),
                    (256, 256, torch.float32)):
    dd.check('rwkv7', dtype, T=150, H=2, K=K, V=V)
dd.check('dplr_delta_rule', torch.bfloat16, T=150, H=2, K=256, V=256, cu_seqlens=torch.tensor([0, 37, 150], device='cuda'))
" 2>&1 | grep -v "Warning\|warn_once"
