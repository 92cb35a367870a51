"""Ad-hoc GPU diagnostics (run on the device): python scripts/gpu_debug.py {simple_gla,mamba2,profile OP SHAPE}."""
import sys
import time

import torch
import torch.nn.functional as F

from fastweight import ops


def simple_gla(B=32, T=512, H=4, K=64, V=64, dtype=torch.bfloat16):
    c, b = (torch.randn(B, T, K, device="cuda", dtype=dtype) for _ in range(2))
    q = c[:, :, None].expand(B, T, H, K).requires_grad_(False)
    k = b[:, :, None].expand(B, T, H, K)
    v = torch.randn(B, T, H, V, device="cuda", dtype=dtype, requires_grad=True)
    g = (-torch.rand(B, T, H, device="cuda") * 0.5).requires_grad_()
    qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    o, _ = ops.chunk_simple_gla(qq, kk, v, g, scale=1.0, backend="triton")
    o.float().pow(2).sum().backward()
    torch.cuda.synchronize()
    print("simple_gla", (B, T, H, K, V), "ok", flush=True)


def mamba2(steps=3):
    from fastweight.evaluate import run, suite
    exps = suite("full", mixers=["mamba2"], groups=("retrieval",), steps=steps, eval_examples=8,
                 out_dir="/tmp/dbg")
    run(exps[:1])
    print("mamba2 train ok", flush=True)


def profile(op, shape):
    from fastweight.bench.gpu_decay_dplr import SHAPES, inputs
    B, T, H, K = SHAPES[shape]
    x = inputs(op, B, T, H, K, torch.bfloat16)
    for t in x.values():
        if t.is_floating_point():
            t.requires_grad_()
    fn = getattr(ops, f"chunk_{op}")

    def step():
        o, _ = fn(**x, backend="triton")
        o.backward(torch.randn_like(o))
    step(); step(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)


def model(mixer="gdn,swa", B=2, T=16384):
    """Per-kernel CUDA time of one training step of the 340M preset (bf16 autocast), then of one
    decode step at batch 64 after a 2k prompt."""
    from fastweight.models import LanguageModel, LMConfig
    cfg = LMConfig.preset("340M", mixer=mixer)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = LanguageModel(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step(); step(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60), flush=True)
    del opt
    m.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        prompt = torch.randint(0, cfg.vocab_size, (64, 2048), device="cuda")
        out = m.generate(prompt, max_new_tokens=4) if hasattr(m, "generate") else None
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.time()
            out = m.generate(prompt, max_new_tokens=8)
            torch.cuda.synchronize()
        print("generate 8 tokens after 2k prompt, B=64:", time.time() - t0, "s", flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    what = sys.argv[1]
    t0 = time.time()
    if what == "simple_gla" and len(sys.argv) > 2:
        V, dt = int(sys.argv[2]), getattr(torch, sys.argv[3])
        simple_gla(B=32, T=512, H=16, K=64, V=V, dtype=dt)
    elif what == "profile":
        profile(sys.argv[2], sys.argv[3])
    else:
        globals()[what]()
    print(f"{what}: {time.time() - t0:.1f} s", flush=True)
