"""transformers' Qwen3-Next Gated DeltaNet layer on three recurrences: its PyTorch fallback, fla, fastweight.

    python -m fastweight.bench.gpu_transformers [--T 4096] [--B 2] [--decode-batch 64] [--out DIR]

One ``Qwen3NextGatedDeltaNet`` layer at Qwen3-Next-80B's linear-attention sizes (hidden 2048, 16 key
heads and 32 value heads of 128), bf16 on one GPU: prefill forward and forward+backward (ms, median
of ``triton.testing.do_bench``), with the module-level recurrence bound to (a) transformers' own
PyTorch function, (b) fla's op when fla is importable, (c) ``fastweight.ops`` through
``use_fastweight_kernels``; each against (c)'s output (rel err). Then one decode step of the
recurrence alone (``fused_recurrent_gated_delta_rule``, T = 1 from a state, ``--decode-batch``
sequences). Prints a markdown table and writes DIR/gpu_transformers.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (wall-clock ms of one call)")
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        import triton
        bench = lambda fn, grad_to_none=None: triton.testing.do_bench(  # noqa: E731
            fn, grad_to_none=grad_to_none, return_mode="median")
    else:
        import time

        def bench(fn, grad_to_none=None):
            fn()
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
    import transformers
    from fastweight.models.transformers_kernels import use_fastweight_kernels
    from fastweight.testing import rel_err

    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    cfg = transformers.Qwen3NextConfig(hidden_size=args.hidden, linear_num_key_heads=16, linear_num_value_heads=32,
                                       linear_key_head_dim=128, linear_value_head_dim=128, num_hidden_layers=1)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    layer = mod.Qwen3NextGatedDeltaNet(cfg, 0).to(dev, dtype)
    x = torch.randn(args.B, args.T, cfg.hidden_size, device=dev, dtype=dtype)
    bound = {"chunk": mod.torch_chunk_gated_delta_rule, "rec": mod.torch_recurrent_gated_delta_rule}
    torch_fns = {k: getattr(f, "__wrapped__", f) for k, f in bound.items()}
    try:
        fla = importlib.import_module("fla.ops.gated_delta_rule")
        fla_fns = {"chunk": fla.chunk_gated_delta_rule, "rec": fla.fused_recurrent_gated_delta_rule}
    except Exception as e:  # noqa: BLE001  (fla is optional here)
        fla_fns, fla_error = None, f"{type(e).__name__}: {e}"
    rows, ref = {}, None

    def run(name, fns):
        nonlocal ref
        if fns is not None:
            mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule = fns["chunk"], fns["rec"]
        try:
            with torch.no_grad():
                y = layer(x)
            xg = x.clone().requires_grad_()
            fwd = bench(lambda: layer(x))

            def fb():
                layer(xg).sum().backward()
            fwdbwd = bench(fb, grad_to_none=[xg, *layer.parameters()])
            rows[name] = dict(fwd=fwd, fwdbwd=fwdbwd, err=None if ref is None else rel_err(y.float(), ref))
        except Exception as e:  # noqa: BLE001
            rows[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        finally:
            if fns is not None:
                mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule = bound["chunk"], bound["rec"]

    with use_fastweight_kernels(["qwen3_next"]):
        run("fastweight", None)
        with torch.no_grad():
            ref = layer(x).float()
    if fla_fns:
        run("fla", fla_fns)
    run("transformers PyTorch", torch_fns)

    # decode: the recurrence alone, one token from a state
    from fastweight import ops
    N, H, HV, K = args.decode_batch, 16, 32, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(N, 1, H, K, device=dev, dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(N, 1, HV, K, device=dev, dtype=dtype, generator=g)
    gate = -torch.rand(N, 1, HV, device=dev, generator=g)
    beta = torch.rand(N, 1, HV, device=dev, dtype=dtype, generator=g)
    h0 = torch.randn(N, HV, K, K, device=dev, generator=g)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    decode = {"fastweight": lambda: ops.fused_recurrent_gated_delta_rule(q, k, v, g=gate, beta=beta, **kw)}
    if fla_fns:
        decode["fla"] = lambda: fla_fns["rec"](q, k, v, g=gate, beta=beta, **kw)
    decode["transformers PyTorch"] = lambda: torch_fns["rec"](q, k, v, g=gate, beta=beta, **kw)
    for name, fn in decode.items():
        try:
            rows.setdefault(name, {})["decode"] = bench(fn)
        except Exception as e:  # noqa: BLE001
            rows.setdefault(name, {})["decode_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

    print(f"\n{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"Qwen3NextGatedDeltaNet {str(dtype)[6:]} (B, T) = ({args.B}, {args.T}); decode N = {N}"
          + ("" if fla_fns else f"; fla: {fla_error}"))
    print("| recurrence | prefill fwd ms | fwd+bwd ms | o vs fastweight | decode step ms |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | | {r.get('decode', float('nan')):.3f} |")
            continue
        err = "-" if r.get("err") is None else f"{r['err']:.1e}"
        print(f"| {name} | {r['fwd']:.3f} | {r['fwdbwd']:.3f} | {err} | {r.get('decode', float('nan')):.3f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_transformers.json"), "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
