"""Where the peak memory of one forward+backward goes, by the line that allocated each live block.

    python -m fastweight.bench.gpu_memory [--op rwkv7] [--shape 8,16384,64,64] [--top 25]

Runs ``ops.chunk_<op>`` (bf16, the Triton backend, the inputs of ``gpu_decay_dplr.inputs``) once
to warm up, then once with the CUDA caching allocator's history recorded
(``torch.cuda.memory._record_memory_history``). Replaying the trace's allocations and frees
gives the moment of the peak and the blocks live at it; each block is charged to the innermost
frame inside ``fastweight`` (else the innermost frame). Prints the peak, the inputs' and the
output gradient's share, and the top lines by GiB; writes $OUT/gpu_memory_<op>.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch

from fastweight import ops
from fastweight.bench.gpu_decay_dplr import inputs


def _site(frames) -> str:
    for f in frames:
        if "fastweight" in f["filename"] and "bench" not in f["filename"]:
            return f"{f['filename'].split('fastweight/')[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def peak_by_site(trace) -> tuple[int, dict]:
    """(peak bytes, {site: bytes live at the peak}) from the allocator's device trace."""
    live, total, best, at_best = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames", [])))
            total += e["size"]
            if total > best:
                best, at_best = total, dict(live)
        elif e["action"] in ("free_requested", "free") and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    sites = defaultdict(int)
    for size, site in at_best.values():
        sites[site] += size
    return best, dict(sites)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="rwkv7")
    ap.add_argument("--shape", default="8,16384,64,64")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    B, T, H, K = (int(s) for s in args.shape.split(","))
    x = {n: t.requires_grad_(True) for n, t in inputs(args.op, B, T, H, K, torch.bfloat16).items()}
    fn = getattr(ops, f"chunk_{args.op}")
    o = fn(**x, backend="triton")[0]
    do = torch.randn_like(o)
    o.backward(do)
    del o
    for t in x.values():
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    o = fn(**x, backend="triton")[0]
    o.backward(do)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [e for dev in snap["device_traces"] for e in dev]
    peak, sites = peak_by_site(trace)
    gib = 2 ** 30
    held = sum(t.numel() * t.element_size() for t in x.values()) + do.numel() * do.element_size()
    print(f"{args.op} {args.shape} bf16: max_memory_allocated {torch.cuda.max_memory_allocated() / gib:.2f} GiB; "
          f"allocated before the call (inputs, do) {held / gib:.2f} GiB; peak of the traced call "
          f"{peak / gib:.2f} GiB on top")
    rows = sorted(sites.items(), key=lambda kv: -kv[1])
    for site, size in rows[:args.top]:
        print(f"  {size / gib:7.2f} GiB  {site}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_memory_{args.op}.json"), "w") as f:
            json.dump(dict(op=args.op, shape=args.shape, peak_gib=peak / gib, before_gib=held / gib,
                           sites={s: n / gib for s, n in rows}), f, indent=1)


if __name__ == "__main__":
    main()
