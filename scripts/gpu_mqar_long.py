"""Does a decayed mixer learn the full suite's MQAR given longer training? (issue 7, on the device)

    python scripts/gpu_mqar_long.py MIXER STEPS WEIGHT_DECAY

The full suite's MQAR experiment for MIXER (d_model 128, 2 layers, lr 1e-3, 16 pairs, 1024 keys
and values, trained at 256 tokens), with STEPS steps and AdamW weight decay WEIGHT_DECAY (the
suite's is 0.1, applied to every parameter, A_log and dt_bias included). Prints the loss curve
every 10% and the scores at 256, 512 and 1024 tokens.
"""
import dataclasses
import sys
import time

from fastweight.evaluate import suite
from fastweight.train import train

mixer, steps, wd = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
exp = next(e for e in suite("full", mixers=[mixer], groups=("retrieval",)) if "mqar" in e.config.task)
cfg = dataclasses.replace(exp.config, steps=steps, weight_decay=wd, log_every=max(1, steps // 10),
                          out_dir=f"/tmp/mqar-{mixer}-{steps}-{wd}")
t0 = time.time()
res = train(cfg)
curve = " ".join(f"{s}:{loss:.2f}" for s, loss in res["curve"])
scores = ", ".join(f"{r['task'].split(':')[0]}@{r['task'].split('seq_len=')[1].split(',')[0]}: {100 * r['acc']:.1f}"
                   for r in res["eval"])
print(f"MQAR {mixer} steps={steps} wd={wd} lr={cfg.lr}: {scores} | loss {curve} ({time.time() - t0:.0f} s)",
      flush=True)
