"""Registers, spills and shared memory of a Triton kernel compiled for the H200 (sm_90a), on a
machine without a GPU: triton.compile to PTX, then the ptxas bundled with triton, ``-v``.

    python scripts/ptxas_report.py MODULE.KERNEL NAME=VALUE ... [--warps 4,8] [--stages 1,2]
        [--bf16 q,k,v] [--i64 cu_seqlens] [--i32 chunk_indices] [--i8 wide] [--fp32 scale]

Every NAME=VALUE is a constexpr (ints, floats, True/False, or strings such as tf32); the other
arguments are pointers, fp32 unless listed by --bf16 / --i64 / --i32 / --i8, except the scalars
given by --fp32. Example (session 4, the fused DPLR backward at K = V = 64):

    python scripts/ptxas_report.py dplr_bwd.dplr_bwd_kernel H=16 K=64 V=64 BT=64 BC=16 BK=32 BV=64 \\
        DOT_PRECISION=tf32 DIAG_PRECISION=tf32 SPAN=40.0 --warps 4,8 \\
        --bf16 q,k,v,a,b,w,u,ut,h,do,dq,dk,dv,da,db

What it told us there: every variant of that kernel uses 255 registers and spills; time on the
GPU did not follow the spill counts (docs/bench/decay_dplr.md, session 4), so this is a first
look, not a substitute for timing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _value(text):
    if text in ("True", "False"):
        return text == "True"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def report(fn, const, types, warps, stages):
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types.get(n, "*fp32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    info = [line.split(":", 1)[-1].strip() for line in out.stderr.splitlines() if "registers" in line or "spill" in line]
    return f"{warps} warps {stages} stages: shared {kernel.metadata.shared} B | " + " | ".join(info)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", help="module.kernel inside fastweight.kernels")
    ap.add_argument("const", nargs="*", help="constexprs NAME=VALUE")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1")
    for kind in ("bf16", "i64", "i32", "i8", "fp32"):
        ap.add_argument(f"--{kind}", default="")
    args = ap.parse_args()
    module, name = args.kernel.rsplit(".", 1)
    fn = getattr(importlib.import_module(f"fastweight.kernels.{module}"), name)
    const = dict((kv.split("=", 1)[0], _value(kv.split("=", 1)[1])) for kv in args.const)
    types = {"cu_seqlens": "*i64", "chunk_indices": "*i32", "scale": "fp32"}
    for kind, sig in (("bf16", "*bf16"), ("i64", "*i64"), ("i32", "*i32"), ("i8", "*i8"), ("fp32", "fp32")):
        types.update({n: sig for n in getattr(args, kind).split(",") if n})
    for warps in (int(w) for w in args.warps.split(",")):
        for stages in (int(s) for s in args.stages.split(",")):
            print(f"{args.kernel} {' '.join(args.const)}: {report(fn, const, types, warps, stages)}", flush=True)


if __name__ == "__main__":
    main()
