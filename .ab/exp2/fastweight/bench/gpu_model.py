"""One GPU run for the language model (issue 6): correctness of the model on the kernels, then speed.

    python -m fastweight.bench.gpu_model [--out DIR] [--budget SECONDS] [--smoke]
    TRITON_INTERPRET=1 python -m fastweight.bench.gpu_model --count    (CPU: launches per layer)

1. Correctness (fp32, tiny model): logits on the device (Triton kernels) against the same
   model on the CPU (PyTorch chunk path), and prefill-then-decode against one pass, for
   "gdn,swa" (``--check`` names more patterns).
2. Training throughput (tokens/s of forward + backward + AdamW step, bf16 autocast, fp32
   weights, eager): the 340M "gdn" preset at B=8, T=4096; "gdn,swa" and pure attention
   ("attn") of the same preset at B=2, T=16384; last, "gdn" again under torch.compile, and
   eager "gdn" in the shape of flame's gated_deltanet_340M.json (for a later side by side).
3. Decoding throughput at batch 64 after a 16k-token prompt (prefill by chunk, then one
   token per step from the cache): "gdn", "gdn,swa", "attn" (a batch that does not fit is
   halved, and the row says so).

Parts past ``--budget`` seconds are skipped (and say so). The table is printed last; all
results go to DIR/model.json. ``--smoke`` runs every part at toy sizes (CPU is fine).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from fastweight.models import LMConfig, LanguageModel
from fastweight.testing import rel_err


# the shape of flame's configs/gated_deltanet_340M.json (fla's training repo): 21 layers, 6 heads of
# key dim 256 and value dim 512, SwiGLU 2816, untied embeddings
FLAME_GDN_340M = LMConfig(mixer="gdn", vocab_size=32000, d_model=1024, n_layers=21, n_heads=6, head_dim=256,
                          expand_v=2.0, intermediate_size=2816, tie_embeddings=False)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def check(device, run, mixers, T=100, prefill=70):
    """fp32 tiny models: device vs CPU logits and gradients (the layers' Triton parts, the norm's
    size threshold lowered so that it runs too, against the PyTorch paths on the CPU), and
    prefill/decode vs one pass; the bf16 autocast logits (FlashAttention for SWA) vs the CPU."""
    from fastweight.layers import attention, common
    threshold, common._TRITON_MIN_NUMEL = common._TRITON_MIN_NUMEL, 0
    try:
        _check(device, run, mixers, T, prefill)
    finally:
        common._TRITON_MIN_NUMEL = threshold
    if run.results and run.results[-1].get("part") == "check":
        run.results[-1]["flash_attention"] = str(attention._FLASH_OK)


def _check(device, run, mixers, T, prefill):
    for mixer in mixers:
        torch.manual_seed(0)
        cfg = LMConfig.preset("tiny", mixer=mixer, vocab_size=128, n_layers=3, d_model=128, n_heads=2,
                              window_size=32)
        cpu = LanguageModel(cfg)
        dev = LanguageModel(cfg).to(device)
        dev.load_state_dict(cpu.state_dict())
        ids = torch.randint(0, 128, (2, T))
        with torch.no_grad():
            ref = cpu(ids)
            out = dev(ids.to(device))
            dev.eval()
            cache = dev.new_cache()
            parts = [dev(ids[:, :prefill].to(device), cache=cache)]
            parts += [dev(ids[:, t:t + 1].to(device), cache=cache) for t in range(prefill, T)]
            step = torch.cat(parts, 1)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            low = dev(ids.to(device))
        dev.train()
        ids_grad = ids.to(device)
        loss = torch.nn.functional.cross_entropy(dev(ids_grad).flatten(0, 1), ids_grad.flatten())
        loss.backward()
        torch.nn.functional.cross_entropy(cpu(ids).flatten(0, 1), ids.flatten()).backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in dev.parameters() if p.grad is not None)
        grads = dict(cpu.named_parameters())
        grad_err = max(rel_err(p.grad.cpu(), grads[n].grad) for n, p in dev.named_parameters() if p.grad is not None)
        row = dict(part="check", mixer=mixer, device_vs_cpu=rel_err(out.cpu(), ref),
                   decode_vs_one_pass=rel_err(step, out), bf16_autocast_vs_cpu=rel_err(low.cpu(), ref),
                   grads_vs_cpu=grad_err, grads_finite=grads_finite)
        row["ok"] = (row["device_vs_cpu"] < 1e-4 and row["decode_vs_one_pass"] < 1e-4 and grad_err < 1e-3
                     and grads_finite)
        run.add(row)


def train_throughput(cfg, B, T, device, steps=4, warmup=None, compile=False, profile_dir=None):
    warmup = warmup or (3 if compile else 2)
    torch.manual_seed(0)
    with device:
        model = LanguageModel(cfg)
    forward = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = forward(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else 0.0
    n_params = model.num_parameters()
    out = dict(ms_per_step=1e3 * dt, tokens_per_s=B * T / dt, params_M=n_params / 1e6, peak_GiB=peak,
               loss=float(loss.detach()), warmup_s=warmup_s)
    if profile_dir is not None and not compile:
        out.update(profile_steps(step, 1, device, os.path.join(profile_dir, f"train_{cfg.mixer.replace(',', '_')}.txt")))
    return out


@torch.no_grad()
def decode_throughput(cfg, B, prompt, device, steps=32, prefill_chunk=None, profile_dir=None):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        model = LanguageModel(cfg).to(dtype=dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (B, prompt), device=device)
    cache = model.new_cache()
    sync(device)
    t0 = time.perf_counter()
    prefill_chunk = prefill_chunk or prompt
    for s in range(0, prompt, prefill_chunk):
        logits = model(ids[:, s:s + prefill_chunk], cache=cache, logits_to_keep=1)
    sync(device)
    prefill_s = time.perf_counter() - t0
    token = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(2):
        token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    out = dict(prefill_s=prefill_s, ms_per_step=1e3 * dt, tokens_per_s=B / dt, cache_GiB=cache.nbytes() / 2 ** 30)
    if profile_dir is not None:
        def step():
            nonlocal token
            token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
        out.update(profile_steps(step, 4, device, os.path.join(profile_dir, f"decode_{cfg.mixer.replace(',', '_')}.txt")))
    return out


def profile_steps(step, n, device, path):
    """torch.profiler over ``n`` calls of ``step``: GPU busy time and kernel launches per call, and the
    tables (by device time, by CPU time) written to ``path``. On the CPU: nothing."""
    if device.type != "cuda":
        return {}
    try:
        return _profile_steps(step, n, device, path)
    except Exception as e:  # noqa: BLE001 (the throughput row stands without its profile)
        return dict(profile_error=f"{type(e).__name__}: {str(e)[:200]}")


def _profile_steps(step, n, device, path):
    from torch.profiler import ProfilerActivity, profile
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        sync(device)
    events = prof.key_averages()
    dev_time = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    gpu_us = sum(dev_time(e) for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    # an averaged event is named by ``key`` (torch 2.11's FunctionEventAvg has no ``name``)
    launches = sum(e.count for e in events if getattr(e, "key", getattr(e, "name", None)) in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                         "cudaLaunchKernelExC", "cudaMemcpyAsync"))
    with open(path, "w") as f:
        f.write(f"{n} calls\n")
        f.write(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
        f.write("\n")
        f.write(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
    return dict(gpu_busy_ms_per_step=gpu_us / 1e3 / n, launches_per_step=launches / n)


VIEW_OPS = {"view", "reshape", "slice", "select", "transpose", "t", "unsqueeze", "squeeze", "expand", "as_strided",
            "unflatten", "flatten", "detach", "alias", "permute", "split", "chunk", "narrow", "unbind", "empty",
            "empty_like", "new_empty", "empty_strided", "new_empty_strided", "resize_", "set_", "lift_fresh",
            "_reshape_alias", "contiguous", "to", "_unsafe_view", "expand_as", "view_as", "split_with_sizes",
            "diagonal", "movedim", "is_nonzero", "item", "_local_scalar_dense", "unfold", "conj", "resolve_conj",
            "resolve_neg"}


def count_launches(mixers=("gdn", "swa", "attn")):
    """Kernel launches per layer on the GPU code paths, counted on the CPU (TRITON_INTERPRET=1,
    ``use_backend("triton")``, the Triton norm threshold at 0, flash stood in for): leaf aten ops
    that are not views, plus Triton launches (stubbed: counted, not run). One training step
    (forward + backward) of a tiny 2-layer model, and one decode step after a prompt."""
    import collections

    import triton.runtime.interpreter as interp
    from torch.profiler import ProfilerActivity, profile

    from fastweight.layers import attention, common, use_backend
    launches = collections.Counter()
    interp.InterpretedFunction.run = lambda self, *a, **k: launches.update([self.fn.__name__])

    class Flash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            launches.update(["flash_fwd"])
            return torch.empty_like(q)

        @staticmethod
        def backward(ctx, do):
            launches.update(["flash_bwd"])
            return None, None, None

    attention.flash_usable = lambda q: True
    attention.flash = lambda q, k, v, window: Flash.apply(q, k, v)

    def count(fn):
        fn()
        launches.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        events = [e for e in prof.events() if e.name.startswith("aten::")]
        parents = {e.cpu_parent.id for e in events if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")}
        aten = sum(1 for e in events if e.id not in parents and e.name[6:] not in VIEW_OPS)
        return aten, sum(launches.values())

    rows = []
    for mixer in mixers:
        torch.manual_seed(0)
        model = LanguageModel(LMConfig.preset("tiny", mixer=mixer, n_layers=2, d_model=64, n_heads=2, window_size=16))
        ids = torch.randint(0, model.cfg.vocab_size, (2, 64))
        with use_backend("triton"):
            common._TRITON_MIN_NUMEL = 0
            def train_step():
                model.zero_grad(set_to_none=True)
                model(ids).float().pow(2).mean().backward()
            train = count(train_step)
            common._TRITON_MIN_NUMEL = 1 << 20
            model.eval()
            with torch.no_grad():
                cache = model.new_cache()
                model(ids, cache=cache)
                decode = count(lambda: model(ids[:, :1], cache=cache))
        rows.append(dict(mixer=mixer, train_aten=train[0] / 2, train_triton=train[1] / 2, decode_aten=decode[0] / 2,
                         decode_triton=decode[1] / 2))
        print(rows[-1], flush=True)
    return rows


class Run:
    """The results so far, saved to ``out/model.json`` after every part (a killed run keeps them)."""

    def __init__(self, out: str, budget: float, device: torch.device):
        self.out, self.budget, self.start, self.results = out, budget, time.perf_counter(), []
        self.env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        torch=torch.__version__)
        try:
            import triton
            self.env["triton"] = triton.__version__
        except ImportError:
            pass
        os.makedirs(out, exist_ok=True)

    def add(self, row: dict) -> None:
        row["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        self.results.append(row)
        print(row, flush=True)
        with open(os.path.join(self.out, "model.json"), "w") as f:
            json.dump(dict(env=self.env, results=self.results), f, indent=1)

    def part(self, name: str, fn, **meta) -> dict:
        """Run ``fn`` unless past the budget; a part that fails is recorded and the others still run."""
        if time.perf_counter() - self.start > self.budget:
            row = dict(part=name, **meta, skipped=f"past the {self.budget:.0f} s budget")
        else:
            try:
                row = dict(part=name, **meta, **fn())
            except torch.cuda.OutOfMemoryError as e:
                row = dict(part=name, **meta, error=f"out of memory: {str(e)[:120]}")
            except Exception as e:
                row = dict(part=name, **meta, error=f"{type(e).__name__}: {str(e)[:300]}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        self.add(row)
        return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=110.0)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, any device")
    parser.add_argument("--check", default="gdn,swa", help="patterns to check, separated by ';'")
    parser.add_argument("--count", action="store_true",
                        help="only count kernel launches per layer on the CPU (run with TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.count:
        count_launches()
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = Run(args.out, args.budget, device)
    try:
        check(device, run, args.check.split(";"), *((24, 17) if args.smoke else (100, 70)))
    except Exception as e:
        run.add(dict(part="check", mixer=args.check, error=f"{type(e).__name__}: {str(e)[:300]}"))
    if args.smoke:
        base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=2, window_size=16)
        train = [("gdn", 2, 64), ("gdn,swa", 1, 128), ("attn", 1, 128)]
        decode = (4, 64)
        preset = lambda mixer: LMConfig(mixer=mixer, **base)  # noqa: E731
    else:
        train = [("gdn", 8, 4096), ("gdn,swa", 2, 16384), ("attn", 2, 16384)]
        decode = (64, 16384)
        preset = lambda mixer: LMConfig.preset("340M", mixer=mixer)  # noqa: E731
    for mixer, B, T in train:
        run.part("train", lambda: train_throughput(preset(mixer), B, T, device, profile_dir=args.out), mixer=mixer,
                 B=B, T=T, compiled=False)
    for mixer in ("gdn", "gdn,swa", "attn"):
        B, P = decode
        # out of memory: halve the batch and say so
        while "out of memory" in run.part("decode", lambda: decode_throughput(preset(mixer), B, P, device,
                                                                             profile_dir=args.out),
                                          mixer=mixer, B=B, prompt=P).get("error", "") and B >= 16:
            B //= 2
    if not args.smoke:
        B, T = train[0][1:]
        run.part("train", lambda: train_throughput(preset("gdn"), B, T, device, compile=True), mixer="gdn", B=B,
                 T=T, compiled=True)
        run.part("train", lambda: train_throughput(FLAME_GDN_340M, B, T, device), mixer="gdn (flame cfg)", B=B,
                 T=T, compiled=False)
    env, results = run.env, run.results
    print(f"\n{env}")
    print(f"{'part':7} {'mixer':16} {'shape':14} {'ms/step':>9} {'tokens/s':>11}  note")
    for r in results:
        if r["part"] == "check" and "error" in r:
            print(f"check   {r['mixer']:16} {'':14} {'':>9} {'':>11}  {r['error']}")
            continue
        if r["part"] == "check":
            print(f"check   {r['mixer']:16} {'':14} {'':>9} {'':>11}  device/cpu {r['device_vs_cpu']:.1e}  "
                  f"decode/one-pass {r['decode_vs_one_pass']:.1e}  bf16/cpu {r['bf16_autocast_vs_cpu']:.1e}  "
                  f"grads/cpu {r['grads_vs_cpu']:.1e}  "
                  f"{'ok' if r['ok'] else 'FAIL'}")
            continue
        shape = f"{r['B']}x{r.get('T', r.get('prompt'))}"
        if "skipped" in r or "error" in r:
            print(f"{r['part']:7} {r['mixer']:16} {shape:14} {'':>9} {'':>11}  {r.get('skipped') or r.get('error')}")
            continue
        note = (f"{r['params_M']:.0f}M params, peak {r['peak_GiB']:.1f} GiB, warmup {r['warmup_s']:.0f} s"
                + (", compiled" if r["compiled"] else "") if r["part"] == "train"
                else f"prefill {r['prefill_s']:.1f} s, cache {r['cache_GiB']:.2f} GiB")
        if "gpu_busy_ms_per_step" in r:
            note += f", GPU busy {r['gpu_busy_ms_per_step']:.1f} ms, {r['launches_per_step']:.0f} launches"
        print(f"{r['part']:7} {r['mixer']:16} {shape:14} {r['ms_per_step']:9.1f} {r['tokens_per_s']:11.0f}  {note}")


if __name__ == "__main__":
    main()
