"""Why the evaluation's Mamba-2 gave NaN on the H200 (issue 7), on the device:

    python scripts/gpu_mamba2.py

Builds each Mamba-2 model of the full suite (retrieval and state tracking) once on the CPU,
copies it to the GPU and compares one batch's loss and gradients: CPU fp32 (the truth), GPU
fp32, GPU bf16 autocast (as the trainer runs), each on the Triton decay kernels and on the
PyTorch chunk path ("fenced", as session 2 shipped it). The first module whose output is not finite is named.
Then three real training steps of each experiment on the GPU (``train``) print their losses.
"""
import copy
import dataclasses
import time

import torch

from fastweight import dispatch
from fastweight.evaluate import suite
from fastweight.tasks import from_spec
from fastweight.train import build_model, logits_of, masked_loss, train

import sys
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = sys.argv[1] if len(sys.argv) > 1 else "full"
impl = dispatch._lookup("triton", "chunk", "simple_gla")
FENCE = lambda device, K, V: "forced by gpu_mamba2.py" if device.type == "cuda" else None  # noqa: E731


def first_nonfinite(model):
    found = []

    def hook(mod, _inp, out, name=None):
        t = out[0] if isinstance(out, tuple) else out
        if isinstance(t, torch.Tensor) and not found and not torch.isfinite(t).all():
            found.append(name)
    hs = [m.register_forward_hook(lambda mod, i, o, n=n: hook(mod, i, o, n)) for n, m in model.named_modules()]
    return found, hs


def loss_and_grads(model, batch, amp):
    model.zero_grad(set_to_none=True)
    found, hs = first_nonfinite(model)
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=amp and DEV == "cuda"):
        loss = masked_loss(logits_of(model, batch.input_ids), batch)
    loss.backward()
    for h in hs:
        h.remove()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, found[0] if found else None


seen = set()
for exp in suite(SCALE, mixers=["mamba2"]):
    cfg = exp.config
    key = (cfg.n_layers, cfg.task.split(":")[0])
    if key in seen:
        continue
    seen.add(key)
    task = from_spec(cfg.train_specs[0])
    torch.manual_seed(0)
    cpu = build_model(cfg, task.vocab_size)
    batch = task.batch(8, seed=0)
    l_ref, g_ref, _ = loss_and_grads(cpu, batch, amp=False)
    print(f"{exp.label} {cfg.task.split(':')[0]} layers={cfg.n_layers}: cpu fp32 loss {l_ref:.4f}", flush=True)
    gpu = copy.deepcopy(cpu).to(DEV)
    gb = batch.to(DEV)
    for fence in (True, False):
        impl.gpu_unverified = FENCE if fence else (lambda *a: None)  # None: no fence
        for amp in (False, True):
            try:
                l, g, bad = loss_and_grads(gpu, gb, amp)
                gerr = max(((g[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-30)).item() for n in g_ref)
                print(f"  gpu {'bf16' if amp else 'fp32'} {'fenced' if fence else 'triton'}: loss {l:.4f} "
                      f"(cpu {l_ref:.4f}), worst grad rel err {gerr:.1e}, first non-finite: {bad}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"  gpu {'bf16' if amp else 'fp32'} {'fenced' if fence else 'triton'}: FAULT {exc!r}"[:400],
                      flush=True)
    impl.__dict__.pop("gpu_unverified", None)

for exp in suite(SCALE, mixers=["mamba2"], steps=3, out_dir="/tmp/m2dbg"):
    t0 = time.time()
    cfg = dataclasses.replace(exp.config, log_every=1, eval_examples=8)
    res = train(cfg)
    print(f"train {exp.label} {cfg.task.split(':')[0]}: losses {[round(loss, 4) for _, loss in res['curve']]}, "
          f"final {res['final_loss']:.4f} ({time.time() - t0:.0f} s)", flush=True)
