"""GPU check and timing of the decay-family and DPLR chunk kernels (issue 5), in one call.

    FASTWEIGHT_VALUE_CHECKS=0 python -m fastweight.bench.gpu_decay_dplr [check] [time] [variants] [long]

check: every op with ``backend="triton"`` in bf16/fp16/fp32 against the same op with
``backend="reference"`` in float64 on the GPU (output, final state, all gradients; varlen
and initial state), with every ``torch.empty`` buffer poisoned with NaN.
time:  median ms (``triton.testing.do_bench``) of forward and forward+backward in bf16 at
the anchor shapes, next to fla 0.6.0's figures from ``../shared/anchors``.
variants: per-kernel CUDA time (torch.profiler) of one forward+backward for each variant, the
kernels' entry called with its ``launch``: GLA with the diagonal sub-chunks factored (default)
or all token at a time (``DecayLaunch(span=0)``), RWKV-7 with the forward's intermediates kept
(default) or recomputed (``DplrLaunch(recompute=True)``).
Checks also run strong gates (x64 on alternate 16-token sub-chunks: both diagonal paths).
long:  RWKV-7 over T = 65536, bf16 inputs, fp32 state: finite, and close to the fp32
per-token reference. ``CHECK_OPS=a,b`` limits the check section to those ops,
``TIME_CASES=op:shape,...`` the time section to those cases, ``TIME_DTYPE`` (default bfloat16) its inputs' dtype
(the log gates stay fp32 unless ``TIME_GATE_DTYPE`` names theirs),
``TIME_REP`` (default 150) do_bench's ms of repetitions (at 100 ms a call, 150 is one sample: ~4% apart run to run).
``DPLR_LAUNCH=field=value,...`` (``DplrLaunch`` fields, e.g. ``state_grads_fp32=True``): check and time
run the DPLR ops through the kernels' entry with that launch instead of the default path.
Prints a short table last; writes every row to $OUT/gpu_decay_dplr.json when OUT is set (after
each row, so a run stopped by its time limit keeps what it finished).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

import fastweight.kernels as kernels
from fastweight import ops
from fastweight.kernels.decay import DecayLaunch
from fastweight.kernels.dplr import DplrLaunch
from fastweight.testing import nan_like, rel_err

DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-5}
# fla 0.6.0 on this H200, bf16 (../shared/anchors/README.md): (fwd ms, fwd+bwd ms)
ANCHORS = {
    ("simple_gla", "gdn1.3b"): (0.518, 2.361),
    ("gla", "rwkv7paper"): (11.064, 47.206),
    ("rwkv7", "gdn1.3b"): (4.228, 16.177),
    ("rwkv7", "rwkv7paper"): (26.036, 104.68),
}
SHAPES = {"gdn1.3b": (4, 8192, 16, 128), "rwkv7paper": (8, 16384, 64, 64)}
ROWS = []


GATES = ("g", "gk", "w")


def inputs(op, B, T, H, K, dtype, gen_scale=1.0, V=None, strong=False, device=DEV):
    """Inputs of ``ops.chunk_<op>`` by argument name (gates fp32, log-space, as the anchors);
    value head dim V (default K). ``strong``: the gates x64 (GLA family: -3.2 per step on average,
    down to about -15; RWKV-7's w x16, past its bound) on every other 16-token sub-chunk, so the
    diagonal sub-chunks take both paths (measured at T = 200, K = 64: ~60% factored). On ``device``
    (the GPU unless given)."""
    r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    if strong:
        alt = (torch.arange(T, device=device) // 16) % 2 == 0
        gen_scale = torch.where(alt, 16.0 if op == "rwkv7" else 64.0, 1.0).view(1, T, 1, 1)
    q = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    k = F.normalize(r(B, T, H, K), dim=-1).to(dtype)
    v = r(B, T, H, V or K).to(dtype)
    g_s = F.logsigmoid(r(B, T, H)) / 16 * (gen_scale[..., 0] if torch.is_tensor(gen_scale) else gen_scale)
    g_v = F.logsigmoid(r(B, T, H, K)) / 16 * gen_scale
    if op in ("linear_attn", "retention"):
        return dict(q=q, k=k, v=v)
    if op == "simple_gla":
        return dict(q=q, k=k, v=v, g=g_s)
    if op == "gla":
        return dict(q=q, k=k, v=v, g=g_v)
    if op == "rwkv6":
        return dict(r=q, k=k, v=v, w=g_v, u=(r(H, K) * 0.5).to(dtype))
    if op == "hgrn2":
        return dict(q=q, v=v, g=g_v)
    if op == "rwkv7":
        iclr = torch.rand(B, T, H, 1, device=device)
        kk = F.normalize(r(B, T, H, K), dim=-1)
        w = -0.6065306597126334 * torch.sigmoid(r(B, T, H, K)) * gen_scale
        return dict(r=q, w=w, k=k, v=v, a=(-kk).to(dtype), b=(kk * iclr).to(dtype))
    if op == "dplr_delta_rule":
        kk = F.normalize(r(B, T, H, K), dim=-1)
        return dict(q=q, k=k, v=v, a=(-kk).to(dtype), b=(kk * torch.rand(B, T, H, 1, device=device)).to(dtype),
                    gk=g_v)
    raise ValueError(op)


def fast_op(op, K):
    """The op as check and time run it: ``fastweight.ops.chunk_<op>`` with ``backend="triton"`` (the
    path users get), or for a DPLR op under ``DPLR_LAUNCH`` the kernels' entry with that
    ``DplrLaunch`` (at the op's default scale: 1 for RWKV-7, K^-0.5 for the generic op)."""
    spec = os.environ.get("DPLR_LAUNCH")
    if not spec or op not in ("rwkv7", "dplr_delta_rule"):
        return functools.partial(getattr(ops, f"chunk_{op}"), backend="triton")
    # keyword arguments as Python writes them: tuples (bwd_config=(4, 2)) and strings (wide_grid='chunk') too
    call = ast.parse(f"DplrLaunch({spec})", mode="eval").body
    launch = DplrLaunch(**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords})
    return functools.partial(getattr(kernels, f"chunk_{op}"), scale=1.0 if op == "rwkv7" else K ** -0.5,
                             launch=launch)


def check(op, dtype, T=200, H=3, K=64, cu_seqlens=None, V=None, B=2, strong=False):
    """Errors of output, final state and every gradient against float64 (inf on NaN)."""
    t0 = time.time()
    B = 1 if cu_seqlens is not None else B
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    V = V or K
    x = inputs(op, B, T, H, K, dtype, V=V, strong=strong)
    x["initial_state"] = torch.randn(N, H, K, V, device=DEV)
    fn = getattr(ops, f"chunk_{op}")
    low = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **kw: (lambda t: nan_like(t) if t.is_floating_point() else t)(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: (lambda t: nan_like(t) if t.is_floating_point() else t)(empty_like(*a, **kw))
    try:
        o, ht = fast_op(op, K)(**low, output_final_state=True, cu_seqlens=cu_seqlens)
        ht = ht[0] if isinstance(ht, tuple) else ht   # linear attention's (S, z): the kernels' state S
        do, dht = torch.randn_like(o, dtype=torch.float32), torch.randn_like(ht)
        torch.autograd.backward([o, ht], [do.to(o.dtype), dht])
    finally:
        torch.empty, torch.empty_like = empty, empty_like
    ro, rht = fn(**ref, output_final_state=True, cu_seqlens=cu_seqlens, backend="reference")
    rht = rht[0] if isinstance(rht, tuple) else rht
    torch.autograd.backward([ro, rht], [do.double(), dht.double()])
    errs = {"o": rel_err(o, ro), "ht": rel_err(ht, rht)}
    errs.update({f"d{n}": rel_err(low[n].grad, ref[n].grad) for n in low})
    worst = max(errs.values())
    row = dict(kind="check", op=op, dtype=str(dtype).split(".")[-1], T=T, K=K, V=V, varlen=cu_seqlens is not None,
               strong=strong, worst=worst, ok=worst < TOL[dtype], errs=errs, wall_s=time.time() - t0)
    record(row)
    print(f"check {op:16s} {row['dtype']:8s} K={K:<3d} V={V:<3d} varlen={row['varlen']!s:5s} strong={strong!s:5s} "
          f"worst {worst:.2e} {'ok' if row['ok'] else 'FAIL'} [{row['wall_s']:.0f}s]  "
          + " ".join(f"{n}={e:.1e}" for n, e in errs.items()), flush=True)


def profile(op, shape, label, launch):
    """Per-kernel CUDA time (ms) and peak memory (GiB allocated, the inputs included) of one
    forward+backward, after a warm-up call, of the kernels' entry ``fastweight.kernels.chunk_<op>``
    with ``launch`` (at the ops' default scale)."""
    B, T, H, K = SHAPES[shape]
    x = inputs(op, B, T, H, K, torch.bfloat16)
    fn = functools.partial(getattr(kernels, f"chunk_{op}"), scale=1.0 if op == "rwkv7" else K ** -0.5,
                           launch=launch)
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}

    def run():
        out = fn(**leaves)[0]
        out.backward(torch.ones_like(out))
    run()
    torch.cuda.synchronize()
    for t in leaves.values():
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    from fastweight.bench.ops_time import kernel_ms
    per = kernel_ms(run)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    total = sum(per.values())
    top = list(per.items())[:12]
    row = dict(kind="variant", op=op, shape=shape, variant=label, kernel_ms=total, peak_gib=peak, top=top)
    record(row)
    print(f"variant {op} {shape} [{label}]: kernels {total:.3f} ms, peak {peak:.2f} GiB | " +
          ", ".join(f"{n[:28]} {t:.3f}" for n, t in top), flush=True)
    torch.cuda.empty_cache()


def variants():
    """Per-kernel time of: GLA's diagonal sub-chunks factored (default) vs token at a time
    (span 0, the path of strong gates); RWKV-7 keeping its intermediates (default) vs
    recomputing them in the backward; RWKV-7 at the paper's shape (where its forward goes), with
    the wide-chunk kernel's programs one a chunk (``DplrLaunch.wide_grid``), and with the fused
    backward in one launch (``DplrLaunch(bwd_split=False, bwd_programs=0)``: its scratch as large as
    the input; the default goes in launches of bounded scratch past ``dplr_bwd.SCRATCH_BYTES``)."""
    cases = [("gla", "rwkv7paper", "factored", DecayLaunch()),
             ("gla", "rwkv7paper", "token at a time", DecayLaunch(span=0.0)),
             ("rwkv7", "gdn1.3b", "kept", DplrLaunch()), ("rwkv7", "gdn1.3b", "recomputed", DplrLaunch(recompute=True)),
             ("rwkv7", "rwkv7paper", "kept", DplrLaunch()),
             ("rwkv7", "rwkv7paper", "wide kernel by chunk", DplrLaunch(wide_grid="chunk")),
             ("rwkv7", "rwkv7paper", "fused backward in one launch",
              DplrLaunch(bwd_split=False, bwd_programs=0))]
    for op, shape, label, launch in cases:
        try:
            profile(op, shape, label, launch)
        except Exception as e:  # a variant that fails to build is reported, not fatal
            print(f"variant {op} {shape} [{label}] failed: {e!r}"[:400], flush=True)
            record(dict(kind="variant", op=op, shape=shape, variant=label, error=repr(e)[:400]))


def bench(op, shape, backward):
    """(median ms, peak GiB allocated during one call, inputs and do included, GiB autograd keeps
    between forward and backward (the output included; 0 without ``backward``), the inputs' GiB,
    the peak on top of what was allocated before the timed call: inputs, do)."""
    B, T, H, K = SHAPES[shape]
    x = inputs(op, B, T, H, K, getattr(torch, os.environ.get("TIME_DTYPE", "bfloat16")))
    if os.environ.get("TIME_GATE_DTYPE"):  # the gates too in a 16-bit dtype (the official RWKV-7 kernel's w)
        x = {n: t.to(getattr(torch, os.environ["TIME_GATE_DTYPE"])) if n in GATES else t for n, t in x.items()}
    fn = fast_op(op, K)
    leaves = {n: t.detach().clone().requires_grad_(backward) for n, t in x.items()}
    del x  # the peak counts one copy of the inputs
    inp = sum(t.numel() * t.element_size() for t in leaves.values()) / 2 ** 30
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    o = fn(**leaves)[0]
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / 2 ** 30 if backward else 0.0
    do = torch.randn_like(o)
    del o

    def run():
        out = fn(**leaves)[0]
        if backward:
            out.backward(do)
    run()
    torch.cuda.synchronize()
    for t in leaves.values():
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    on_top = peak - before / 2 ** 30
    return triton.testing.do_bench(run, warmup=25, rep=int(os.environ.get("TIME_REP", 150)), return_mode="median"), peak, held, inp, on_top


def timing(op, shape):
    t0 = time.time()
    fwd = bench(op, shape, False)[0]
    # on_top: the anchors' measure (../shared/anchors/anchor_rwkv7_official.py), the peak less what was
    # allocated before the call (the inputs and dO)
    fb, peak, held, inp, on_top = bench(op, shape, True)
    fla = ANCHORS.get((op, shape), (None, None))
    row = dict(kind="time", op=op, shape=shape, fwd_ms=fwd, fwdbwd_ms=fb, peak_gib_fwdbwd=peak, saved_gib=held,
               inputs_gib=inp, peak_on_top_gib=on_top, fla_fwd_ms=fla[0],
               fla_fwdbwd_ms=fla[1],
               ratio_fwd=fwd / fla[0] if fla[0] else None, ratio_fwdbwd=fb / fla[1] if fla[1] else None,
               wall_s=time.time() - t0)
    record(row)
    print(f"time {op} {shape}: fwd {fwd:.3f} ms, fwd+bwd {fb:.3f} ms, peak {peak:.2f} GiB (inputs {inp:.2f}, on top of "
          f"them and dO {on_top:.2f}, kept for the backward {held:.2f}) "
          f"(fla {fla[0]} / {fla[1]})", flush=True)
    torch.cuda.empty_cache()


def long_rwkv7(T=65536, H=2, K=64):
    """RWKV-7 over T = 65536: bf16 inputs, fp32 state, vs the per-token recurrence in fp32 on the
    same (upcast) inputs."""
    x = inputs("rwkv7", 1, T, H, K, torch.bfloat16)
    o, ht = fast_op("rwkv7", K)(**x, output_final_state=True)
    x32 = {n: t.float() for n, t in x.items()}
    ro, rht = ops.chunk_rwkv7(**x32, output_final_state=True, backend="reference")
    finite = bool(torch.isfinite(o).all()) and bool(torch.isfinite(ht).all())
    row = dict(kind="long", op="rwkv7", T=T, finite=finite, err_o=rel_err(o, ro), err_ht=rel_err(ht, rht),
               state_max=ht.abs().max().item())
    record(row)
    print(f"long rwkv7 T={T}: finite={finite} rel err o {row['err_o']:.2e} state {row['err_ht']:.2e}", flush=True)


def record(row):
    """Keep a row and rewrite $OUT/gpu_decay_dplr.json, so a run cut short by its time limit still
    returns every row it finished."""
    ROWS.append(row)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_decay_dplr.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=ROWS), f, indent=1, default=str)


def main(argv):
    sections = argv or ["check", "time", "long"]
    torch.manual_seed(0)
    t0 = time.time()

    def stamp(what):
        print(f"[{time.time() - t0:.0f} s] {what}", flush=True)
    decay = ["linear_attn", "retention", "simple_gla", "gla", "rwkv6", "hgrn2"]
    dplr_ops = ["dplr_delta_rule", "rwkv7"]
    if os.environ.get("CHECK_OPS"):
        decay = [op for op in decay if op in os.environ["CHECK_OPS"].split(",")]
        dplr_ops = [op for op in dplr_ops if op in os.environ["CHECK_OPS"].split(",")]
    if "check" in sections:
        stamp("check")
        full = os.environ.get("CHECK_ALL_DTYPES") == "1"
        for op in decay + dplr_ops:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                if full or dtype == torch.bfloat16 or op in ("simple_gla", "gla", "rwkv7"):
                    check(op, dtype)
        for op in [op for op in ("simple_gla", "gla") if op in decay] + dplr_ops[-1:]:
            check(op, torch.bfloat16, T=300, cu_seqlens=torch.tensor([0, 1, 100, 100, 300], device=DEV))
        # strong gates: both diagonal sub-chunk paths (factored, token at a time) in one call; fp32,
        # where the paths' exactness shows (16-bit: the storage roundings, amplified by the gate
        # gradient's cancellation under strong gates, dominate: fp16 dg 3.8e-3 in the interpreter)
        for op in [op for op in ("gla", "rwkv6") if op in decay] + dplr_ops[-1:]:
            check(op, torch.float32, strong=True)
        # small heads (Mamba-2's 16-wide value heads faulted the bf16 backward at 8 warps)
        for op in decay + dplr_ops:
            for K, V in ((64, 16), (16, 16), (32, 128)):
                check(op, torch.bfloat16, T=130, H=4, K=K, V=V, B=3)
    if "time" in sections:
        stamp("time")
        cases = [("simple_gla", "gdn1.3b"), ("gla", "rwkv7paper"), ("rwkv7", "gdn1.3b"), ("rwkv7", "rwkv7paper")]
        if os.environ.get("TIME_CASES"):
            cases = [tuple(c.split(":")) for c in os.environ["TIME_CASES"].split(",")]
        for op, shape in cases:
            timing(op, shape)
    if "variants" in sections:
        stamp("variants")
        variants()
    if "long" in sections and "rwkv7" in dplr_ops:
        stamp("long")
        long_rwkv7()
    print("\n| what | result |\n|---|---|")
    for r in ROWS:
        if r["kind"] == "check" and not r["ok"]:
            print(f"| FAIL {r['op']} {r['dtype']} K={r['K']} V={r['V']} varlen={r['varlen']} strong={r['strong']} | "
                  f"worst {r['worst']:.2e} |")
        elif r["kind"] == "time":
            ratio = f" ({r['ratio_fwd']:.2f}x / {r['ratio_fwdbwd']:.2f}x fla)" if r["ratio_fwd"] else ""
            print(f"| {r['op']} {r['shape']} | {r['fwd_ms']:.3f} / {r['fwdbwd_ms']:.3f} ms{ratio} |")
        elif r["kind"] == "variant" and "kernel_ms" in r:
            print(f"| {r['op']} {r['shape']} [{r['variant']}] | kernels {r['kernel_ms']:.3f} ms |")
        elif r["kind"] == "long":
            print(f"| rwkv7 T={r['T']} bf16 | finite={r['finite']} err {r['err_o']:.1e} |")
    checks = [r for r in ROWS if r["kind"] == "check"]
    print(f"| checks | {sum(r['ok'] for r in checks)}/{len(checks)} ok |")


if __name__ == "__main__":
    main(sys.argv[1:])
