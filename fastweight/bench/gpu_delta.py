"""One GPU run for the delta family's chunked Triton kernels: correctness, then speed.

    python -m fastweight.bench.gpu_delta [--out DIR] [--skip-check] [--ops gdn,kda,...] [--quick]
        [--heads 256x512,128x16,64x16,16x16] [--heads-ops gated_delta_rule,kda] [--budget SECONDS]

Correctness: bf16 / fp16 / fp32 against the float64 reference (``fastweight.reference.ops``) on
the same rounded inputs, output, final state and every gradient, varlen with initial_state.
``--heads``: bf16 checks at other head sizes K x V (uniform lengths: the pipelined state passes):
K = 256, V = 512 is flame's 340M Gated DeltaNet (it ran out of shared memory before the launch
configs of kernels/state.py, output.py), V = 16 the block width Triton 3.6 miscompiled at 8 warps.
The ops run the state passes at their value block BV = 64; no option forces BV = 32 through an
op (a 16-bit dot narrower than 64 is Triton 3.6's hazard on the H200, docs/kernels.md): the
stage timings call the state passes with ``block_v`` 32 and 64 directly.
``--budget``: skip what is left past that many seconds.
Tolerance (flash-attention's rule, with the floor as the low-precision reference's error):
each relative error must be within 3x of the error of the float64 result rounded to the input
dtype, and at most 1e-4 for fp32 (whose rounding floor is ~1e-8). Buffers are NaN-poisoned.

Speed: bf16, median of triton.testing.do_bench, forward and forward+backward, against fla
0.6.0's anchors (../shared/anchors, same H200), plus peak memory of forward+backward.
The table is printed last; everything is written to DIR/gpu_delta.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

import fastweight.kernels as kernels
import fastweight.reference.ops as reference
from fastweight.kernels import common
from fastweight.mechanisms import OPS, get
from fastweight.testing import generator, rel_err

# the delta family's ops -> the mechanism whose ``sample`` draws their inputs
MECHANISM = {name: op.mechanism for name, op in OPS.items() if op.family == "delta"}
# (op, shape (B, T, H, K=V), fla fwd ms, fla fwd+bwd ms): ../shared/anchors/README.md
SPEED = [
    ("gated_delta_rule", (4, 8192, 16, 128), 0.879, 3.638),
    ("kda", (4, 8192, 16, 128), 1.822, 10.143),
    ("delta_rule", (8, 16384, 64, 64), 10.461, 28.321),
    ("comba", (4, 8192, 16, 128), None, None),
]
# correctness runs: (varlen, dtypes); uniform lengths take the state passes' pipelined for-loop
CHECKS = [(True, (torch.bfloat16, torch.float16, torch.float32)), (False, (torch.bfloat16,))]


def inputs(op, B, T, H, K, V, dtype, device, seed=0):
    spec = OPS[op]
    if spec.sample is not None:   # the op draws its own tensors (Op.sample), at its default options
        x = spec.sample(B, T, H, H, K, V, dtype=torch.float32, device=device, generator=generator(seed, device),
                        **spec.defaults)
        return {n: t.to(dtype) for n, t in x.items()}
    x = get(MECHANISM[op]).sample(B, T, H, K, V, dtype=torch.float32, device=device,
                                   generator=generator(seed, device))
    return {n: t.to(dtype) for n, t in x.items()}


def run(op, x, **kw):
    return getattr(kernels, f"chunk_{op}")(**x, **kw)


def check(op, dtype, device, varlen=True, T=1000, H=4, K=128, V=128):
    """Relative errors against the float64 reference: {quantity: dict(err, floor, tol, ok)}."""
    if varlen:
        B, cu = 1, torch.tensor([0, T // 5, 2 * T // 3, T], dtype=torch.int64, device=device)
    else:
        B, T, cu = 2, T // 2, None
    x = inputs(op, B, T, H, K, V, dtype, device, seed=1)
    h0 = torch.randn(3 if varlen else B, H, K, V, device=device, generator=generator(2, device))
    kw = dict(scale=K ** -0.5, output_final_state=True, cu_seqlens=cu)
    mine = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0m = h0.clone().requires_grad_()
    o, ht = run(op, mine, initial_state=h0m, **kw)
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    h0r = h0.double().requires_grad_()
    o_r, ht_r = getattr(reference, op)(**ref, initial_state=h0r, **kw)
    do = torch.randn_like(o_r)
    dht = torch.randn_like(ht_r)
    ((o_r * do).sum() + (ht_r * dht).sum()).backward()
    ((o.float() * do.float()).sum() + (ht * dht.float()).sum()).backward()
    rows = {}
    pairs = [("o", o, o_r), ("final_state", ht, ht_r), ("d_initial_state", h0m.grad, h0r.grad)]
    pairs += [(f"d{n}", mine[n].grad, ref[n].grad) for n in ref]
    for name, got, want in pairs:
        err, floor = rel_err(got, want), rel_err(want.to(dtype), want)
        tol = max(3 * floor, 1e-4)
        rows[name] = dict(err=err, floor=floor, tol=tol, ok=bool(err <= tol))
    return rows


def peak_gib(fn) -> float:
    """The peak GiB that one call of ``fn`` allocates on top of what is allocated before it (CUDA)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def bench(op, B, T, H, K, device):
    x = inputs(op, B, T, H, K, K, torch.bfloat16, device)
    kw = dict(scale=K ** -0.5)
    fwd = triton.testing.do_bench(lambda: run(op, x, **kw), warmup=25, rep=200, return_mode="median")
    xg = {n: t.clone().requires_grad_() for n, t in x.items()}
    do = torch.randn(B, T, H, K, device=device, dtype=torch.bfloat16)

    def step():
        o, _ = run(op, xg, **kw)
        o.backward(do)
    peak = peak_gib(step)
    fb = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=list(xg.values()), return_mode="median")
    return fwd, fb, peak


def stages(op, B, T, H, K, device):
    """Each stage of forward and backward on its own (bf16)."""
    from fastweight.kernels.common import prepare_chunks
    from fastweight.kernels.cumsum import chunk_cumsum
    from fastweight.kernels.delta import PARTIAL_DK_DTYPES, WY_GATE_GRAD, _pack, delta_fwd
    from fastweight.kernels.intra import intra_bwd, intra_fwd
    from fastweight.kernels.kkt_solve import kkt_solve, solve
    from fastweight.kernels.output import output_bwd
    from fastweight.kernels.state import state_bwd, state_fwd
    from fastweight.kernels.wy import recompute_w_u, wy_bwd
    x = {n: _pack(t) for n, t in inputs(op, B, T, H, K, K, torch.bfloat16, device).items()}
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    ch = prepare_chunks(None, B, T, 64, device)
    scale = K ** -0.5
    per_channel = g.dim() == 4
    bench_ms = lambda f: triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")  # noqa: E731
    res = {}
    res["cumsum"] = bench_ms(lambda: chunk_cumsum(g, ch))
    gc = chunk_cumsum(g, ch)
    g_cum, gk_cum = (None, gc) if per_channel else (gc, None)
    if per_channel:
        res["intra_fwd"] = bench_ms(lambda: intra_fwd(q, k, gc, ch))
        Aqk, Akk = intra_fwd(q, k, gc, ch)
        for nw in (1, 2, 4):
            res[f"solve_nw{nw}"] = bench_ms(lambda: solve(Akk, beta, ch, dtype=k.dtype, num_warps=nw))
        Ai = solve(Akk, beta, ch, dtype=k.dtype)
    else:
        Aqk = Akk = None
        for nw in (1, 2, 4):
            res[f"kkt_solve_nw{nw}"] = bench_ms(lambda: kkt_solve(k, beta, gc, ch, num_warps=nw))
        Ai = kkt_solve(k, beta, gc, ch)
    # the per-channel gate: W/U also forms the state pass's gated rows (delta.delta_fwd)
    qx = dict(q=q) if per_channel else {}
    res["wy_fwd"] = bench_ms(lambda: recompute_w_u(k, v, beta, g_cum, Ai, ch, gk_cum=gk_cum, **qx))
    w, u, *gated = recompute_w_u(k, v, beta, g_cum, Ai, ch, gk_cum=gk_cum, **qx)
    qs, ks = gated if per_channel else (q, k)
    gate = g_cum if gk_cum is None else gk_cum
    fwd = dict(g=gate, w=w, u=u, q=qs, A=Aqk, scale=scale, fuse_output=True, prescaled=per_channel)
    res["state_fwd"] = bench_ms(lambda: state_fwd("delta", ks, u, ch, **fwd, store_h=False))
    res["state_fwd_store_h"] = bench_ms(lambda: state_fwd("delta", ks, u, ch, **fwd, store_h=True, store_r=True))
    _, _, saved = delta_fwd(q, k, v, g, beta, scale, None, False, ch, True)
    g_cum, gk_cum, _, Ai, Aqk, Akk, w, h, v_new = saved
    do = torch.randn_like(v)
    bwd = dict(g=g_cum if gk_cum is None else gk_cum, k=k, w=w, A=Aqk, scale=scale)
    res["state_bwd"] = bench_ms(lambda: state_bwd("delta", q, do, ch, **bwd))
    dh, dvt, _ = state_bwd("delta", q, do, ch, **bwd)
    final = torch.float32 if per_channel else q.dtype
    # as delta.delta_bwd launches them: dk's partial in the inputs' dtype, dg's reverse sum in the WY backward
    partial = final if final in PARTIAL_DK_DTYPES else torch.float32
    sum_dg = dict(dg_dtype=g.dtype, dbeta_dtype=beta.dtype) if WY_GATE_GRAD and not per_channel else {}
    res["output_bwd"] = bench_ms(lambda: output_bwd(q, k, g_cum, h, dh, v_new, do, dvt, scale, ch, gk_cum=gk_cum,
                                                    dq_dtype=final, dk_dtype=partial))
    dq, dk, dw, dg, dAqk = output_bwd(q, k, g_cum, h, dh, v_new, do, dvt, scale, ch, gk_cum=gk_cum, dq_dtype=final,
                                      dk_dtype=partial)
    res["wy_bwd"] = bench_ms(lambda: wy_bwd(k, v, beta, g_cum, Ai, dw, dvt, dk.clone(), dg.clone(), ch,
                                            gk_cum=gk_cum, Akk=Akk, dk_dtype=final, **sum_dg))
    if per_channel:
        dAkk = wy_bwd(k, v, beta, g_cum, Ai, dw, dvt, dk, dg, ch, gk_cum=gk_cum, Akk=Akk)[3]
        res["intra_bwd"] = bench_ms(lambda: intra_bwd(q, k, gk_cum, dAqk, dAkk, dq, dk, dg, ch))
    if not sum_dg:  # else the WY backward's program takes it
        res["cumsum_bwd"] = bench_ms(lambda: chunk_cumsum(dg, ch, reverse=True))
    return res


def check_line(op, dtype, varlen, K, V, rows, seconds):
    worst = max(rows.items(), key=lambda kv: kv[1]["err"] / max(kv[1]["tol"], 1e-30))
    bad = [n for n, r in rows.items() if not r["ok"]]
    o = rows.get("o", dict(err=float("nan"), floor=0))
    dg = f"dg {rows['dg']['err']:.2e}/{rows['dg']['tol']:.1e}  " if "dg" in rows else ""
    what = rows["error"]["what"] if "error" in rows else ""
    return (f"check {op:17s} {str(dtype)[6:]:8s} {'varlen ' if varlen else 'uniform'} K={K:<3d} V={V:<3d} "
            f"{'ok  ' if not bad else 'FAIL'} o {o['err']:.2e} (floor {o['floor']:.1e})  {dg}"
            f"worst {worst[0]} {worst[1]['err']:.2e}/{worst[1]['tol']:.1e}  "
            f"{'bad: ' + ','.join(bad) if bad else ''} {what}[{seconds:.0f}s]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--ops", default="")
    ap.add_argument("--quick", action="store_true", help="bf16 checks only")
    ap.add_argument("--stages", default="gated_delta_rule,kda", help="ops to break down by stage")
    ap.add_argument("--heads", default="256x512,128x16,64x16,16x16", help="KxV head sizes of extra bf16 checks")
    ap.add_argument("--heads-ops", default="gated_delta_rule,kda", help="ops checked at --heads")
    ap.add_argument("--budget", type=float, default=0, help="seconds; what is left past it is skipped")
    args = ap.parse_args()
    device = "cuda"
    ops = [o for o in MECHANISM if hasattr(kernels, f"chunk_{o}") and (not args.ops or o in args.ops.split(","))]
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), check={}, speed=[])
    lines = []
    start = time.time()

    def over_budget(what):
        if args.budget and time.time() - start > args.budget:
            lines.append(f"skipped (past --budget {args.budget:.0f} s): {what}")
            print(lines[-1], flush=True)
            return True
        return False

    if not args.skip_check:
        with common.poisoned_outputs():
            runs = [(o, vl, d, 128, 128) for vl, dts in CHECKS for o in ops for d in dts]
            runs = [r for r in runs if not args.quick or r[2] == torch.bfloat16]
            heads = [tuple(int(n) for n in kv.split("x")) for kv in args.heads.split(",") if kv]
            runs += [(o, False, torch.bfloat16, K, V) for K, V in heads for o in ops if o in args.heads_ops.split(",")]
            for op, varlen, dtype, K, V in runs:
                if over_budget(f"check {op} K={K} V={V}"):
                    continue
                t0 = time.time()
                other = (K, V) != (128, 128)
                try:
                    rows = check(op, dtype, device, varlen=varlen, K=K, V=V, T=300 if other else 1000)
                except Exception as e:  # noqa: BLE001  (report and go on to the timings)
                    rows = {"error": dict(err=float("nan"), floor=0, tol=0, ok=False, what=repr(e)[:300])}
                tag = f"{op}/{str(dtype)[6:]}/{'varlen' if varlen else 'uniform'}" + (f"/K{K}V{V}" if other else "")
                result["check"][tag] = rows
                lines.append(check_line(op, dtype, varlen, K, V, rows, time.time() - t0))
                print(lines[-1], flush=True)
    for op, (B, T, H, K), fla_f, fla_fb in SPEED:
        if op not in ops or over_budget(f"speed {op}"):
            continue
        try:
            fwd, fb, peak = bench(op, B, T, H, K, device)
        except Exception as e:  # noqa: BLE001
            print(f"speed {op} failed: {e!r}"[:400], flush=True)
            continue
        row = dict(op=op, shape=[B, T, H, K], fwd_ms=fwd, fwdbwd_ms=fb, peak_gib=peak, fla_fwd_ms=fla_f,
                   fla_fwdbwd_ms=fla_fb)
        result["speed"].append(row)
        ratio = (f"{fwd / fla_f:.2f}x / {fb / fla_fb:.2f}x" if fla_f else "-")
        lines.append(f"speed {op:17s} {str((B, T, H, K)):22s} fwd {fwd:7.3f} ms  fwd+bwd {fb:7.3f} ms  "
                     f"peak {peak:5.2f} GiB  vs fla {ratio}")
        print(lines[-1], flush=True)
    for op in ("gated_delta_rule", "kda"):
        if op in ops and op in args.stages.split(",") and not over_budget(f"stages {op}"):
            result[f"stages_{op}"] = stages(op, 4, 8192, 16, 128, device)
            lines.append(f"stages {op} (4, 8192, 16, 128) ms: " +
                         ", ".join(f"{n} {t:.3f}" for n, t in result[f"stages_{op}"].items()))
            print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_delta.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join([f"== {result['gpu']} torch {result['torch']} triton {result['triton']} {result['date']}"] + lines))


if __name__ == "__main__":
    main()
