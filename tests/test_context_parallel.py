"""Context parallelism (``fastweight.context_parallel``) on CPU with gloo, 2 and 4 processes.

Every op in both modes, a uniform batch (every sequence across every rank, unequal segments,
a one-token segment) and a packed batch (sequences that start, end and straddle anywhere, one
longer than a whole segment, an empty and a one-token sequence): the outputs, the final states
and every gradient equal one process's run of the whole stream (per-token gradients on their
rank; a replicated argument's gradient summed over the ranks), in float64 and float32.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastweight import fuzz, ops
from fastweight.context_parallel import REPLICATED, context_parallel
from fastweight.mechanisms import OPS

# (segment sizes, packed lengths) per world size; sums are equal
LAYOUTS = {2: ([43, 57], [30, 0, 45, 1, 24]), 4: ([25, 25, 25, 25], [70, 0, 5, 1, 24])}
UNIFORM = {2: [37, 40], 4: [17, 20, 1, 33]}
# the ranks sum the segments' contributions in another order; measured worst over every op, mode,
# layout and field: float64 1.6e-13 (4 ranks), float32 2.3e-6 (4 ranks, RWKV-7 dw)
TOL = {"fp64": 1e-11, "fp32": 1e-5}


# every op whose token is one step; context_parallel refuses the others (test_refusals_name_the_argument)
CP_OPS = [name for name, op in OPS.items() if op.dplr_steps is None]


def _cases(world):
    sizes, lengths = LAYOUTS[world]
    for op in CP_OPS:
        for mode in fuzz.MODES:
            base = fuzz.draw("ci", op, fuzz.case_seed(7, op, mode), mode, "torch", "fp64")
            opts = dict(base.options)
            if op == "linear_attn" and mode == "chunk":
                opts["normalize"] = True
            common = dict(initial_state=True, output_final_state=True, options=tuple(opts.items()),
                          do="contiguous", dS="contiguous")
            yield f"{mode}_{op}_packed", dataclasses.replace(base, B=1, T=sum(lengths), lengths=tuple(lengths),
                                                              **common), sizes
            uniform = UNIFORM[world]
            yield f"{mode}_{op}_uniform", dataclasses.replace(base, B=2, T=sum(uniform), lengths=None,
                                                               **common), uniform


def _args(case, x):
    opt = {n: v for n, v in case.options if n not in ("gate_parts", "p_is_k")}
    if case.op == "comba" and "p" not in x:
        x = dict(x, p=None)
    if case.scale is not None:
        opt["scale"] = case.scale
    return x, opt


def _worker(rank, world, port, out, dtype_name):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    dtype = getattr(torch, {"fp64": "float64", "fp32": "float32"}[dtype_name])
    errors = {}
    for name, case, sizes in _cases(world):
        a, b = sum(sizes[:rank]), sum(sizes[:rank + 1])
        x = {n: t.to(dtype) for n, t in fuzz.draw_inputs(case).items() if t is not None}
        gen = torch.Generator().manual_seed(1)
        fn = getattr(ops, f"{case.mode}_{case.op}")
        cu = None if case.lengths is None else torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()])

        def run(inputs, local):
            leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
            tensors, opt = _args(case, leaves)
            call = (lambda *a, **k: context_parallel(fn, *a, **k)) if local else fn
            o, S = call(**tensors, output_final_state=True, cu_seqlens=cu, **opt)
            # the normalised linear attention returns fla's (S, z_state): z the normaliser's key sum
            S, z = S if isinstance(S, tuple) else (S, None)
            return o, S, z, leaves

        o, S, z, full = run(x, local=False)
        do = torch.randn(o.shape, generator=gen, dtype=dtype)
        dS = torch.randn(S.shape, generator=gen, dtype=S.dtype)
        dz = torch.randn(z.shape, generator=gen, dtype=z.dtype) if z is not None else None
        torch.autograd.backward([o, S] + ([z] if z is not None else []), [do, dS] + ([dz] if z is not None else []))
        mine = {n: t if n in REPLICATED else t[:, a:b] for n, t in x.items()}
        o_cp, S_cp, z_cp, part = run(mine, local=True)
        torch.autograd.backward([o_cp, S_cp] + ([z_cp] if z is not None else []),
                                [do[:, a:b], dS] + ([dz] if z is not None else []))
        rel = lambda got, want: ((got - want).norm() / want.norm().clamp_min(1e-30)).item()  # noqa: E731
        err = {"o": rel(o_cp, o[:, a:b]), "final_state": rel(S_cp, S)}
        if z is not None:
            err["z_state"] = rel(z_cp, z)
        for n, t in part.items():
            g = t.grad
            if n in REPLICATED:
                g = g.clone()
                dist.all_reduce(g)
                err[f"d{n}"] = rel(g, full[n].grad)
            else:
                err[f"d{n}"] = rel(g, full[n].grad[:, a:b])
        # the worst over the ranks, field by field
        worst = torch.tensor(list(err.values()), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        errors[name] = dict(zip(err, worst.tolist()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(errors, f)
    dist.destroy_process_group()


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,dtype", [(2, "fp64"), (4, "fp64"), (2, "fp32"), (4, "fp32")])
def test_matches_one_process(world, dtype, tmp_path):
    out = tmp_path / "errors.json"
    mp.spawn(_worker, args=(world, _port(), str(out), dtype), nprocs=world, join=True)
    errors = json.loads(out.read_text())
    assert len(errors) == 4 * len(CP_OPS) - 4 * sum(not hasattr(ops, f"fused_recurrent_{o}") for o in CP_OPS)
    bad = {case: {f: e for f, e in fields.items() if not e < TOL[dtype]} for case, fields in errors.items()}
    bad = {case: fields for case, fields in bad.items() if fields}
    worst = max((e, f"{c} {f}") for c, fields in errors.items() for f, e in fields.items())
    assert not bad, f"beyond {TOL[dtype]}: {bad} (worst {worst})"
    # every gradient compared: o, the final state, and d<every input>
    assert all(len(fields) >= 5 for fields in errors.values()), errors


def _refusal_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    q, k, v = (torch.randn(1, 8, 1, 4) for _ in range(3))
    messages = []
    for kwargs in (dict(reverse=True), dict(cu_seqlens=torch.tensor([0, 5]))):
        try:
            context_parallel(ops.fused_recurrent_linear_attn, q, k, v, **kwargs)
        except ValueError as e:
            messages.append(str(e))
    x = torch.randn(1, 16, 1, 4)
    try:
        context_parallel(ops.chunk_gated_delta_product, q, x, x, torch.zeros(1, 8, 1), torch.ones(1, 16, 1), 2)
    except ValueError as e:
        messages.append(str(e))
    if rank == 0:
        json.dump(messages, open(out, "w"))
    dist.destroy_process_group()


def test_refusals_name_the_argument(tmp_path):
    out = tmp_path / "messages.json"
    mp.spawn(_refusal_worker, args=(2, _port(), str(out)), nprocs=2, join=True)
    reverse, cu, steps = json.loads(out.read_text())
    assert "`reverse`" in reverse
    assert "cu_seqlens" in cu and "16 tokens" in cu
    assert "chunk_gated_delta_product" in steps and "several steps" in steps


def test_needs_a_process_group():
    q = torch.randn(1, 4, 1, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel(ops.chunk_linear_attn, q, q, q)
