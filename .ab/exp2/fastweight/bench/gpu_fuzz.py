"""The property fuzz (``fastweight.fuzz``) at realistic shapes on one GPU.

    python -m fastweight.bench.gpu_fuzz [--cases 1100] [--dtypes bf16,fp16,fp32] [--ops OPS] [--modes MODES]
        [--backend triton|torch] [--workers W] [--budget SECONDS] [--grace SECONDS] [--out DIR] [--device cuda|cpu] [--seed BASE]

The cases (``--cases`` planned in all) are split evenly over (op, dtype, mode) for every op of
``--ops`` (default all 13), dtype of ``--dtypes`` and mode, Triton backend; each op also gets
one float64 case per mode (served exactly or refused with a clear ValueError). Shapes come
from the "gpu" space (T up to 2048, H up to 8, K and V in 16..256, two (K, V) pairs per op, the
kernel-selecting fields from a few profiles per (op, mode, dtype): few Triton compilations); the
truth is the float64 per-token reference up to 256 tokens, the float64 PyTorch chunk path above
(each result says which). Output buffers are NaN-poisoned.

Each (op, dtype, mode) runs in its own child process, ``--workers`` at a time, the slowest to
compile first (Triton compiles on the CPU, ~1 s a kernel and ten times that for the fp32 WY/DPLR
kernels, so children compile in parallel while sharing the GPU; a fault stays in its process).
A child starts no new case past ``--budget`` seconds from the start (its first case it always
runs) and is killed ``--grace``
seconds later (its finished cases count; each child writes DIR/gpu_fuzz_children/); the summary says how many
of the planned cases ran. Prints the worst error per op and field against its tolerance and
every failure with its repro line, writes DIR/gpu_fuzz.json, exits 1 on any failure.

``--device cpu`` (TRITON_INTERPRET=1, the tiny "smoke" space, fp32/fp16 only: bf16 is wrong
in the interpreter) is the CPU smoke test of this command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from fastweight import fuzz
from fastweight.mechanisms import get_op
from fastweight.ops import OPS


# ops whose chunk kernels (WY / DPLR stages) compile slowest: their children start first
HEAVY = tuple(name for name in OPS if get_op(name).wy)


def plan(op: str, dtype: str, mode: str, cases: int, base_seed: int, float64: bool, backend="triton") -> list:
    """(mode, backend, dtype, seed) of one child: with ``float64`` the float64 case first."""
    out = [(mode, backend, "fp64", fuzz.case_seed(base_seed, op, mode, "fp64", 0))] if float64 else []
    out += [(mode, backend, dtype, fuzz.case_seed(base_seed, op, mode, dtype, i)) for i in range(cases - len(out))]
    return out


def child(args):
    """Run one op's plan, one JSON line per case into ``args.child_out``, until the deadline."""
    if args.device == "cuda":
        import torch
        torch.cuda.set_device(0)
    space = args.space or ("gpu" if args.device == "cuda" else "smoke")
    op, dtype, mode = args.child.split("/")
    todo = plan(op, dtype, mode, args.cases, args.seed, float64=args.float64, backend=args.backend)
    with open(args.child_out, "a") as f:
        for i, (mode, backend, dtype, seed) in enumerate(todo):
            # every child runs its first case, so that each (op, dtype, mode) is covered
            if i and time.time() > args.deadline:
                break
            res = fuzz.check(fuzz.draw(space, op, seed, mode, backend, dtype), device=args.device)
            f.write(json.dumps(res.to_json()) + "\n")
            f.flush()
            print(res.line(), flush=True)
            if any("CUDA" in p and "error" in p.lower() for p in res.problems):
                print(f"{args.child}: CUDA error, the context is lost: stopping", flush=True)
                break


def worst_table(results: list) -> dict:
    """(op, field) -> the row with the largest err / tol, and the seed and mode/dtype of its case."""
    worst = {}
    for r in results:
        c = r["case"]
        for name, row in r["rows"].items():
            key = f"{c['op']}/{name}"
            ratio = row["err"] / max(row["tol"], 1e-300)
            if key not in worst or ratio > worst[key]["ratio"]:
                worst[key] = dict(row, ratio=ratio, seed=c["seed"], mode=c["mode"], dtype=c["dtype"])
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1100, help="cases planned in all, split evenly over "
                    "(op, dtype, mode); the budget cuts the chunk fp32 ones of the delta/DPLR ops short")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--modes", default=",".join(fuzz.MODES))
    ap.add_argument("--workers", type=int, default=0, help="child processes at a time (default: one a core)")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds after which no new case starts")
    ap.add_argument("--grace", type=float, default=60.0, help="seconds past the budget after which a child "
                    "still running (a case compiling) is killed; its finished cases count")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"),
                    help="torch: the PyTorch chunk path (its float32 errors set fuzz.FP32_RTOL)")
    ap.add_argument("--space", default="", help="case space (default: gpu on cuda, smoke on cpu)")
    ap.add_argument("--seed", type=int, default=20261201, help="base seed of the cases")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--float64", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.child:
        return child(args)

    start = time.time()
    op_list = [o for o in args.ops.split(",") if o]
    dtypes, modes = args.dtypes.split(","), args.modes.split(",")
    # one child per (op, dtype, mode), the slowest to compile first: chunk fp32 of HEAVY, then HEAVY
    children = sorted(((op, d, m) for op in op_list for d in dtypes for m in modes),
                      key=lambda c: (c[2] != "chunk" or c[1] != "fp32", c[0] not in HEAVY, op_list.index(c[0])))
    per_child = max(1, -(-args.cases // len(children)))
    plans = {c: plan(*c, per_child, args.seed, float64=c[1] == dtypes[0], backend=args.backend) for c in children}
    # compiling is CPU-bound and each child mostly compiles or waits on the GPU: 1.5 children a core
    workers = args.workers or max(1, min(len(children), 3 * (os.cpu_count() or 4) // 2))
    deadline = start + args.budget
    # the children's files go under DIR, so that what ran survives even if this process is killed
    tmp = os.path.join(args.out, "gpu_fuzz_children")
    os.makedirs(tmp, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    name = lambda c: "-".join(c)  # noqa: E731
    pending, running, logs = list(children), {}, {}
    while pending or running:
        while pending and len(running) < workers:
            c = pending.pop(0)
            cmd = [sys.executable, "-m", "fastweight.bench.gpu_fuzz", "--child", "/".join(c),
                   "--child-out", os.path.join(tmp, f"{name(c)}.jsonl"), "--deadline", str(deadline),
                   "--cases", str(per_child), "--device", args.device,
                   "--seed", str(args.seed), "--backend", args.backend] + \
                (["--space", args.space] if args.space else []) + \
                (["--float64"] if c[1] == dtypes[0] else [])
            logs[c] = open(os.path.join(tmp, f"{name(c)}.log"), "w")
            running[c] = (subprocess.Popen(cmd, stdout=logs[c], stderr=subprocess.STDOUT, env=env), time.time())
        for c, (p, t0) in list(running.items()):
            # a case started just before the deadline may still compile: kill only well past it
            if p.poll() is None and time.time() > deadline + args.grace:
                p.kill()
                p.wait()
            if p.poll() is not None:
                logs[c].close()
                print(f"[{time.time() - start:5.0f}s] {name(c)}: exit {p.returncode} after {time.time() - t0:.0f}s",
                      flush=True)
                del running[c]
        time.sleep(0.5)

    results, exits, lines = [], {}, []
    for c in children:
        path = os.path.join(tmp, f"{name(c)}.jsonl")
        rows = [json.loads(ln) for ln in open(path)] if os.path.exists(path) else []
        results += rows
        with open(os.path.join(tmp, f"{name(c)}.log")) as f:
            log = f.read()
        exits[name(c)] = dict(cases_run=len(rows), cases_planned=len(plans[c]), log_tail=log[-3000:])
    failures = [r for r in results if not r["ok"]]
    crashed = [c for c, e in exits.items() if e["cases_run"] == 0]
    worst = worst_table(results)
    lines.append(f"{'op/field':32s} {'worst err':>10s} {'tol':>9s} {'err/tol':>8s}  case")
    for key, w in sorted(worst.items()):
        lines.append(f"{key:32s} {w['err']:10.2e} {w['tol']:9.1e} {w['ratio']:8.2f}  {w['mode']} {w['dtype']} "
                     f"seed {w['seed']}{'' if w['ratio'] <= 1 else '  FAIL'}")
    truths = {t: sum(r["truth"] == t for r in results) for t in ("reference", "torch")}
    refused = sum(bool(r["refused"]) for r in results)
    lines.append(f"cases run {len(results)} (planned {sum(e['cases_planned'] for e in exits.values())}), failed "
                 f"{len(failures)}, float64 refused {refused}; truth: {truths['reference']} reference, "
                 f"{truths['torch']} torch float64; {time.time() - start:.0f} s")
    for c in crashed:
        lines.append(f"{c}: no case ran; log tail:\n{exits[c]['log_tail']}")
    for r in failures:
        c = fuzz.Case.from_json(r["case"])
        lines.append(f"FAIL {c.describe()} [truth {r['truth']}]: " + "; ".join(
            r["problems"] + [f"{n} {row['err']:.3g} > {row['tol']:.3g}" for n, row in r["rows"].items()
                             if not row["ok"]]) + f"\n     repro: {r['repro']}")
    print("\n".join(lines))
    meta = dict(args=vars(args), seconds=time.time() - start, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    try:
        import torch
        import triton
        meta.update(torch=torch.__version__, triton=triton.__version__,
                    device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (TRITON_INTERPRET=1)")
    except Exception:  # noqa: BLE001  (the summary is written either way)
        pass
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_fuzz.json"), "w") as f:
        json.dump(dict(meta=meta, ops=exits, worst=worst, failures=[r["repro"] for r in failures],
                       results=results), f, indent=1)
    return 1 if failures or crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
