"""Compile every Triton kernel an op launches, for an H100/H200 (sm_90), on a machine without a GPU:
a check before spending GPU time (it catches what the interpreter lets through, e.g. a global
read inside a kernel, or a layout the GPU compiler refuses), with each kernel's registers and
stack (register spill, bytes a thread: ``cuobjdump -res-usage``), which a kernel change can be
compared on before it is timed.

    python -m fastweight.bench.compile_delta [--ops gated_delta_rule,kda] [--dtype bf16]
    python -m fastweight.bench.compile_delta --ops rwkv7,dplr_delta_rule --heads 64x64,128x128
    python -m fastweight.bench.compile_delta --ops rwkv7 --heads 128x128 --dtype fp32 --kernels state_fwd_kernel
    python -m fastweight.bench.compile_delta --ops rwkv7 --heads 64x64 --kernels dplr_bwd_kernel --sass DIR
    python -m fastweight.bench.compile_delta --ops rwkv7 --heads 64x64 --launch solve_wy=1 --no-grad

The ops run on CPU tensors with every launch replaced by ``triton.compile`` of the kernel as
launched (same constexprs, num_warps, num_stages); nothing runs, so values are garbage and only
compilation is checked. Do not set TRITON_INTERPRET. Prints one line per distinct kernel.
``--sass DIR``: each kernel's SASS as well, without addresses and encodings, in DIR (one file per
kernel, named by its line's order) and its md5 on the line: two trees whose md5s agree run the
same machine code, so a refactor can be shown not to touch a timed kernel without a GPU. The line
also gives the instruction counts of the kernel's loops (``loop_bodies``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import itertools
import os
import re
import subprocess
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction, native_specialize_impl

from fastweight.mechanisms import OPS

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)
SHARED_LIMIT = 232448  # bytes of shared memory a block may have on an H100/H200
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
          torch.int32: "i32"}
_seen: dict = {}
failures: list = []
only: set = set()  # kernel names to compile (--kernels); empty: every one
sass_dir: list = []  # --sass: the folder the SASS goes to


def _compile_instead(self, *args, grid, warmup, **kwargs):
    if only and self.fn.__name__ not in only:
        return None
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    # the launcher's own specialisation: 16-divisible ints and 16-aligned pointers get tt.divisibility,
    # which turns on cp.async pipelining and with it most of a kernel's shared memory
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(self.params):
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BACKEND, value, param.is_const, not param.do_not_specialize,
                                          not param.do_not_specialize_on_alignment)
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = spec
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = BACKEND.parse_attr(spec)
    key = (self.fn.__name__, tuple(sorted(signature.items())), repr(sorted(constexprs.items(), key=str)),
           repr(sorted(attrs.items())), tuple(sorted(options.items())))
    if key in _seen:
        return None
    t0 = time.time()
    try:
        compiled = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=TARGET, options=options)
        shared = compiled.metadata.shared
        status = f"ok, {shared} B shared, {resources(compiled.asm['cubin'])}"
        if sass_dir:
            status += f", sass {sass(compiled.asm['cubin'], self.fn.__name__)}"
        if shared > SHARED_LIMIT:
            status = f"FAILED: {shared} B of shared memory > {SHARED_LIMIT}"
            failures.append((self.fn.__name__, status))
    except Exception as e:  # noqa: BLE001  (report every kernel, then fail at the end)
        status = f"FAILED: {str(e).strip().splitlines()[-1][:300]}"
        failures.append((self.fn.__name__, status))
    names = [p.name for p in self.params]
    flags = ", ".join(names[k[0]] for k, v in constexprs.items() if v is True)
    blocks = " ".join(f"{names[k[0]]}={v}" for k, v in constexprs.items() if names[k[0]].startswith("B") and isinstance(v, int))
    flags = f"{blocks} {options} {flags}"
    print(f"{self.fn.__name__:26s} {flags[:100]:100s} {status} [{time.time() - t0:.1f}s]", flush=True)
    _seen[key] = status
    return None


def resources(cubin: bytes) -> str:
    """"regs R, stack S" of a kernel's cubin (the stack holds what did not fit in registers)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return f"regs {m.group(1)}, stack {m.group(2)} B" if m else "regs ?"


def loop_bodies(text: str) -> list[int]:
    """The instruction counts of the loops in cuobjdump's SASS ``text``, in program order: each
    branch back to an earlier address closes a loop from its target to the branch. In a kernel that
    one warpgroup an SM runs, nothing hides the serial loop's latency and its count stands in for
    its time."""
    bodies = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):  # a branch to itself ends the code
            bodies.append((int(m.group(1), 16) - int(m.group(2), 16)) // 16 + 1)
    return bodies


def sass(cubin: bytes, name: str) -> str:
    """"N instructions, loops [..], md5 M" of a kernel's SASS (``loop_bodies``), written to ``sass_dir``
    without the addresses and encodings (which move with any change before them)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    code = [re.sub(r"/\*[0-9a-f]+\*/|;.*$", "", line).strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    body = "\n".join(code)
    digest = hashlib.md5(body.encode()).hexdigest()[:12]
    with open(os.path.join(sass_dir[0], f"{len(_seen) + 1:03d}-{name}.sass"), "w") as f:
        f.write(body + "\n")
    return f"{len(code)} instructions, loops {loop_bodies(text)}, md5 {digest}"


def _inputs(op, B, T, H, K, V, dtype):
    """The benchmarks' inputs on the CPU: the delta family's (``gpu_delta``), the others' (``gpu_decay_dplr``)."""
    if OPS[op].family == "delta":
        from fastweight.bench.gpu_delta import inputs
        return inputs(op, B, T, H, K, V, dtype, "cpu")
    from fastweight.bench.gpu_decay_dplr import inputs
    return inputs(op, B, T, H, K, dtype, V=V, device="cpu")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default=",".join(n for n, op in OPS.items() if op.family == "delta"))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--heads", default="128x128,256x512,256x16,64x16,16x16", help="KxV head sizes")
    ap.add_argument("--kernels", default="", help="compile only these kernels (comma-separated names)")
    ap.add_argument("--sass", default="", help="write each kernel's SASS (no addresses) to this folder; md5 per line")
    ap.add_argument("--launch", default="", help="DPLR ops: DplrLaunch fields, e.g. solve_wy=1,bwd_split=0")
    ap.add_argument("--no-grad", action="store_true", help="also the forward without autograd (inference kernels)")
    args = ap.parse_args()
    only.update(n for n in args.kernels.split(",") if n)
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
        sass_dir.append(args.sass)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    JITFunction.run = _compile_instead
    import fastweight.kernels as kernels
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    heads = [tuple(int(n) for n in kv.split("x")) for kv in args.heads.split(",")]
    extra = {}
    if args.launch:
        from fastweight.kernels.dplr import DplrLaunch
        extra["launch"] = DplrLaunch(**{k: bool(int(v)) for k, v in (f.split("=") for f in args.launch.split(","))})
    for op, (K, V), cu in itertools.product(args.ops.split(","), heads, (None, torch.tensor([0, 100, 256]))):
        B = 2 if cu is None else 1
        x = {n: t.requires_grad_(t.is_floating_point()) for n, t in _inputs(op, B, 256 // B, 2, K, V, dtype).items()}
        h0 = torch.zeros(B if cu is None else 2, 2, K, V, requires_grad=True)
        fn = functools.partial(getattr(kernels, f"chunk_{op}"), **extra)
        o, ht = fn(**x, scale=0.1, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        (o.float().sum() + ht.sum()).backward()
        if args.no_grad:
            with torch.no_grad():
                fn(**x, scale=0.1, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        if op in ("gated_delta_rule", "kda") and cu is None and (K, V) == heads[0]:
            x = _inputs(op, 2, 128, 2, 128, 128, dtype)
            size = 2 * 128 if op == "kda" else 2
            getattr(kernels, f"chunk_{op}")(**x, scale=0.1, use_gate_in_kernel=True, A_log=torch.zeros(2),
                                            dt_bias=torch.zeros(size))
    print(f"{len(_seen)} kernels compiled for sm_90, {len(failures)} failed")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
