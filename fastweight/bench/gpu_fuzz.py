"""The property fuzz (``fastweight.fuzz``) at realistic shapes on one GPU.

    python -m fastweight.bench.gpu_fuzz [--cases 1000] [--dtypes bf16,fp16,fp32] [--ops OPS] [--modes MODES]
        [--workers W] [--budget SECONDS] [--out DIR] [--device cuda|cpu] [--seed BASE]

Every op (``--ops``, default all 13) gets ``cases / len(ops)`` cases of the Triton backend,
cycling over modes and dtypes, plus one float64 case per mode (served exactly or refused with
a clear ValueError). Shapes come from the "gpu" space (T up to 2048, H up to 8, K and V in
16..256 with two (K, V) pairs per op, so few Triton compilations per op); the truth is the
float64 per-token reference up to 300 tokens, the float64 PyTorch chunk path above (each
result says which). Output buffers are NaN-poisoned.

Each op runs in its own child process, ``--workers`` at a time (Triton compiles on the CPU,
~1 s a kernel, so ops compile in parallel while sharing the GPU; a fault stays in its op's
process). A child starts no new case past ``--budget`` seconds from the start; cases left
are reported as not run. Prints the worst error per op and field against its tolerance and
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
import tempfile
import time

from fastweight import fuzz
from fastweight.ops import OPS


def plan(op: str, cases: int, modes, dtypes, base_seed: int) -> list:
    """(mode, backend, dtype, seed) for one op: the float64 case of each mode, then ``cases``
    Triton cases cycling over modes x dtypes (so a cut by the budget keeps them balanced)."""
    out = [(m, "triton", "fp64", fuzz.case_seed(base_seed, op, m, "fp64", 0)) for m in modes]
    combos = [(m, d) for d in dtypes for m in modes]
    for i in range(max(0, cases - len(out))):
        m, d = combos[i % len(combos)]
        out.append((m, "triton", d, fuzz.case_seed(base_seed, op, m, d, i)))
    return out


def child(args):
    """Run one op's plan, one JSON line per case into ``args.child_out``, until the deadline."""
    if args.device == "cuda":
        import torch
        torch.cuda.set_device(0)
    space = args.space or ("gpu" if args.device == "cuda" else "smoke")
    todo = plan(args.child, args.cases, args.modes.split(","), args.dtypes.split(","), args.seed)
    with open(args.child_out, "a") as f:
        for mode, backend, dtype, seed in todo:
            if time.time() > args.deadline:
                break
            res = fuzz.check(fuzz.draw(space, args.child, seed, mode, backend, dtype), device=args.device)
            f.write(json.dumps(res.to_json()) + "\n")
            f.flush()
            print(res.line(), flush=True)
            if any("CUDA" in p and "error" in p.lower() for p in res.problems):
                print(f"{args.child}: CUDA error, the context is lost: stopping this op", flush=True)
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
    ap.add_argument("--cases", type=int, default=1000, help="cases in all, split evenly over the ops")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--modes", default=",".join(fuzz.MODES))
    ap.add_argument("--workers", type=int, default=0, help="child processes at a time (default: cores - 2)")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds after which no new case starts")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--space", default="", help="case space (default: gpu on cuda, smoke on cpu)")
    ap.add_argument("--seed", type=int, default=20261201, help="base seed of the cases")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.child:
        return child(args)

    start = time.time()
    op_list = [o for o in args.ops.split(",") if o]
    per_op = max(1, -(-args.cases // len(op_list)))
    workers = args.workers or max(1, min(len(op_list), (os.cpu_count() or 4) - 2))
    deadline = start + args.budget
    tmp = tempfile.mkdtemp(prefix="gpu_fuzz_")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    pending, running, logs = list(op_list), {}, {}
    while pending or running:
        while pending and len(running) < workers:
            op = pending.pop(0)
            cmd = [sys.executable, "-m", "fastweight.bench.gpu_fuzz", "--child", op,
                   "--child-out", os.path.join(tmp, f"{op}.jsonl"), "--deadline", str(deadline),
                   "--cases", str(per_op), "--dtypes", args.dtypes, "--modes", args.modes,
                   "--device", args.device, "--seed", str(args.seed)] + (["--space", args.space] if args.space else [])
            logs[op] = open(os.path.join(tmp, f"{op}.log"), "w")
            running[op] = (subprocess.Popen(cmd, stdout=logs[op], stderr=subprocess.STDOUT, env=env), time.time())
        for op, (p, t0) in list(running.items()):
            # a case started just before the deadline may still compile: kill only well past it
            if p.poll() is None and time.time() > deadline + 180:
                p.kill()
                p.wait()
            if p.poll() is not None:
                logs[op].close()
                print(f"[{time.time() - start:5.0f}s] {op}: exit {p.returncode} after {time.time() - t0:.0f}s",
                      flush=True)
                del running[op]
        time.sleep(0.5)

    results, exits, lines = [], {}, []
    for op in op_list:
        path = os.path.join(tmp, f"{op}.jsonl")
        rows = [json.loads(ln) for ln in open(path)] if os.path.exists(path) else []
        results += rows
        with open(os.path.join(tmp, f"{op}.log")) as f:
            log = f.read()
        exits[op] = dict(cases_run=len(rows), cases_planned=len(plan(op, per_op, args.modes.split(","),
                                                                      args.dtypes.split(","), args.seed)),
                         log_tail=log[-3000:])
    failures = [r for r in results if not r["ok"]]
    crashed = [op for op, e in exits.items() if e["cases_run"] == 0]
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
    for op in crashed:
        lines.append(f"{op}: no case ran; log tail:\n{exits[op]['log_tail']}")
    for r in failures:
        c = fuzz.Case(**{**r["case"], "lengths": tuple(r["case"]["lengths"]) if r["case"]["lengths"] else None,
                         "options": tuple(tuple(o) for o in r["case"]["options"])})
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
