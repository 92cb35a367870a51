"""Varlen against uniform batches, and short sequences, on the path users get by default.

    python -m fastweight.bench.gpu_varlen [--ops gated_delta_rule,kda,simple_gla,rwkv7] [--shape 4,8192,16,128]
        [--short 8,2048,16,64] [--seed 0]

For each op: the uniform batch (B, T, H, K=V) and one packed batch of the same B*T tokens in
sequences of mixed lengths (``mixed_lengths``: log-uniform in [16, 2T], one of them a single
token), passed as the same ``cu_seqlens`` tensor every call (a model's layers: its host copy is
kept) and as a new one every call (a sync each time), all through ``fastweight.ops.chunk_<op>``
with its defaults (value checks in their default mode, the Triton backend a CUDA tensor gets),
bf16; then the same op at the short shape. Median ms of forward and
forward+backward (``triton.testing.do_bench``), the ratio varlen / uniform (target: within 1.10x),
and at the short shape fla 0.6.0's anchor where ``../shared/anchors`` has one. Writes
$OUT/gpu_varlen.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

# fla 0.6.0 at (8, 2048, 16, 64), bf16, H200 (../shared/anchors/README.md): (fwd ms, fwd+bwd ms)
SHORT_ANCHORS = {"gated_delta_rule": (0.489, 2.487), "rwkv7": (1.024, 3.830)}


def mixed_lengths(total: int, T: int, seed: int = 0) -> list[int]:
    """Sequence lengths summing to ``total``: log-uniform in [16, 2T], the last one cut to fit, and
    a one-token sequence first (the shortest case a packed batch holds)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [1], total - 1
    while left > 0:
        n = int(torch.exp(torch.empty(1).uniform_(2.77, float(torch.log(torch.tensor(2.0 * T))), generator=gen)))
        n = max(1, min(n, left))
        lengths.append(n)
        left -= n
    return lengths


def _inputs(op, B, T, H, K, device):
    """bf16 inputs as the family's own bench draws them (the registry's ``family``)."""
    from fastweight.mechanisms import OPS
    if OPS[op].family == "delta":
        from fastweight.bench.gpu_delta import inputs
        return inputs(op, B, T, H, K, K, torch.bfloat16, device)
    from fastweight.bench.gpu_decay_dplr import inputs
    return inputs(op, B, T, H, K, torch.bfloat16, device=device)


def timing(op, B, T, H, K, cu_seqlens=None, device="cuda", fresh=False):
    """(forward ms, forward+backward ms); ``fresh``: a new ``cu_seqlens`` tensor every call (a
    clone), so each call copies it to the host (a sync), as a training step's first layer does;
    else the same tensor every call, as the model's other layers (its host copy is kept)."""
    import triton

    from fastweight import ops
    x = _inputs(op, B, T, H, K, device)
    fn = getattr(ops, f"chunk_{op}")
    kw = dict(cu_seqlens=cu_seqlens) if cu_seqlens is not None else {}
    if fresh:
        op_fn = fn

        def fn(**a):
            return op_fn(**{**a, "cu_seqlens": a["cu_seqlens"].clone()})
    fwd = triton.testing.do_bench(lambda: fn(**x, **kw), warmup=25, rep=150, return_mode="median")
    leaves = {n: t.clone().requires_grad_(t.is_floating_point()) for n, t in x.items()}
    o = fn(**leaves, **kw)[0]
    do = torch.randn_like(o)
    del o

    def step():
        fn(**leaves, **kw)[0].backward(do)
    fb = triton.testing.do_bench(step, warmup=25, rep=150, grad_to_none=list(leaves.values()), return_mode="median")
    return fwd, fb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="gated_delta_rule,kda,simple_gla,rwkv7")
    ap.add_argument("--shape", default="4,8192,16,128")
    ap.add_argument("--short", default="8,2048,16,64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    B, T, H, K = (int(s) for s in args.shape.split(","))
    lengths = mixed_lengths(B * T, T, args.seed)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    print(f"packed batch: {len(lengths)} sequences, {B * T} tokens, lengths {min(lengths)}..{max(lengths)}, "
          f"median {sorted(lengths)[len(lengths) // 2]}", flush=True)
    rows = []
    for op in args.ops.split(","):
        uni = timing(op, B, T, H, K)
        var = timing(op, 1, B * T, H, K, cu_seqlens=cu)
        var_fresh = timing(op, 1, B * T, H, K, cu_seqlens=cu, fresh=True)
        sB, sT, sH, sK = (int(s) for s in args.short.split(","))
        short = timing(op, sB, sT, sH, sK)
        fla = SHORT_ANCHORS.get(op)
        row = dict(op=op, shape=args.shape, uniform_ms=uni, varlen_ms=var, ratio=[v / u for v, u in zip(var, uni)],
                   varlen_fresh_ms=var_fresh, ratio_fresh=[v / u for v, u in zip(var_fresh, uni)],
                   short_shape=args.short, short_ms=short, short_fla_ms=fla,
                   short_ratio=[s / f for s, f in zip(short, fla)] if fla else None, n_sequences=len(lengths))
        rows.append(row)
        print(f"{op}: uniform {uni[0]:.3f} / {uni[1]:.3f} ms, varlen {var[0]:.3f} / {var[1]:.3f} "
              f"({row['ratio'][0]:.2f}x / {row['ratio'][1]:.2f}x), a new cu_seqlens each call {var_fresh[0]:.3f} / "
              f"{var_fresh[1]:.3f} ({row['ratio_fresh'][0]:.2f}x / {row['ratio_fresh'][1]:.2f}x); "
              f"short {short[0]:.3f} / {short[1]:.3f}"
              + (f" (fla {fla[0]} / {fla[1]}: {row['short_ratio'][0]:.2f}x / {row['short_ratio'][1]:.2f}x)"
                 if fla else ""), flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "gpu_varlen.json"), "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, lengths=lengths,
                               rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
