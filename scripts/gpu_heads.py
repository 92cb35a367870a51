"""One delta op at one head size in this process: python scripts/gpu_heads.py OP K V [varlen]."""
import sys
import traceback

import torch
import torch.nn.functional as F

from fastweight import ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LOW = torch.bfloat16 if DEV == "cuda" else torch.float32

op, K, V = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
varlen = len(sys.argv) > 4
torch.manual_seed(0)
B, T, H = (1, 300, 2) if varlen else (2, 150, 2)
cu = torch.tensor([0, 100, 300], device=DEV) if varlen else None
r = lambda *s: torch.randn(*s, device=DEV)  # noqa: E731
x = dict(q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, H, V),
         beta=torch.rand(B, T, H, device=DEV))
if op in ("gated_delta_rule",):
    x["g"] = F.logsigmoid(r(B, T, H)) / 8
if op == "kda":
    x["g"] = F.logsigmoid(r(B, T, H, K)) / 8
fn = getattr(ops, f"chunk_{op}")
# this script tests the shapes the dispatcher fences off (docs/kernels.md): lift the fence here
from fastweight import dispatch  # noqa: E402
dispatch._lookup("triton", "chunk", op).gpu_unverified = lambda *a: None
try:
    lo = {n: t.detach().clone().to(LOW if n not in ("g",) else t.dtype).requires_grad_() for n, t in x.items()}
    o, _ = fn(**lo, cu_seqlens=cu, backend="triton")
    o.float().square().sum().backward()
    None
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, _ = fn(**ref, cu_seqlens=cu, backend="reference")
    ro.square().sum().backward()
    e = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    errs = {"o": e(o, ro), **{f"d{n}": e(lo[n].grad, ref[n].grad) for n in lo if ref[n].grad is not None}}
    print(f"{op} K={K} V={V} varlen={varlen}: " + ("ok " if max(errs.values()) < 2e-2 else "WRONG ")
          + " ".join(f"{n}={v:.1e}" for n, v in errs.items()), flush=True)
except Exception as exc:  # noqa: BLE001
    traceback.print_exc()
    tb = [ln.strip() for ln in traceback.format_exc().splitlines() if "fastweight/kernels" in ln]
    print(f"{op} K={K} V={V} varlen={varlen}: FAULT {type(exc).__name__} at {' | '.join(tb[-2:])}", flush=True)
