"""Compile the kernels a launcher would launch for sm_90, without a GPU: registers, spills, smem.

Usage: python .ab/aot.py   (edits below pick the launcher call)"""
import os, sys, re, subprocess, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
      torch.bool: "i1", torch.uint8: "u8", torch.int8: "i8"}
captured = []

def capture(self, grid):
    def launch(*args, **kwargs):
        captured.append((self, grid, args, kwargs))
    return launch

JITFunction.__getitem__ = capture

def compile_captured(target=GPUTarget("cuda", 90, 32)):
    out = []
    for fn, grid, args, kwargs in captured:
        opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        names = fn.arg_names
        vals = dict(zip(names, args)); vals.update(kwargs)
        sig, cex = {}, {}
        for i, n in enumerate(names):
            p = fn.params[i]
            v = vals[n]
            if p.is_constexpr:
                sig[n] = "constexpr"; cex[(i,)] = v
            elif torch.is_tensor(v):
                sig[n] = "*" + TY[v.dtype]
            elif isinstance(v, bool):
                sig[n] = "i1"
            elif isinstance(v, int):
                sig[n] = "i64" if abs(v) >= 2 ** 31 else "i32"
            elif isinstance(v, float):
                sig[n] = "fp32"
            elif v is None:
                sig[n] = "constexpr"; cex[(i,)] = None
            else:
                raise TypeError(n, type(v))
        src = ASTSource(fn=fn, signature=sig, constexprs=cex)
        c = triton.compile(src, target=target, options=opts)
        cubin = c.asm["cubin"]
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        res = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"),
                              "-res-usage", f.name], capture_output=True, text=True).stdout

        m = re.search(r"REG:(\d+).*?SHARED:(\d+)", res, re.S)
        spill = re.search(r"STACK:(\d+)", res)
        out.append((fn.__name__, grid, opts, m.group(1) if m else "?", m.group(2) if m else "?",
                    spill.group(1) if spill else "?", c.metadata.shared))
        print(f"{fn.__name__:28s} grid={grid} {opts} regs={out[-1][3]} stack={out[-1][5]} shared={c.metadata.shared}",
              flush=True)
    captured.clear()
    return out
