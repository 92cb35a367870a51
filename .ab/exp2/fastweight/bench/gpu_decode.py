"""One GPU run for the fused recurrent kernels (every op's ``fused_recurrent_*``): speed, then correctness.

    python -m fastweight.bench.gpu_decode [--out DIR] [--skip-check]

Speed (median of triton.testing.do_bench):
- the decode step of the gated delta rule, T=1, (B, H, K=V) = (256, 16, 128), bf16 inputs, fp32
  state read and written once: ms and state bandwidth (2 * B*H*K*V*4 bytes / time) against the
  copy rate measured in the same run and fla's 0.188 ms (../shared/anchors); several (BV, warps);
- forward and forward+backward at a short-sequence shape (8, 256, 16, 128), bf16.
Correctness: every op in bf16, a few in fp16 and fp32, against the float64 definition
(``backend="reference"``) on the same rounded inputs: output, final state, every gradient,
NaN-poisoned buffers. Reported next to the error of the definition run in the input dtype
(flash-attention's rule). The table is printed last; everything goes to DIR/decode.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from fastweight import ops
from fastweight.kernels import common, fused_recurrent as fr
from fastweight.mechanisms import OPS
from fastweight.testing import generator, rel_err

FLA_DECODE_MS = 0.188


def op_inputs(op, B, T, H, K, V, HV=None, gen=None, device="cpu"):
    """Valid random inputs for ``fastweight.ops.fused_recurrent_<op>`` (by argument name), fp32."""
    HV = HV or H
    if OPS[op].sample is not None:   # the op draws its own tensors (Op.sample); its call takes OPS[op].defaults
        return OPS[op].sample(B, T, H, HV, K, V, dtype=torch.float32, device=device, generator=gen,
                              **OPS[op].defaults)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, device=device)  # noqa: E731
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    log_decay = lambda *s: -u(*s) * 0.5 - 0.01  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K) * K ** -0.5, r(B, T, HV, V)
    if op in ("linear_attn", "retention"):
        return dict(q=q, k=k, v=v)
    if op == "simple_gla":
        return dict(q=q, k=k, v=v, g=log_decay(B, T, HV), g_gamma=log_decay(HV))
    if op == "gla":
        return dict(q=q, k=k, v=v, gk=log_decay(B, T, H, K))
    if op == "rwkv6":
        return dict(r=q, k=k, v=v, w=log_decay(B, T, H, K), u=r(H, K))
    if op == "hgrn2":
        return dict(q=q, v=v, g=log_decay(B, T, H, K))
    k = unit(r(B, T, H, K))
    if OPS[op].args == ("q", "k", "v", "beta"):   # the delta rule, explicit or implicit step
        return dict(q=q, k=k, v=v, beta=u(B, T, HV))
    if op == "gated_delta_rule":
        return dict(q=q, k=k, v=v, g=log_decay(B, T, HV), beta=u(B, T, HV))
    if op == "kda":
        return dict(q=q, k=k, v=v, g=log_decay(B, T, HV, K), beta=u(B, T, HV))
    if op == "comba":
        return dict(q=q, k=k, v=v, p=k * u(1, 1, H, 1), g=log_decay(B, T, HV), beta=u(B, T, HV))
    kappa = unit(r(B, T, H, K))
    a, b = -kappa, kappa * u(B, T, H, K)
    if op == "dplr_delta_rule":
        return dict(q=q, k=k, v=v, a=a, b=b, gk=log_decay(B, T, H, K))
    if op == "rwkv7":
        return dict(r=q, w=log_decay(B, T, H, K), k=k, v=v, a=a, b=b)
    raise ValueError(f"unknown op {op!r}")


def copy_rate(device) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    import triton
    x = torch.empty(2 ** 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 4 / ms / 1e9


def decode(device, configs, results):
    import triton
    B, H, K, V = 256, 16, 128, 128
    x = {n: t.to(torch.bfloat16) for n, t in op_inputs("gated_delta_rule", B, 1, H, K, V,
                                                        gen=generator(0, device), device=device).items()}
    h0 = torch.randn(B, H, K, V, device=device, generator=generator(1, device))
    state_bytes = 2 * B * H * K * V * 4
    spec = fr.Spec(low_rank=1, b_decayed=True)
    for block_v, warps in configs:
        def step():
            return fr.fused_recurrent_fwd(spec, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=K ** -0.5,
                                          initial_state=h0, output_final_state=True, block_v=block_v, num_warps=warps)
        ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
        results.append(dict(kind="decode", what=f"kernel BV={block_v} warps={warps}", ms=ms,
                            GBps=state_bytes / ms / 1e6))
    kw = dict(initial_state=h0, output_final_state=True)
    for name, fn in (("op", lambda: ops.fused_recurrent_gated_delta_rule(**x, **kw)),
                     ("op, qk l2norm", lambda: ops.fused_recurrent_gated_delta_rule(
                         **x, use_qk_l2norm_in_kernel=True, **kw))):
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        results.append(dict(kind="decode", what=f"{name} (default BV)", ms=ms, GBps=state_bytes / ms / 1e6))


def short_sequence(device, results, shape=(8, 256, 16, 128)):
    import triton
    B, T, H, K = shape
    for op in ("gated_delta_rule", "kda", "rwkv7"):
        x = {n: t.to(torch.bfloat16).requires_grad_() for n, t in
             op_inputs(op, B, T, H, K, K, gen=generator(0, device), device=device).items()}
        fn = getattr(ops, f"fused_recurrent_{op}")
        fwd = triton.testing.do_bench(lambda: fn(**x), warmup=25, rep=200, return_mode="median")
        o, _ = fn(**x)
        do = torch.randn_like(o)

        def fwd_bwd():
            o, _ = fn(**x)
            o.backward(do)
        both = triton.testing.do_bench(fwd_bwd, warmup=25, rep=200, return_mode="median",
                                       grad_to_none=list(x.values()))
        results.append(dict(kind="short", what=f"{op} {shape}", fwd_ms=fwd, fwd_bwd_ms=both))


def backward_blocks(device, results, configs, shape=(8, 256, 16, 128)):
    """Forward+backward of the gated delta rule with the backward's (BV, warps) forced."""
    import triton
    B, T, H, K = shape
    x = {n: t.to(torch.bfloat16).requires_grad_() for n, t in
         op_inputs("gated_delta_rule", B, T, H, K, K, gen=generator(0, device), device=device).items()}
    do = torch.randn(B, T, H, K, device=device, dtype=torch.bfloat16)
    def fwd_bwd():
        o, _ = ops.fused_recurrent_gated_delta_rule(**x)
        o.backward(do)
    for block_v, warps in configs:
        with fr.forced_blocks(bwd=(block_v, warps)):
            ms = triton.testing.do_bench(fwd_bwd, warmup=25, rep=200, return_mode="median",
                                         grad_to_none=list(x.values()))
        results.append(dict(kind="short", what=f"gated_delta_rule {shape}, bwd BV={block_v} warps={warps}",
                            fwd_ms=float("nan"), fwd_bwd_ms=ms))


def forward_blocks(device, results, configs, shape=(8, 256, 16, 128)):
    """The forward kernel alone at a short-sequence shape, per (BV, warps)."""
    import triton
    B, T, H, K = shape
    x = {n: t.to(torch.bfloat16) for n, t in
         op_inputs("gated_delta_rule", B, T, H, K, K, gen=generator(0, device), device=device).items()}
    spec = fr.Spec(low_rank=1, b_decayed=True)
    for block_v, warps in configs:
        ms = triton.testing.do_bench(lambda: fr.fused_recurrent_fwd(
            spec, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=K ** -0.5, block_v=block_v,
            num_warps=warps), warmup=25, rep=200, return_mode="median")
        results.append(dict(kind="short", what=f"gated_delta_rule {shape} fwd kernel BV={block_v} warps={warps}",
                            fwd_ms=ms, fwd_bwd_ms=float("nan")))


def profile(device, shape=(8, 256, 16, 128)) -> str:
    """Where the time of one forward+backward goes (CUDA time per kernel, torch.profiler)."""
    B, T, H, K = shape
    x = {n: t.to(torch.bfloat16).requires_grad_() for n, t in
         op_inputs("gated_delta_rule", B, T, H, K, K, gen=generator(0, device), device=device).items()}
    do = torch.randn(B, T, H, K, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        ops.fused_recurrent_gated_delta_rule(**x)[0].backward(do)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.fused_recurrent_gated_delta_rule(**x)[0].backward(do)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)


def check(op, dtype, device, results, B=2, T=100, H=4, K=64, V=64):
    """Triton vs the float64 definition on the same rounded inputs; the definition in dtype beside it."""
    gen = generator(3, device)
    x = {n: t.to(dtype) for n, t in op_inputs(op, B, T, H, K, V, gen=gen, device=device).items()}
    x["initial_state"] = torch.randn(B, H, K, V, device=device, generator=gen)
    fn = functools.partial(getattr(ops, f"fused_recurrent_{op}"), **OPS[op].defaults)
    runs = {}
    for name, cast, backend in (("triton", None, "triton"), ("ref64", torch.float64, "reference"),
                                ("ref_low", None, "reference")):
        inp = {n: (t.to(cast) if cast else t.clone()).requires_grad_() for n, t in x.items()}
        o, ht = fn(**inp, output_final_state=True, backend=backend)
        runs[name] = (inp, o, ht)
    _, ro, rht = runs["ref64"]
    gen = generator(4, device)
    do, dht = torch.randn(ro.shape, generator=gen, device=device), torch.randn(rht.shape, generator=gen, device=device)
    grads = {}
    for name, (inp, o, ht) in runs.items():
        loss = (o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()
        grads[name] = dict(zip(inp, torch.autograd.grad(loss, list(inp.values()), allow_unused=True)))
    worst = ("", 0.0, 0.0)
    errs = {"o": (rel_err(runs["triton"][1], ro), rel_err(runs["ref_low"][1], ro)),
            "final_state": (rel_err(runs["triton"][2], rht), rel_err(runs["ref_low"][2], rht))}
    for n in x:
        want = grads["ref64"][n]
        if want is None:
            continue
        errs["d" + n] = (rel_err(grads["triton"][n], want), rel_err(grads["ref_low"][n], want))
    for n, (mine, low) in errs.items():
        ratio = mine / max(low, 1e-7 if dtype == torch.float32 else 1e-4)
        if ratio > worst[1]:
            worst = (n, ratio, mine)
    results.append(dict(kind="check", op=op, dtype=str(dtype).replace("torch.", ""), errors=errs,
                        worst=worst[0], worst_ratio=worst[1], worst_err=worst[2]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    import triton
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    results = []
    path = os.path.join(args.out, "decode.json")

    def save():
        with open(path, "w") as f:
            json.dump(dict(env=env, results=results), f, indent=1)

    env["copy_TBps"] = copy_rate(device)
    decode(device, [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 8)], results)
    save()
    short_sequence(device, results)
    backward_blocks(device, results, [(16, 2), (32, 4), (64, 4), (64, 8)])
    forward_blocks(device, results, [(16, 1), (32, 4), (64, 4), (64, 8)])
    save()
    table = profile(device)
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write(table)
    if not args.skip_check:
        with common.poisoned_outputs():            # NaN output buffers: a missed element shows
            for op in ops.OPS:
                for dtype in (torch.bfloat16,) + ((torch.float16, torch.float32) if op in (
                        "gated_delta_rule", "rwkv6", "rwkv7", "kda") else ()):
                    try:
                        check(op, dtype, device, results)
                    except Exception as e:  # a failure is a result: report it, go on
                        results.append(dict(kind="check", op=op, dtype=str(dtype), error=repr(e)[:300]))
                    save()

    print(table)
    print(f"{env}")
    copy = env["copy_TBps"] * 1e3
    print(f"\ndecode step, gated delta rule, T=1 (256, 16, 128), bf16, fp32 state; copy rate {copy:.0f} GB/s")
    print("| variant | ms | state GB/s | % of copy | fla 0.188 ms / ours |")
    for r in results:
        if r["kind"] == "decode":
            print(f"| {r['what']} | {r['ms']:.4f} | {r['GBps']:.0f} | {100 * r['GBps'] / copy:.0f}% "
                  f"| {FLA_DECODE_MS / r['ms']:.2f}x |")
    print("\n| short sequence, bf16 | fwd ms | fwd+bwd ms |")
    for r in results:
        if r["kind"] == "short":
            print(f"| {r['what']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} |")
    print("\n| op | dtype | worst (ours / definition in dtype) | our err there | status |")
    for r in results:
        if r["kind"] == "check":
            if "error" in r:
                print(f"| {r['op']} | {r['dtype']} | FAILED: {r['error']} | | FAIL |")
            else:
                ok = r["worst_ratio"] <= 2 or r["worst_err"] < {"bfloat16": 2e-2, "float16": 4e-3,
                                                                  "float32": 1e-5}[r["dtype"]]
                print(f"| {r['op']} | {r['dtype']} | {r['worst']} {r['worst_ratio']:.2f} | "
                      f"{r['worst_err']:.2e} | {'ok' if ok else 'CHECK'} |")


if __name__ == "__main__":
    main()
