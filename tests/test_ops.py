"""The public ops: fla's signatures, served by the per-token definitions and by the best backend."""

import inspect

import pytest
import torch

from fastweight import ops
from fastweight.dispatch import mamba_gate
from fastweight.mechanisms import REGISTRY, get
from fastweight.testing import generator, rel_err

MECHANISMS = tuple(REGISTRY)
MODES = ("chunk", "fused_recurrent")
# Grouped value heads (HV = 2H): ops whose gates live on the value heads or on the key side.
GROUPED = ("linear_attention", "retnet", "mamba2", "gla", "hgrn2", "deltanet", "gated_deltanet", "kda", "comba",
           "longhorn", "rwkv7", "dplr")


def op_of(name, mode):
    return getattr(ops, f"{mode}_{get(name).op}")


def sample(name, B, T, H=2, K=8, V=6, seed=None):
    g = generator(seed)
    return get(name).sample(B, T, H, K, V, dtype=torch.float64, device="cpu", generator=g), g


def test_every_op_in_both_modes_ends_with_backend():
    for op in ops.OPS:
        for mode in MODES:
            sig = inspect.signature(getattr(ops, f"{mode}_{op}"))
            params = list(sig.parameters)
            assert sig.parameters["backend"].kind == inspect.Parameter.KEYWORD_ONLY
            assert {"scale", "initial_state", "output_final_state", "cu_seqlens"} <= set(params)


def test_fla_argument_order():
    def head(fn, n):
        return list(inspect.signature(fn).parameters)[:n]
    # every op fla has is checked in full against fla's recorded signatures: tests/test_fla_compat.py
    assert head(ops.chunk_gated_delta_rule, 9) == ["q", "k", "v", "g", "beta", "scale", "initial_state",
                                                   "output_final_state", "use_qk_l2norm_in_kernel"]
    assert head(ops.chunk_rwkv7, 6) == ["r", "w", "k", "v", "a", "b"]
    assert inspect.signature(ops.chunk_rwkv7).parameters["scale"].default == 1.0
    assert head(ops.chunk_rwkv6, 5) == ["r", "k", "v", "w", "u"]
    assert head(ops.chunk_comba, 6) == ["q", "k", "v", "p", "g", "beta"]
    assert head(ops.chunk_kda, 5) == ["q", "k", "v", "g", "beta"]
    assert head(ops.chunk_simple_gla, 5) == ["q", "k", "v", "g", "g_gamma"]
    assert head(ops.fused_recurrent_gla, 4) == ["q", "k", "v", "gk"]
    assert head(ops.chunk_dplr_delta_rule, 6) == ["q", "k", "v", "a", "b", "gk"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MECHANISMS)
def test_reference_op_is_the_mechanism(name, mode):
    """Each op (reference backend) reproduces its mechanism: odd T, initial state, scale, final state."""
    x, g = sample(name, 2, 63)
    m = get(name)
    h0 = torch.randn(2, 2, 8, 6, dtype=torch.float64, generator=g)
    o, S = m.recurrent(x, scale=0.4, initial_state=h0, output_final_state=True)
    o_op, S_op = op_of(name, mode)(**m.to_op(x), scale=0.4, initial_state=h0, output_final_state=True,
                                   backend="reference")
    assert rel_err(o_op, o) <= 1e-12 and rel_err(S_op, S) <= 1e-12
    assert o_op.shape == o.shape and S_op.dtype == torch.float64
    # no final state unless asked, except where fla's default returns it (fused_recurrent_rwkv7)
    returns_state = inspect.signature(op_of(name, mode)).parameters["output_final_state"].default
    assert (op_of(name, mode)(**m.to_op(x), backend="reference")[1] is not None) == returns_state


@pytest.mark.parametrize("name", MECHANISMS)
def test_reference_op_varlen(name):
    x, g = sample(name, 1, 100)
    m = get(name)
    cu = torch.tensor([0, 1, 37, 100])
    h0 = torch.randn(3, 2, 8, 6, dtype=torch.float64, generator=g)
    o, S = m.recurrent(x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_op, S_op = op_of(name, "chunk")(**m.to_op(x), scale=8 ** -0.5 if m.op != "rwkv7" else None,
                                      initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      backend="reference")
    assert rel_err(o_op, o) <= 1e-12 and rel_err(S_op, S) <= 1e-12


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_value_heads(name):
    """HV = 2H: value head j reads key head j // 2 (q/k and key-side gates repeated)."""
    m = get(name)
    x, g = sample(name, 1, 17, H=4)
    kwargs = m.to_op(x)
    key_side = {"q", "k", "p", "a", "b", "gk", "r", "w"} | ({"g"} if m.op in ("gla", "hgrn2") else set())
    grouped = {n: (t[:, :, ::2] if n in key_side else t) for n, t in kwargs.items()}
    expanded = {n: (t.repeat_interleave(2, dim=2) if n in key_side else t) for n, t in grouped.items()}
    o, _ = op_of(name, "chunk")(**expanded, backend="reference")
    o_g, _ = op_of(name, "chunk")(**grouped, backend="reference")
    assert o_g.shape == o.shape and rel_err(o_g, o) <= 1e-15


@pytest.mark.parametrize("backend", ["reference", None])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["delta_rule", "gated_delta_rule", "kda", "comba"])
def test_qk_l2norm_in_kernel(op, mode, backend):
    """use_qk_l2norm_in_kernel is x / sqrt(sum x^2 + 1e-6), exact in float64 (the inputs normalised
    beforehand by that formula, written out here, give the same result)."""
    name = {m.op: n for n, m in REGISTRY.items()}[op]
    x, _ = sample(name, 1, 9)
    kwargs = get(name).to_op(x)
    kwargs["q"], kwargs["k"] = 3 * kwargs["q"], 2 * kwargs["k"]
    o, _ = op_of(name, mode)(**kwargs, use_qk_l2norm_in_kernel=True, backend=backend)
    normed = {n: (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) if n in ("q", "k", "p") else t)
              for n, t in kwargs.items()}
    o_ref, _ = op_of(name, mode)(**normed, backend="reference")
    assert rel_err(o, o_ref) <= 1e-14


def gate_inputs(op, dtype=torch.float64):
    """Inputs of ``op`` with ``g`` a gate pre-activation, and A_log, dt_bias (fresh seed)."""
    name = {m.op: n for n, m in REGISTRY.items()}[op]
    x, g = sample(name, 1, 9)
    kwargs = get(name).to_op(x)
    kwargs["g"] = torch.randn(kwargs["g"].shape, dtype=torch.float64, generator=g)
    HV, K = kwargs["v"].shape[2], kwargs["k"].shape[3]
    A_log = torch.randn(HV, dtype=torch.float64, generator=g)
    dt_bias = torch.randn(HV * K if op == "kda" else HV, dtype=torch.float64, generator=g)
    return name, {n: t.to(dtype) for n, t in kwargs.items()}, A_log.to(dtype), dt_bias.to(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_gate_in_kernel(op, mode):
    """use_gate_in_kernel: ``g`` is the pre-activation of -exp(A_log) softplus(g + dt_bias); A_log
    without the flag is an error, not silently dropped."""
    name, kwargs, A_log, dt_bias = gate_inputs(op)
    fn = op_of(name, mode)
    o, _ = fn(**kwargs, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, backend="reference")
    o_ref, _ = fn(**{**kwargs, "g": mamba_gate(kwargs["g"], A_log, dt_bias)}, backend="reference")
    assert rel_err(o, o_ref) <= 1e-15
    for extra in (dict(A_log=A_log), dict(dt_bias=dt_bias)):
        with pytest.raises(ValueError, match="use_gate_in_kernel"):
            fn(**kwargs, **extra, backend="reference")


@pytest.mark.parametrize("backend, dtype", [("torch", torch.float64), ("triton", torch.float32)])
@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_fused_recurrent_gate_in_kernel_gradients(op, backend, dtype, monkeypatch):
    """fused_recurrent_<op>(use_gate_in_kernel=True): output and the gradients of g, A_log, dt_bias
    against the per-token reference in float64, the gate formed there from the same leaves.
    dA_log and ddt_bias sum the per-token gradients over T (and K): their tolerance is scaled by
    that sum's cancellation, sum |term| / |sum| (as for g_gamma in tests/chunk)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    name, kwargs, A_log, dt_bias = gate_inputs(op, dtype)
    fn = op_of(name, "fused_recurrent")
    rest = {n: t for n, t in kwargs.items() if n != "g"}
    leaves = [t.clone().requires_grad_() for t in (kwargs["g"], A_log, dt_bias)]
    o, _ = fn(**rest, g=leaves[0], use_gate_in_kernel=True, A_log=leaves[1], dt_bias=leaves[2], backend=backend)
    do = torch.randn(o.shape, dtype=torch.float64, generator=generator(1))
    got = (o, *torch.autograd.grad(o, leaves, do.to(dtype)))
    ref_leaves = [t.double().requires_grad_() for t in (kwargs["g"], A_log, dt_bias)]
    gate = mamba_gate(*ref_leaves)
    o_ref, _ = fn(**{n: t.double() for n, t in rest.items()}, g=gate, backend="reference")
    want = (o_ref, *torch.autograd.grad(o_ref, ref_leaves + [gate], do))
    dg, dgate = want[1], want[4]
    terms = {"dA_log": (dgate * gate).abs().sum((0, 1)).sum(-1) if op == "kda" else (dgate * gate).abs().sum((0, 1)),
             "ddt_bias": dg.abs().sum((0, 1)).flatten()}
    # measured over 33 fresh seeds: float64 at most 2e-15; fp32 (Triton, interpreter) at most 9e-6 (GDN's dA_log)
    tol = 1e-12 if dtype == torch.float64 else 3e-5
    for name, x, ref in zip(("o", "dg", "dA_log", "ddt_bias"), got, want):
        cancellation = (terms[name].norm() / ref.norm()).item() if name in terms else 1.0
        assert rel_err(x, ref) <= tol * max(1.0, cancellation), (name, rel_err(x, ref), cancellation)


def test_allow_neg_eigval_widens_beta():
    x, _ = sample("deltanet", 1, 9)
    x["beta"] = 1.5 * torch.ones_like(x["beta"])
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], backend="reference")
    o, _ = ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], allow_neg_eigval=True, backend="reference")
    assert rel_err(o, get("deltanet").recurrent(x)[0]) <= 1e-12


def test_linear_attn_normalize():
    """normalize=True: o_t / (scale q_t . sum_{s<=t} k_s), per sequence with cu_seqlens."""
    x, _ = sample("linear_attention", 1, 12)
    x["k"] = x["k"].abs()
    x["q"] = x["q"].abs()
    cu = torch.tensor([0, 5, 12])
    o, _ = ops.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=False, cu_seqlens=cu, backend="reference")
    o_n, _ = ops.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=True, cu_seqlens=cu, backend="reference")
    t, kt = 7, x["k"][:, 5:8].sum(1)
    z = (8 ** -0.5 * x["q"][:, t] * kt).sum(-1, keepdim=True)
    assert rel_err(o_n[:, t], o[:, t] / z) <= 1e-9  # the normaliser adds 1e-10 to z


def test_simple_gla_gates_add_and_retention_is_retnet():
    x, g = sample("retnet", 1, 20)
    gt = -torch.rand(1, 20, 2, dtype=torch.float64, generator=g)
    o, _ = ops.chunk_simple_gla(x["q"], x["k"], x["v"], g=gt, g_gamma=x["_log_gamma"], backend="reference")
    gla_g = (gt + x["_log_gamma"])[..., None].expand(1, 20, 2, 8)
    assert rel_err(o, ops.chunk_gla(x["q"], x["k"], x["v"], gla_g, backend="reference")[0]) <= 1e-15
    o_ret, _ = ops.chunk_retention(x["q"], x["k"], x["v"], backend="reference")
    assert rel_err(o_ret, get("retnet").recurrent(x)[0]) <= 1e-12
    o_none, _ = ops.chunk_simple_gla(x["q"], x["k"], x["v"], backend="reference")
    assert rel_err(o_none, ops.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=False, backend="reference")[0]) <= 1e-15


def test_reference_op_gradients():
    """Differentiable in every tensor argument and the initial state (autograd against finite differences)."""
    for name in ("gated_deltanet", "rwkv7", "rwkv6"):
        m = get(name)
        x, g = sample(name, 1, 4, H=1, K=3, V=2)
        kwargs = m.to_op(x)
        names = list(kwargs)
        h0 = torch.randn(1, 1, 3, 2, dtype=torch.float64, generator=g, requires_grad=True)

        def f(h0, *ts):
            return op_of(name, "chunk")(**dict(zip(names, ts)), initial_state=h0, output_final_state=True,
                                        backend="reference")

        assert torch.autograd.gradcheck(f, (h0, *(kwargs[n].detach().clone().requires_grad_() for n in names)))


@pytest.mark.parametrize("name", MECHANISMS)
def test_default_backend_matches_the_reference(name):
    """backend=None on the CPU (PyTorch chunk path where it exists): float64, T not a multiple of the chunk."""
    x, g = sample(name, 1, 100, K=16, V=16)
    m = get(name)
    h0 = torch.randn(1, 2, 16, 16, dtype=torch.float64, generator=g)
    for mode in MODES:
        o, S = op_of(name, mode)(**m.to_op(x), initial_state=h0, output_final_state=True)
        o_ref, S_ref = op_of(name, mode)(**m.to_op(x), initial_state=h0, output_final_state=True,
                                         backend="reference")
        assert rel_err(o, o_ref) <= 1e-10 and rel_err(S, S_ref) <= 1e-10


@pytest.mark.parametrize("name", MECHANISMS)
def test_autocast_leaves_the_op_in_its_input_dtype(name):
    """Under CPU bf16 autocast an op computes in its inputs' dtype, exactly as outside it."""
    x, _ = sample(name, 1, 70, K=16, V=16)
    kwargs = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
              for n, t in get(name).to_op(x).items()}
    o, S = op_of(name, "chunk")(**kwargs, output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o_ac, S_ac = op_of(name, "chunk")(**kwargs, output_final_state=True)
    assert o_ac.dtype == torch.float32 and torch.equal(o_ac, o) and torch.equal(S_ac, S)


def _hgrn_loop(x, g, h0, cu):
    """HGRN's h_t = exp(g_t) h_{t-1} + x_t per sequence of ``cu``, float64: (o, final [N, D])."""
    outs, finals = [], []
    for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        h = h0[n]
        for t in range(bos, eos):
            h = g[0, t].exp() * h + x[0, t]
            outs.append(h)
        finals.append(h)
    return torch.stack(outs)[None], torch.stack(finals)


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float64), ("torch", torch.float64),
                                           ("triton", torch.float32), ("triton", torch.float16)])
@pytest.mark.parametrize("mode", MODES)
def test_hgrn_is_the_elementwise_recurrence(mode, backend, dtype):
    """fla's HGRN op (simple_gla with one head per channel, K = V = 1) against its recurrence written out:
    varlen with an empty and a one-token sequence, a partial last chunk, a strong gate, an initial state,
    every gradient (the state's cotangent expanded, as ``S.sum()`` hands it)."""
    gen = generator()
    cu, D = [0, 70, 70, 71, 100], 6
    x = torch.randn(1, cu[-1], D, dtype=torch.float64, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, cu[-1], D, dtype=torch.float64, generator=gen))
    g[..., 0] = -6.0 * (0.75 + 0.5 * torch.rand(cu[-1], dtype=torch.float64, generator=gen))
    h0 = torch.randn(len(cu) - 1, D, dtype=torch.float64, generator=gen)
    mine = [x.to(dtype).requires_grad_(), g.to(dtype).requires_grad_(),
            h0.to(torch.float32 if dtype == torch.float16 else dtype).requires_grad_()]
    ref = [t.detach().double().requires_grad_() for t in mine]
    o, S = getattr(ops, f"{mode}_hgrn")(*mine[:2], initial_state=mine[2], output_final_state=True,
                                        cu_seqlens=torch.tensor(cu), backend=backend)
    o_ref, S_ref = _hgrn_loop(*ref, cu)
    assert o.shape == x.shape and o.dtype == dtype and S.shape == h0.shape
    # measured (Triton, interpreter, 3 draws): fp32 o 4.3e-7, final state 2.4e-7, dx 4.3e-7, dg 1.0e-6;
    # fp16 o 2.1e-4, dx 3.1e-4, dg 4.6e-4 (one ulp), d initial_state 2.2e-4 (a state kept in fp32)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 1e-3}[dtype]
    grad_tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3}[dtype]
    assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < tol
    do = torch.randn(o.shape, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((o * do.to(dtype)).sum() + S.sum(), mine)
    want = torch.autograd.grad((o_ref * do).sum() + S_ref.sum(), ref)
    for name, a, b, leaf in zip(("x", "g", "initial_state"), got, want, mine):
        assert a.dtype == leaf.dtype and rel_err(a, b) < grad_tol, f"d{name}: {rel_err(a, b):.3g}"


def test_hgrn_refusals_name_the_argument():
    x = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="`x` must be a tensor \\[B, T, D\\]"):
        ops.chunk_hgrn(x[..., None], x)
    with pytest.raises(ValueError, match="`g` must have x's shape"):
        ops.fused_recurrent_hgrn(x, x[:, :4])
    with pytest.raises(ValueError, match="`initial_state` must be \\[N, D\\] = \\[2, 4\\]"):
        ops.chunk_hgrn(x, -x.abs(), initial_state=torch.zeros(2, 4, 1, 1))
    with pytest.raises(ValueError, match="`g` is a log-space decay"):   # a gate above 0 (a growing state)
        ops.chunk_hgrn(x, x.abs() + 0.1)
