"""transformers' Qwen3-Next on three Gated DeltaNet recurrences: its PyTorch fallback, fla, fastweight.

    python -m fastweight.bench.gpu_transformers [--T 4096] [--B 2] [--decode-batch 64] [--layers 4] [--out DIR]

Three measurements, bf16 on one GPU, each with the modeling module's recurrence bound to (a)
transformers' own PyTorch function, (b) fla's op when fla is importable, (c) ``fastweight.ops``
through ``use_fastweight_kernels``, and each against (c)'s output:

1. **Layer**: one ``Qwen3NextGatedDeltaNet`` at Qwen3-Next-80B's linear-attention sizes (hidden
   2048, 16 key heads and 32 value heads of 128): prefill forward and forward+backward (ms, median
   of ``triton.testing.do_bench``), and one decode step of the recurrence alone
   (``fused_recurrent_gated_delta_rule``, T = 1 from a state, ``--decode-batch`` sequences).
2. **Model**: a small ``Qwen3NextForCausalLM`` (``--layers`` layers in Qwen3-Next's pattern, three
   Gated DeltaNet layers to one softmax layer; the same GDN sizes, a dense MLP, vocab 32000):
   prefill tokens/s (one no-grad forward of (B, T)), a training step (loss.backward() on (B, T),
   tokens/s) and greedy ``generate`` from the model's own cache (``--decode-batch`` prompts of 128
   tokens, ``--new-tokens`` new ones; tokens/s over the whole call, prefill included, best of
   three: the call is host-bound). Generated tokens are compared with (c)'s: the fraction that
   agree (bf16 lets long greedy runs drift apart).

fla 0.6.0 refuses its gated backward on Hopper with Triton 3.4-3.7.0 (its issue #640, wrong
results); the guard is lifted for its timing here (as ``../shared/anchors`` did), and the header
says so: its gradients on this machine are not to be trusted.

Prints two markdown tables and writes DIR/gpu_transformers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import time

import torch


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4, help="model layers (0: skip the model section)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (wall-clock ms of one call)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16, help="GDN key heads (value heads: twice as many)")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        import triton
        bench = lambda fn, grad_to_none=None: triton.testing.do_bench(  # noqa: E731
            fn, grad_to_none=grad_to_none, return_mode="median")
    else:
        def bench(fn, grad_to_none=None):
            fn()
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
    import transformers

    from fastweight.models.transformers_kernels import function_of, use_fastweight_kernels
    from fastweight.testing import rel_err

    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    H, HV, K = args.heads, 2 * args.heads, args.head_dim
    gdn = dict(hidden_size=args.hidden, linear_num_key_heads=H, linear_num_value_heads=HV,
               linear_key_head_dim=K, linear_value_head_dim=K)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    bound = {"chunk": mod.torch_chunk_gated_delta_rule, "rec": mod.torch_recurrent_gated_delta_rule}
    variants = {"fastweight": None}
    try:
        if dev.type != "cuda":
            raise RuntimeError("fla's ops are Triton kernels for the GPU (not run on the CPU)")
        fla = importlib.import_module("fla.ops.gated_delta_rule")
        variants["fla"] = {"chunk": fla.chunk_gated_delta_rule, "rec": fla.fused_recurrent_gated_delta_rule}
        fla_error = None
        guard = importlib.import_module("fla.ops.common.chunk_o")
        if getattr(guard, "IS_NVIDIA_HOPPER", False) and not getattr(guard, "TRITON_ABOVE_3_7_1", True):
            # fla 0.6.0 refuses its gated backward on Hopper with Triton 3.4-3.7.0 (fla #640: wrong
            # results); lifted here for its timing only, as ../shared/anchors did
            guard.IS_NVIDIA_HOPPER = False
            fla_error = "fla's Hopper guard for Triton < 3.7.1 (its #640) lifted for timing: its gradients may be wrong"
    except Exception as e:  # noqa: BLE001  (fla is optional here)
        fla_error = _short(e)
    variants["transformers PyTorch"] = {k: inspect.unwrap(function_of(f)) for k, f in bound.items()}

    @contextlib.contextmanager
    def bind(fns):
        """The module's two recurrence names bound to ``fns`` (None: fastweight's, through the patch)."""
        if fns is None:
            with use_fastweight_kernels(["qwen3_next"]):
                yield
            return
        mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule = fns["chunk"], fns["rec"]
        try:
            yield
        finally:
            mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule = bound["chunk"], bound["rec"]

    # 1. one layer
    torch.manual_seed(0)
    layer = mod.Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**gdn, num_hidden_layers=1), 0).to(dev, dtype)
    x = torch.randn(args.B, args.T, args.hidden, device=dev, dtype=dtype)
    xg = x.clone().requires_grad_()
    rows, ref = {}, None
    for name, fns in variants.items():
        try:
            with bind(fns), torch.no_grad():
                y = layer(x).float()
            with bind(fns):
                fwd = bench(lambda: layer(x))

                def fb():
                    layer(xg).sum().backward()
                fwdbwd = bench(fb, grad_to_none=[xg, *layer.parameters()])
            rows[name] = dict(fwd=fwd, fwdbwd=fwdbwd, err=None if ref is None else rel_err(y, ref))
            ref = y if ref is None else ref
        except Exception as e:  # noqa: BLE001
            rows[name] = dict(error=_short(e))

    # the decode step of the recurrence alone, one token from a state
    from fastweight import ops
    N = args.decode_batch
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(N, 1, H, K, device=dev, dtype=dtype, generator=g) for _ in range(2))
    v = torch.randn(N, 1, HV, K, device=dev, dtype=dtype, generator=g)
    gate = -torch.rand(N, 1, HV, device=dev, generator=g)
    beta = torch.rand(N, 1, HV, device=dev, dtype=dtype, generator=g)
    h0 = torch.randn(N, HV, K, K, device=dev, generator=g)
    kw = dict(g=gate, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for name, fns in variants.items():
        fn = ops.fused_recurrent_gated_delta_rule if fns is None else fns["rec"]
        try:
            rows.setdefault(name, {})["decode"] = bench(lambda: fn(q, k, v, **kw))
        except Exception as e:  # noqa: BLE001
            rows.setdefault(name, {})["decode_error"] = _short(e)

    # 2. a small model
    model_rows = {}
    if args.layers:
        pattern = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        cfg = transformers.Qwen3NextConfig(
            **gdn, num_hidden_layers=args.layers, layer_types=[pattern[i % 4] for i in range(args.layers)],
            mlp_only_layers=list(range(args.layers)), intermediate_size=2 * args.hidden, vocab_size=32000,
            num_attention_heads=H, num_key_value_heads=2, head_dim=K, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        model = transformers.Qwen3NextForCausalLM(cfg).to(dev, dtype)
        n_params = sum(p.numel() for p in model.parameters())
        ids = torch.randint(3, cfg.vocab_size, (args.B, args.T), device=dev)
        prompt = torch.randint(3, cfg.vocab_size, (N, 128), device=dev)
        gen_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      attention_mask=torch.ones_like(prompt), pad_token_id=0)
        ref_logits = ref_tokens = None
        for name, fns in variants.items():
            try:
                with bind(fns):
                    with torch.no_grad():
                        logits = model(ids).logits.float()
                        prefill = bench(lambda: model(ids))

                    def step():
                        model(ids, labels=ids).loss.backward()
                    train = bench(step, grad_to_none=list(model.parameters()))
                    with torch.no_grad():
                        tokens = model.generate(prompt, **gen_kw)       # warm-up, and the tokens compared
                        gen_s = float("inf")
                        for _ in range(3):   # generate is host-bound (a Python step per token): best of three
                            sync()
                            t0 = time.perf_counter()
                            model.generate(prompt, **gen_kw)
                            sync()
                            gen_s = min(gen_s, time.perf_counter() - t0)
                r = dict(prefill_tok_s=args.B * args.T / prefill * 1e3, train_ms=train,
                         train_tok_s=args.B * args.T / train * 1e3, generate_tok_s=N * args.new_tokens / gen_s)
                if ref_logits is None:
                    ref_logits, ref_tokens = logits, tokens
                else:
                    r["logits_err"] = rel_err(logits, ref_logits)
                    r["tokens_agree"] = (tokens[:, 128:] == ref_tokens[:, 128:]).float().mean().item()
                model_rows[name] = r
            except Exception as e:  # noqa: BLE001
                model_rows[name] = dict(error=_short(e))
            model.zero_grad(set_to_none=True)

    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\n{where}, torch {torch.__version__}, transformers {transformers.__version__}"
          + ("" if fla_error is None else f"; fla: {fla_error}"))
    print(f"\nQwen3NextGatedDeltaNet (hidden {args.hidden}, {H} key / {HV} value heads of {K}) {str(dtype)[6:]}, "
          f"(B, T) = ({args.B}, {args.T}); decode N = {N}")
    print("| recurrence | prefill fwd ms | fwd+bwd ms | o vs fastweight | decode step ms |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        dec = f"{r['decode']:.3f}" if "decode" in r else r.get("decode_error", "-")
        if "error" in r:
            print(f"| {name} | {r['error']} | | | {dec} |")
            continue
        err = "-" if r.get("err") is None else f"{r['err']:.1e}"
        print(f"| {name} | {r['fwd']:.3f} | {r['fwdbwd']:.3f} | {err} | {dec} |")
    if model_rows:
        print(f"\nQwen3NextForCausalLM, {args.layers} layers ({n_params / 1e6:.0f} M parameters) {str(dtype)[6:]}: "
              f"prefill and training (B, T) = ({args.B}, {args.T}); generate {N} x (128 + {args.new_tokens})")
        print("| recurrence | prefill tok/s | train step ms | train tok/s | generate tok/s | logits vs fastweight "
              "| tokens agree |")
        print("|---|---|---|---|---|---|---|")
        for name, r in model_rows.items():
            if "error" in r:
                print(f"| {name} | {r['error']} | | | | | |")
                continue
            err = f"{r['logits_err']:.1e}" if "logits_err" in r else "-"
            agree = f"{r['tokens_agree']:.3f}" if "tokens_agree" in r else "-"
            print(f"| {name} | {r['prefill_tok_s']:,.0f} | {r['train_ms']:.1f} | {r['train_tok_s']:,.0f} "
                  f"| {r['generate_tok_s']:,.0f} | {err} | {agree} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_transformers.json"), "w") as f:
            json.dump(dict(args=vars(args), layer=rows, model=model_rows), f, indent=1)


if __name__ == "__main__":
    main()
