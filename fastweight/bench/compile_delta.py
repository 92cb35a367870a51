"""Compile every Triton kernel the delta family's ops launch, for an H100/H200 (sm_90), on a machine
without a GPU: a check before spending GPU time (it catches what the interpreter lets through,
e.g. a global read inside a kernel, or a layout the GPU compiler refuses).

    python -m fastweight.bench.compile_delta [--ops gated_delta_rule,kda] [--dtype bf16]

The ops run on CPU tensors with every launch replaced by ``triton.compile`` of the kernel as
launched (same constexprs, num_warps, num_stages); nothing runs, so values are garbage and only
compilation is checked. Do not set TRITON_INTERPRET. Prints one line per distinct kernel.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
          torch.int32: "i32"}
_seen: dict = {}
failures: list = []


def _compile_instead(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for param in self.params:
        value = bound.arguments[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
        else:
            signature[param.name] = "fp32"
    key = (self.fn.__name__, tuple(sorted(signature.items())), repr(sorted(constexprs.items(), key=str)),
           tuple(sorted(options.items())))
    if key in _seen:
        return None
    t0 = time.time()
    try:
        triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs), target=TARGET,
                       options=options)
        status = "ok"
    except Exception as e:  # noqa: BLE001  (report every kernel, then fail at the end)
        status = f"FAILED: {str(e).strip().splitlines()[-1][:300]}"
        failures.append((self.fn.__name__, status))
    flags = ", ".join(f"{k}={v}" for k, v in constexprs.items() if isinstance(v, bool) and v)
    print(f"{self.fn.__name__:26s} {flags[:60]:60s} {status} [{time.time() - t0:.1f}s]", flush=True)
    _seen[key] = status
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="gated_delta_rule,delta_rule,kda,comba,longhorn")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    JITFunction.run = _compile_instead
    import fastweight.kernels as kernels
    from fastweight.bench.gpu_delta import inputs
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    for op in args.ops.split(","):
        for cu in (None, torch.tensor([0, 100, 256])):
            B = 2 if cu is None else 1
            x = {n: t.requires_grad_() for n, t in inputs(op, B, 256 // B, 2, 128, 128, dtype, "cpu").items()}
            h0 = torch.zeros(B if cu is None else 2, 2, 128, 128, requires_grad=True)
            o, ht = getattr(kernels, f"chunk_{op}")(**x, scale=0.1, initial_state=h0, output_final_state=True,
                                                     cu_seqlens=cu)
            (o.float().sum() + ht.sum()).backward()
        if op in ("gated_delta_rule", "kda"):
            x = inputs(op, 2, 128, 2, 128, 128, dtype, "cpu")
            size = 2 * 128 if op == "kda" else 2
            getattr(kernels, f"chunk_{op}")(**x, scale=0.1, use_gate_in_kernel=True, A_log=torch.zeros(2),
                                            dt_bias=torch.zeros(size))
    print(f"{len(_seen)} kernels compiled for sm_90, {len(failures)} failed")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
