"""The delta family's chunk kernels on the GPU under strong gates, partial chunks and strided cotangents.

    python scripts/gpu_delta_strong.py        (CUDA; prints one line per case)

Each case: the Triton kernel in bf16 and fp32 (fp16 runs on the CPU interpreter) against the
float64 reference on the same values, and the reference run in the low dtype (its error is the
rounding floor of the dtype):
relative errors of o, the final state and every gradient, NaN/Inf counted as inf. Cases: gates
of -3, -6 (and -20 for GDN) per token at T = 43 and 127, varlen with a partial chunk mid-batch,
and the final state's cotangent as S.sum() (stride 0) and S.mT (transposed).
"""

import torch

import fastweight.kernels as kernels
import fastweight.reference.ops as reference
from fastweight.mechanisms import get
from fastweight.testing import generator, rel_err

MECHANISM = {"delta_rule": "deltanet", "gated_delta_rule": "gated_deltanet", "longhorn": "longhorn",
             "kda": "kda", "comba": "comba"}


def case(op, T, gate, dtype, cu=None, cot="rand", K=64, V=64, H=2):
    dev = "cuda"
    x = get(MECHANISM[op]).sample(1, T, H, K, V, dtype=torch.float64, device="cpu", generator=generator(0))
    if gate is not None and "g" in x:
        x["g"] = gate * (0.75 + 0.5 * torch.rand(x["g"].shape, generator=generator(1), dtype=torch.float64))
    N = 1 if cu is None else len(cu) - 1
    x["initial_state"] = torch.randn(N, H, K, V, generator=generator(2), dtype=torch.float64)
    x = {n: t.to(dev) for n, t in x.items()}
    low = {n: (t.float() if n == "initial_state" else t.to(dtype)) for n, t in x.items()}
    cu = None if cu is None else torch.tensor(cu, device=dev)
    do = torch.randn(1, T, H, V, generator=generator(3), dtype=torch.float64).to(dev)
    dS = torch.randn(N, H, K, V, generator=generator(4), dtype=torch.float64).to(dev)

    def run(fn, inputs, out_dtype):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
        o, S = fn(**leaves, scale=K ** -0.5, output_final_state=True, cu_seqlens=cu)
        if cot == "sum":
            loss = S.sum()
        elif cot == "mT":
            loss = (S.mT * dS.mT.to(S.dtype)).sum()
        else:
            loss = (o * do.to(o.dtype)).sum() + (S * dS.to(S.dtype)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves.values())]
        return o, S, dict(zip(leaves, grads))

    ko, kS, kg = run(getattr(kernels, f"chunk_{op}"), low, dtype)
    ro, rS, rg = run(getattr(reference, op), {n: t.double() for n, t in low.items()}, torch.float64)
    lo, lS, lg = run(getattr(reference, op), low, dtype)
    errs = [f"o {rel_err(ko, ro):.1e}/{rel_err(lo, ro):.1e}", f"S {rel_err(kS, rS):.1e}/{rel_err(lS, rS):.1e}"]
    errs += [f"d{n} {rel_err(kg[n], rg[n]):.1e}/{rel_err(lg[n], rg[n]):.1e}" for n in rg]
    print(f"{op:17s} T={T:3d} g={gate} {str(dtype)[6:]:8s} cu={cu is not None} cot={cot}: " + "  ".join(errs),
          flush=True)


if __name__ == "__main__":
    for dtype in (torch.bfloat16, torch.float32):
        for op in ("gated_delta_rule", "kda", "comba", "delta_rule", "longhorn"):
            gates = (None,) if op in ("delta_rule", "longhorn") else (-3.0, -6.0)
            gates += (-20.0,) if op == "gated_delta_rule" else ()
            for gate in gates:
                for T in (43, 127):
                    case(op, T, gate, dtype)
            case(op, 170, gates[-1], dtype, cu=[0, 43, 150, 170])
            case(op, 100, None if op in ("delta_rule", "longhorn") else -1.0, dtype, cot="sum")
            case(op, 100, None if op in ("delta_rule", "longhorn") else -1.0, dtype, cot="mT")
