"""Context parallelism across the GPUs of one host (``fastweight.context_parallel``): check, then time.

    torchrun --nproc-per-node 4 -m fastweight.bench.gpu_context_parallel [--ops gated_delta_rule,kda]
        [--T 65536] [--B 1] [--H 16] [--K 128] [--out DIR]

One sequence of ``T`` tokens (B sequences with ``--B``) split evenly over the ranks. For each op:

check: on every rank the context-parallel forward and backward in bf16 against one GPU running
the whole stream (rank 0 runs it and broadcasts), relative error of o, the final state and each
gradient, next to the error of that single-GPU run against itself in float32 (what splitting
alone costs is a different summation order);
time:  median ms (``triton.testing.do_bench``, all ranks in step) of the context-parallel forward
and forward+backward on each rank's T / world tokens, next to one GPU running T / world tokens
alone (the compute that scales) and, when it fits, one GPU running all T;
bytes: what the all-gather carries per layer (K V + K or K^2 numbers per value head per rank).

NCCL with NVLink multicast left off (``NCCL_NVLS_ENABLE=0``, set here unless given). Rank 0
prints the table and writes ``DIR/context_parallel.json``. ``--device cpu`` runs it with gloo at a
toy shape (the CI smoke test); the timings are then wall-clock and mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from fastweight import ops
from fastweight.mechanisms import OPS
from fastweight.bench import gpu_decay_dplr, gpu_delta
from fastweight.context_parallel import DIAGONAL, context_parallel
from fastweight.testing import rel_err


def inputs(op, B, T, H, K, dtype, device, seed=0):
    """The op's benchmark inputs (as its single-GPU benchmark draws them), the same on every rank."""
    torch.manual_seed(seed)
    if op in gpu_delta.MECHANISM:
        x = gpu_delta.inputs(op, B, T, H, K, K, dtype, device)
        return x, dict(allow_neg_eigval=True) if OPS[op].neg_eigval else {}
    return gpu_decay_dplr.inputs(op, B, T, H, K, dtype, device=device), {}


def _timer(device):
    if device.type == "cuda":
        import triton

        def cuda(fn):
            dist.barrier()
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        return cuda

    def wall(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    return wall


def run(op, args, device, rank, world):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fn = getattr(ops, f"chunk_{op}")
    T_r = args.T // world
    x, options = inputs(op, args.B, T_r * world, args.H, args.K, dtype, device)
    a, b = rank * T_r, (rank + 1) * T_r
    mine = {n: t[:, a:b].contiguous() if t.dim() >= 2 and t.shape[1] == T_r * world else t for n, t in x.items()}
    row = {"op": op, "world": world, "shape": [args.B, T_r * world, args.H, args.K]}
    # check: the context-parallel run against one device's whole-stream run
    leaves = {n: t.clone().requires_grad_() for n, t in mine.items() if t.is_floating_point()}
    o, S = context_parallel(fn, **leaves, output_final_state=True, **options)
    S = S[0] if isinstance(S, tuple) else S   # linear attention's (S, z): the state S is checked
    torch.manual_seed(1)
    do_full = torch.randn(args.B, T_r * world, *o.shape[2:], device=device, dtype=o.dtype)
    dS = torch.randn(S.shape, device=device, dtype=S.dtype)
    torch.autograd.backward([o, S], [do_full[:, a:b], dS])
    full = {n: t.clone().requires_grad_() for n, t in x.items() if t.is_floating_point()}
    ro, rS = fn(**full, output_final_state=True, **options)
    rS = rS[0] if isinstance(rS, tuple) else rS
    torch.autograd.backward([ro, rS], [do_full, dS])
    err = {"o": rel_err(o, ro[:, a:b]), "final_state": rel_err(S, rS)}
    for n, t in leaves.items():
        want = full[n].grad if t.shape == full[n].shape else full[n].grad[:, a:b]
        got = t.grad.clone()
        if t.shape == full[n].shape:
            dist.all_reduce(got)
        err[f"d{n}"] = rel_err(got, want)
    worst = torch.tensor(list(err.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row["errors"] = dict(zip(err, worst.tolist()))
    # time
    timer = _timer(device)
    grads = list(leaves.values())

    def cp_fwd():
        context_parallel(fn, **mine, output_final_state=True, **options)

    def cp_fwd_bwd():
        for t in grads:
            t.grad = None
        oo, SS = context_parallel(fn, **leaves, output_final_state=True, **options)
        torch.autograd.backward([oo, SS], [do_full[:, a:b], dS])

    def local_fwd_bwd():
        for t in grads:
            t.grad = None
        oo, SS = fn(**leaves, output_final_state=True, **options)
        torch.autograd.backward([oo, SS], [do_full[:, a:b], dS])

    row["cp_fwd_ms"], row["cp_fwd_bwd_ms"] = timer(cp_fwd), timer(cp_fwd_bwd)
    row["local_fwd_bwd_ms"] = timer(local_fwd_bwd)
    HV, V = o.shape[2], o.shape[3]
    per_slot = HV * args.K * (V + (args.K if op not in DIAGONAL else 1))
    row["gather_bytes_per_rank"] = args.B * per_slot * S.element_size()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="gated_delta_rule,kda,simple_gla,rwkv7")
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rows = [run(op, args, device, rank, world) for op in args.ops.split(",")]
    if rank == 0:
        print("| op | world | (B, T, H, K) | cp fwd ms | cp fwd+bwd ms | T/world alone fwd+bwd ms | gather B/rank "
              "| worst err |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            worst = max(r["errors"].items(), key=lambda kv: kv[1])
            print(f"| {r['op']} | {r['world']} | {tuple(r['shape'])} | {r['cp_fwd_ms']:.3f} | {r['cp_fwd_bwd_ms']:.3f} "
                  f"| {r['local_fwd_bwd_ms']:.3f} | {r['gather_bytes_per_rank']} | {worst[1]:.2e} ({worst[0]}) |")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "context_parallel.json"), "w") as f:
                json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
