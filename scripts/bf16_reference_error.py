"""The error of the float64-exact reference ops run in bf16 (the flash-attention rule's floor) at
the delta bench's check shape, on the CPU: python scripts/bf16_reference_error.py."""
import torch, time
import fastweight.reference.ops as reference
from fastweight.bench.gpu_delta import inputs
from fastweight.testing import generator, rel_err
for op in ("delta_rule", "gated_delta_rule"):
    T, H, K, V = 1000, 4, 128, 128
    cu = torch.tensor([0, T // 5, 2 * T // 3, T])
    x = inputs(op, 1, T, H, K, V, torch.bfloat16, "cpu", seed=1)
    h0 = torch.randn(3, H, K, V, generator=generator(2))
    kw = dict(scale=K ** -0.5, output_final_state=True, cu_seqlens=cu)
    t0 = time.time()
    ref = {n: t.double().requires_grad_() for n, t in x.items()}
    o_r, ht_r = getattr(reference, op)(**ref, initial_state=h0.double(), **kw)
    low = {n: t.clone().requires_grad_() for n, t in x.items()}
    o_l, ht_l = getattr(reference, op)(**low, initial_state=h0.to(torch.bfloat16), **kw)
    do = torch.randn_like(o_r)
    (o_r * do).sum().backward(); (o_l.float() * do.float()).sum().backward()
    print(op, "bf16 reference vs float64: o", f"{rel_err(o_l, o_r):.2e}", "dk", f"{rel_err(low['k'].grad, ref['k'].grad):.2e}",
          "dq", f"{rel_err(low['q'].grad, ref['q'].grad):.2e}", "dbeta", f"{rel_err(low['beta'].grad, ref['beta'].grad):.2e}",
          "| rounded floor o", f"{rel_err(o_r.to(torch.bfloat16), o_r):.2e}", f"({time.time()-t0:.0f} s)", flush=True)
