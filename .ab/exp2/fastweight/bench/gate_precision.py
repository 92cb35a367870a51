"""The gate gradients' precision in 16 bits, fla's test recipe, for every gated op and mode.

    python -m fastweight.bench.gate_precision [--dtypes fp16,bf16,fp32] [--gates 6,3,1] [--modes chunk,...]
        [--ops OPS] [--device cuda] [--limit 0.005] [--out DIR]

Inputs as the fuzz draws them (``fastweight.fuzz.draw_inputs``), with an initial state and a
loss on both the output and the final state (dense cotangents), and log gates
``-s exp(0.2 n)`` per token (n standard normal, s from ``--gates``), on two shapes: fla's
(B, T, H, K = V) = (1, 64, 2, 64), one full chunk, and (2, 150, 4, 128), a partial last chunk.
The figure is fla's error ratio, ``||x - ref|| / ||ref||`` against the float64 reference
(``fastweight.reference`` through ``backend="reference"``), for each gate gradient, and the
largest over the other gradients for comparison. fla's tests allow 0.005 on the gate
gradients in 16 bits; the command exits 1 if a 16-bit gate ratio exceeds ``--limit``.

``--device cpu`` runs the kernels under TRITON_INTERPRET=1 (fp16/fp32; bf16 is wrong there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

SHAPES = ((1, 64, 2, 64), (2, 150, 4, 128))
# options that pick a neutral variant of each op (the gate passed as the log gate itself)
NEUTRAL = {"use_gate_in_kernel": False, "use_qk_l2norm_in_kernel": False, "allow_neg_eigval": False,
           "gate_parts": "g", "p_is_k": False, "normalize": False}


def case_for(op, mode, dtype, shape, seed):
    from fastweight import fuzz
    B, T, H, K = shape
    base = fuzz.draw("gpu", op, seed, mode, "triton", dtype)
    options = tuple((n, NEUTRAL.get(n, v)) for n, v in base.options)
    return dataclasses.replace(base, B=B, T=T, H=H, HV=H, K=K, V=K, lengths=None, initial_state=True,
                               output_final_state=True, gates="strong", gate_dtype=dtype, scale=None,
                               options=options, do="dense", dS="dense")


def measure(op, mode, dtype, shape, strength, device, seed=0) -> dict:
    """{field: error ratio} of the Triton path in ``dtype`` against the float64 reference."""
    from fastweight import fuzz
    from fastweight.testing import rel_err
    case = case_for(op, mode, dtype, shape, seed)
    x = fuzz.draw_inputs(case)
    gen = torch.Generator().manual_seed(seed + 7)
    for name in fuzz.GATES[op]:
        x[name] = -strength * torch.exp(0.2 * torch.randn(x[name].shape, dtype=torch.float64, generator=gen))
    dts = fuzz.input_dtypes(case, x)
    low = {n: t.to(dts[n]) for n, t in x.items()}
    up = {n: t.double() for n, t in low.items()}
    cot = fuzz.draw_cotangents(case)
    got = fuzz.forward_backward(case, low, "triton", cot, device)
    want = fuzz.forward_backward(case, up, "reference", cot, device)
    return {n: rel_err(got[n].detach(), w.detach()) for n, w in want.items()
            if not n.startswith("_") and w is not None and got.get(n) is not None}


def main(argv=None):
    from fastweight import fuzz
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="fp16,bf16,fp32")
    ap.add_argument("--gates", default="6,3,1", help="gate strengths s: log gates -s exp(0.2 n) per token")
    ap.add_argument("--modes", default="chunk,fused_recurrent")
    ap.add_argument("--ops", default=",".join(fuzz.GATES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--limit", type=float, default=0.005)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    rows, failed = [], []
    print("| op | mode | dtype | shape | gate s | gate grad ratio | other grads (max) |")
    print("|---|---|---|---|---|---|---|")
    for op in args.ops.split(","):
        gate_fields = [f"d{n}" for n in fuzz.GATES[op]]
        for mode in args.modes.split(","):
            if not hasattr(__import__("fastweight.ops", fromlist=["ops"]), f"{mode}_{op}"):
                continue
            for dtype in args.dtypes.split(","):
                for shape in SHAPES:
                    for s in (float(v) for v in args.gates.split(",")):
                        try:
                            err = measure(op, mode, dtype, shape, s, device)
                        except Exception as e:  # noqa: BLE001  (reported, the run goes on)
                            err = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                        row = dict(op=op, mode=mode, dtype=dtype, shape=shape, gate=s, err=err)
                        rows.append(row)
                        if "error" in err:
                            print(f"| {op} | {mode} | {dtype} | {shape} | {s:g} | {err['error']} | |", flush=True)
                            failed.append(row)
                            continue
                        gate = max(err[f] for f in gate_fields)
                        other = max((v for f, v in err.items() if f not in gate_fields), default=0.0)
                        print(f"| {op} | {mode} | {dtype} | {','.join(map(str, shape))} | -{s:g} | {gate:.2e} | "
                              f"{other:.2e} |", flush=True)
                        if dtype in ("fp16", "bf16") and s <= 6 and not gate <= args.limit:
                            failed.append(row)
    for row in failed:
        print(f"FAIL {row['op']} {row['mode']} {row['dtype']} {row['shape']} -{row['gate']:g}: {row['err']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gate_precision.json"), "w") as f:
            json.dump(dict(rows=rows, limit=args.limit, device=str(device)), f, indent=1)
    print(f"{len(rows)} measurements, {len(failed)} over the limit {args.limit} (16-bit gate gradients)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
