"""Which stage kernel of a delta op goes wrong on the GPU (run on the device, one shape per process):

    python scripts/gpu_stages.py OP K V [varlen] [bv=N] [warps=N] [dtype=bfloat16]

(It replaces session 2's scripts/gpu_heads.py: without options it runs the same check.)

Every stage the op calls (cumsum, solve, W/U, state pass, output backward, WY backward, intra)
runs twice: as called, and again on fp32 copies of its inputs. A stage whose output differs
from its fp32 twin by more than its dtype's rounding (relative 2e-2) is the one to look at.
``bv`` / ``warps`` force the state passes' value block and warp count. Then the op's output and
gradients are compared with the float64 reference.
"""
import sys
import traceback

import torch
import torch.nn.functional as F

from fastweight import dispatch, ops
from fastweight.kernels import decay, delta, state

DEV = "cuda" if torch.cuda.is_available() else "cpu"
args = [a for a in sys.argv[1:] if "=" not in a]
opts = dict(a.split("=") for a in sys.argv[1:] if "=" in a)
op, K, V = args[0], int(args[1]), int(args[2])
varlen = len(args) > 3
LOW = getattr(torch, opts.get("dtype", "bfloat16")) if DEV == "cuda" else torch.float32
tag = f"{op} K={K} V={V} varlen={varlen} {' '.join(f'{k}={v}' for k, v in opts.items())}"

if "bv" in opts:
    _bv = state._bv
    state._bv = lambda block_v=None: int(opts["bv"])  # noqa: E731
if "warps" in opts:
    _lc = state.launch_config
    state.launch_config = lambda K, BV, itemsize, **kw: (int(opts["warps"]), _lc(K, BV, itemsize)[1])  # noqa: E731
dispatch._lookup("triton", "chunk", op).gpu_unverified = lambda *a: None

worst = {}


def _up(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().float().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_up(y) for y in x)
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    return []


def _rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _twin(name, fn):
    def wrapped(*a, **kw):
        a32, kw32 = _up(a), {k: _up(v) for k, v in kw.items()}
        out = fn(*a, **kw)
        torch.cuda.synchronize() if DEV == "cuda" else None
        out32 = fn(*a32, **kw32)
        errs = [_rel(x, y) for x, y in zip(_tensors(out), _tensors(out32))]
        # in-place results (intra_bwd accumulates into its arguments)
        errs += [_rel(x, y) for x, y in zip(_tensors(a), _tensors(a32)) if x.is_floating_point()]
        e = max(errs, default=0.0)
        worst[name] = max(worst.get(name, 0.0), e)
        print(f"  stage {name}: {'WRONG ' if e > 2e-2 else ''}max rel {e:.1e} over {len(errs)} tensors", flush=True)
        return out
    return wrapped


STAGES = {delta: ("chunk_local_cumsum", "intra_fwd", "intra_bwd", "kkt_solve", "solve", "recompute_w_u",
                  "state_output_fwd", "state_bwd", "output_bwd", "wy_bwd"),
          decay: ("gate_cumsum", "gate_reverse_cumsum", "intra_fwd", "intra_bwd", "output_fwd", "bwd_dv", "bwd_dqk",
                  "state_pass")}
for _mod, _names in STAGES.items():
    for _name in _names:
        setattr(_mod, _name, _twin(f"{_mod.__name__.split('.')[-1]}.{_name}", getattr(_mod, _name)))

torch.manual_seed(0)
B, T, H = (1, 300, 2) if varlen else (2, 150, 2)
cu = torch.tensor([0, 100, 300], device=DEV) if varlen else None
r = lambda *s: torch.randn(*s, device=DEV)  # noqa: E731
x = dict(q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, H, V))
if op in ("delta_rule", "gated_delta_rule", "kda"):
    x["beta"] = torch.rand(B, T, H, device=DEV)
if op == "gated_delta_rule":
    x["g"] = F.logsigmoid(r(B, T, H)) / 8
if op in ("kda", "gla"):
    x["g"] = F.logsigmoid(r(B, T, H, K)) / 8
if op == "simple_gla":  # Mamba-2's range: -exp(A) softplus(dt), A up to 16
    x["g"] = -torch.rand(B, T, H, device=DEV) * 1.5
fn = getattr(ops, f"chunk_{op}")
print(tag, flush=True)
try:
    lo = {n: t.detach().clone().to(LOW if n != "g" else t.dtype).requires_grad_() for n, t in x.items()}
    o, _ = fn(**lo, cu_seqlens=cu, backend="triton")
    o.float().square().sum().backward()
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ro, _ = fn(**ref, cu_seqlens=cu, backend="reference")
    ro.square().sum().backward()
    errs = {"o": _rel(o, ro), **{f"d{n}": _rel(lo[n].grad, ref[n].grad) for n in lo}}
    bad = [n for n, e in worst.items() if e > 2e-2]
    print(f"RESULT {tag}: " + ("ok " if max(errs.values()) < 2e-2 else "WRONG ")
          + " ".join(f"{n}={v:.1e}" for n, v in errs.items()) + (f" | stages off: {bad}" if bad else ""), flush=True)
except Exception as exc:  # noqa: BLE001
    traceback.print_exc()
    tb = [ln.strip() for ln in traceback.format_exc().splitlines() if "fastweight/kernels" in ln]
    print(f"RESULT {tag}: FAULT {type(exc).__name__} at {' | '.join(tb[-2:])}", flush=True)
