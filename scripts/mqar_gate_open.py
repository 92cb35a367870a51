"""Is the gate what keeps Gated DeltaNet from learning MQAR? (issue 7, CPU or GPU)

    python scripts/mqar_gate_open.py MIXER STEPS [open]

The full suite's MQAR experiment for MIXER with STEPS steps; with ``open`` every layer's gate is
pinned open before training (A_log = -30, frozen: g = -e^-30 softplus(.) ~ 0, so Gated DeltaNet
is DeltaNet up to its output gate and parameterisation). Prints the loss curve and the scores.
"""
import dataclasses
import sys
import time

import torch

import fastweight.train as T
from fastweight.evaluate import suite

mixer, steps = sys.argv[1], int(sys.argv[2])
pin = len(sys.argv) > 3 and sys.argv[3] == "open"
if pin:
    build = T.build_model

    def build_open(cfg, vocab_size):
        model = build(cfg, vocab_size)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                with torch.no_grad():
                    p.fill_(-30.0)
                p.requires_grad_(False)
        return model
    T.build_model = build_open
exp = next(e for e in suite("full", mixers=[mixer], groups=("retrieval",)) if "mqar" in e.config.task)
cfg = dataclasses.replace(exp.config, steps=steps, log_every=max(1, steps // 10), eval_examples=64, threads=2,
                          out_dir=f"/tmp/mqar-open-{mixer}-{steps}-{pin}")
t0 = time.time()
res = T.train(cfg)
curve = " ".join(f"{s}:{loss:.2f}" for s, loss in res["curve"])
scores = ", ".join(f"{r['task'].split('seq_len=')[1].split(',')[0]}: {100 * r['acc']:.1f}" for r in res["eval"])
print(f"MQAR {mixer}{' (gate pinned open)' if pin else ''} steps={steps}: {scores} | loss {curve} "
      f"({time.time() - t0:.0f} s)", flush=True)
