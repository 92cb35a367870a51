"""Helpers shared by the tests and the benchmarks (one place, never re-defined in a test)."""

from __future__ import annotations

import contextlib

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (the absolute ||x - ref|| when ref is zero). NaN or Inf in
    ``x`` gives inf."""
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    denom = ref.norm().item()
    num = (x - ref).norm().item()
    return num if denom == 0 else num / denom


# The fresh seeds drawn by ``generator(None)`` during the current test (tests/conftest.py clears
# the list before each test and prints it with a failure).
fresh_seeds: list[int] = []


def generator(seed: int | None = None, device="cpu") -> torch.Generator:
    """A generator seeded from ``seed``; when None, from a fresh random seed, recorded in
    :data:`fresh_seeds` (printed by pytest with a failure: pass it as ``seed`` to reproduce)."""
    g = torch.Generator(device=device)
    if seed is None:
        fresh_seeds.append(g.seed())
    else:
        g.manual_seed(seed)
    return g


def nan_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN, so that an unwritten element fails a check."""
    return torch.full_like(x, float("nan"))


# Non-contiguous layouts of a gradient, as autograd hands them to a backward: a loss through
# ``x.sum()`` or ``x[..., :1]`` gives a stride-0 (expanded) cotangent, one through ``x.mT`` a
# transposed one, one through ``x[..., ::2]`` a sliced one.
LAYOUTS = ("contiguous", "expanded", "transposed", "transposed_outer", "sliced")


def strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` in ``layout`` (one of :data:`LAYOUTS`): "transposed" swaps the last two dims in memory,
    "transposed_outer" dims 1 and 2 (a head-first [B, H, T, V] buffer seen as [B, T, H, V]), "sliced"
    is every other element of a last dim twice as wide (offset 1). "expanded" changes the values: the
    first entry along dim -2 repeated with stride 0 (use the returned tensor's values)."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "expanded":
        return x[..., :1, :].expand(x.shape)
    if layout == "transposed":
        return x.transpose(-2, -1).contiguous().transpose(-2, -1)
    if layout == "transposed_outer":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "sliced":
        return torch.stack([torch.zeros_like(x), x], -1)[..., 1]
    raise ValueError(f"unknown layout {layout!r}, expected one of {LAYOUTS}")


# (layout of o's cotangent, of the final state's) for the ops' backward tests; None leaves that
# output out of the loss (a loss on the state alone)
COTANGENTS = (("expanded", "contiguous"), ("transposed_outer", "contiguous"), ("sliced", "sliced"),
              ("contiguous", "expanded"), ("contiguous", "transposed"), (None, "transposed"), (None, "sliced"))


def check_gradients(outs, leaves: dict, ref_outs, ref_leaves: dict, g_ref, cotangents, tol: float, what: str = "",
                    tols: dict | None = None):
    """Asserts that every leaf's gradient for ``cotangents`` (of each of ``outs``; None: that output is
    not in the loss), handed to the backward as they are (any strides), is within ``tol`` (relative) of
    the reference's (``ref_outs``, ``ref_leaves`` of the same names; cotangents in float64 there).
    ``tols``: a tolerance for some leaves by name, in place of ``tol``.

    ``g_ref``: the reference's log gate when ``A_log`` and ``dt_bias`` form it (Mamba-2's gate), else
    None. Their gradients are sums over tokens of dL/dg_t dg_t/dtheta: the error is the per-token error
    times sum |dL/dg_t dg_t/dtheta|, which can exceed |dtheta| a lot (cancellation in the sum), so their
    tolerance is scaled by that ratio, computed from the reference.
    """
    used = [i for i, c in enumerate(cotangents) if c is not None]
    names = list(leaves)
    got = torch.autograd.grad([outs[i] for i in used], [leaves[n] for n in names], [cotangents[i] for i in used],
                              retain_graph=True, allow_unused=True)
    targets = [ref_leaves[n] for n in names] + ([g_ref] if g_ref is not None else [])
    want = torch.autograd.grad([ref_outs[i] for i in used], targets, [cotangents[i].double() for i in used],
                               retain_graph=True, allow_unused=True)
    want = [torch.zeros_like(t) if w is None else w for w, t in zip(want, targets)]
    magnitude = {}
    if g_ref is not None:
        params = [ref_leaves["A_log"], ref_leaves["dt_bias"]]
        magnitude = dict(zip(("A_log", "dt_bias"),
                             torch.autograd.grad((g_ref * want[-1].abs()).sum(), params, retain_graph=True)))
    for n, a, b in zip(names, got, want):
        assert a is not None, f"{what}d{n}: no gradient"
        assert a.dtype == leaves[n].dtype, f"{what}d{n}: {a.dtype}"
        t = (tols or {}).get(n, tol)
        t *= max(1.0, magnitude[n].norm().item() / (b.norm().item() or 1.0)) if n in magnitude else 1.0
        assert rel_err(a, b) < t, f"{what}d{n}: {rel_err(a, b):.3g} (tolerance {t:.3g})"


@contextlib.contextmanager
def emulate_tf32():
    """Within the block, Triton's interpreter multiplies fp32 operands of ``input_precision="tf32"``
    dots as the H200's tensor cores do: each operand truncated to TF32's 10 mantissa bits (toward
    zero: this reproduced the H200's errors on a DPLR backward case to 4 digits), the products
    accumulated in fp32. Outside it, and for "tf32x3" or "ieee", the interpreter multiplies in plain
    fp32, so CPU tests do not see the tensor cores' rounding unless they ask for it here."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot

    def truncate(x):
        return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        name = str(input_precision).upper()
        if name.endswith("TF32") and a.dtype.primitive_bitwidth == 32 and b.dtype.primitive_bitwidth == 32:
            out = np.matmul(truncate(a.data), truncate(b.data), dtype=d.data.dtype) + d.data
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return plain(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = plain


@contextlib.contextmanager
def emulate_bf16():
    """Within the block, Triton's interpreter computes with bf16 as the GPU does. It keeps bf16 tensors as
    their raw 16 bits (numpy has no bf16) and, outside conversions to and from fp32, treats those bits as
    integers: bf16 arithmetic, dots on bf16 operands and casts from fp16 come out as garbage. Here every
    float operation on bf16 runs in fp32 and rounds its result to bf16 (to nearest even), dots multiply
    the bf16 operands exactly and accumulate in the accumulator's dtype (fp32), and every cast to bf16
    rounds to nearest even, as the GPU's does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder, handle = interpreter.InterpreterBuilder, interpreter.TensorHandle
    bf16 = tl.bfloat16

    def is_bf16(h):
        return h.dtype.scalar == bf16

    def widen(data):   # bf16 bits -> fp32, exact
        return (np.asarray(data).astype(np.uint16).astype(np.uint32) << 16).view(np.float32)

    def narrow(x):     # fp32 -> bf16 bits, to nearest even; NaN stays NaN
        b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        r = ((b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), np.uint16(0x7FC0), r)

    def value(h):      # a handle's values as numbers (fp32 for bf16)
        return widen(h.data) if is_bf16(h) else h.data

    def as_bf16(out):
        return handle(narrow(out), bf16) if out.dtype == np.float32 else handle(out, tl.int1)

    saved = {n: getattr(builder, n) for n in ("binary_op", "create_fma", "unary_op", "create_dot", "cast_impl",
                                               "create_fp_to_fp", "create_fp_trunc", "create_fp_ext", "create_si_to_fp",
                                               "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui")}

    def binary_op(self, lhs, rhs, op):
        if is_bf16(lhs) or is_bf16(rhs):
            return as_bf16(op(value(lhs), value(rhs)))
        return saved["binary_op"](self, lhs, rhs, op)

    def create_fma(self, x, y, z):
        if is_bf16(z):
            out = value(x).astype(np.float64) * value(y) + value(z)   # exact product, rounded through fp32
            return handle(narrow(out.astype(np.float32)), bf16)
        return saved["create_fma"](self, x, y, z)

    def unary_op(self, arg, op):
        if is_bf16(arg):
            return as_bf16(op(widen(arg.data)).astype(np.float32))
        return saved["unary_op"](self, arg, op)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if is_bf16(a) or is_bf16(b):
            acc = value(d).astype(np.float32)
            out = np.matmul(value(a).astype(np.float32), value(b).astype(np.float32), dtype=np.float32) + acc
            return handle(narrow(out), bf16) if is_bf16(d) else handle(out.astype(d.data.dtype), d.dtype.scalar)
        return saved["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast(name):
        def impl(self, src, dst_type, *rest):
            fp8 = 8 in (src.dtype.scalar.primitive_bitwidth, dst_type.scalar.primitive_bitwidth)
            if dst_type.scalar == bf16 and not is_bf16(src) and not fp8:
                x = np.asarray(src.data).astype(np.float32)
                if rest and "RTZ" in str(rest[0]).upper():   # an explicit round-toward-zero
                    return handle(np.where(np.isnan(x), np.uint16(0x7FC0),
                                           (x.view(np.uint32) >> 16).astype(np.uint16)), bf16)
                return handle(narrow(x), bf16)
            if is_bf16(src) and dst_type.scalar != bf16 and not fp8:
                return handle(widen(src.data).astype(interpreter._get_np_dtype(dst_type)), dst_type.scalar)
            return saved[name](self, src, dst_type, *rest)
        return impl

    reduce_sum = interpreter.ReduceOps.sum

    def sum_(self, input):   # bf16 sums in fp32, rounded once (Triton 3.6 does not widen bf16 for tl.sum)
        if input.dtype.scalar == bf16:
            out = np.sum(widen(input.handle.data), axis=self.axis, keepdims=self.keep_dims, dtype=np.float32)
            out = np.asarray(out, dtype=np.float32)
            return self.to_tensor(narrow(out).reshape(out.shape), input.dtype)
        return reduce_sum(self, input)

    def get_bf16(self, value):   # a bf16 constant (the interpreter has none)
        return handle(narrow(np.array([value], dtype=np.float32)), bf16)

    had_get_bf16 = hasattr(builder, "get_bf16")
    saved["get_bf16"] = getattr(builder, "get_bf16", None)
    builder.get_bf16 = get_bf16
    builder.binary_op, builder.create_fma, builder.unary_op, builder.create_dot = binary_op, create_fma, unary_op, create_dot
    interpreter.ReduceOps.sum = sum_
    for name in ("cast_impl", "create_fp_to_fp", "create_fp_trunc", "create_fp_ext", "create_si_to_fp", "create_ui_to_fp",
                 "create_fp_to_si", "create_fp_to_ui"):
        setattr(builder, name, cast(name))
    try:
        yield
    finally:
        interpreter.ReduceOps.sum = reduce_sum
        for name, fn in saved.items():
            if name == "get_bf16" and not had_get_bf16:
                del builder.get_bf16
            else:
                setattr(builder, name, fn)


def fla_on_cpu(monkeypatch, module: str = "fla.layers"):
    """fla's ``module`` for a test on a CPU: the test is skipped where fla is not importable (the
    ``compat`` extra) or TRITON_INTERPRET is not 1 (fla's norms and convolutions are Triton kernels);
    :func:`fla_cpu_patches` applied through pytest's ``monkeypatch``."""
    import os

    import pytest
    found = pytest.importorskip(module)
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("fla's norms and convolutions need TRITON_INTERPRET=1 on a CPU")
    for owner, name, value in fla_cpu_patches():
        monkeypatch.setattr(owner, name, value)
    return found


def fla_cpu_patches() -> list:
    """``(owner, attribute, value)`` patches that let fla 0.6.0's layer and model classes run on a
    CPU under ``TRITON_INTERPRET=1`` (for tests that compare with fla itself; fla must be importable).

    fla's own Triton kernels for norms, convolutions and the L2 norm run in the interpreter, with one
    config per autotuned kernel (no benchmarking: the interpreter has no timer); its recurrence
    kernels do not run there, so its layers' op calls go to fla's PyTorch references
    (``fla.ops.*.naive``), fed as fla's kernels prepare their inputs (:func:`fla_reference_op`).
    HGRN's and linear attention's go to fla's ``naive_recurrent_hgrn`` and
    ``naive_recurrent_linear_attn``, RetNet's to fla's ``naive_retention`` (without a state; with one,
    to fastweight's reference op), RWKV-6's to fla's ``naive_recurrent_rwkv6``, Gated DeltaProduct's
    to fla's ``naive_recurrent_gated_delta_product``. Comba's and RWKV-7's go to fastweight's
    reference ops (fla ships no naive RWKV-7; its naive Comba reads the decayed state, its kernels
    the undecayed one; ``docs/chunk.md``); its attention layers' flash-attn call goes to PyTorch's SDPA."""
    import functools

    from triton.runtime import autotuner

    import fla.layers.attn as attn
    import fla.layers.comba as comba
    import fla.layers.delta_net as delta_net
    import fla.layers.gated_deltanet as gated_deltanet
    import fla.layers.gated_deltaproduct as gated_deltaproduct
    import fla.layers.gla as gla
    import fla.layers.hgrn as hgrn
    import fla.layers.hgrn2 as hgrn2
    import fla.layers.kda as kda
    import fla.layers.linear_attn as linear_attn
    import fla.layers.multiscale_retention as retention
    import fla.layers.rwkv6 as rwkv6
    import fla.layers.rwkv7 as rwkv7
    from fastweight import ops
    patches = [(autotuner.Autotuner, "_bench", lambda self, *a, config, **kw: [0.0, 0.0, 0.0]),
               (autotuner.Autotuner, "check_disk_cache", lambda self, key, configs, bench: (bench(), False)[1])]
    for module, names, kind in ((gated_deltanet, ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"), "gdn"),
                                (kda, ("chunk_kda", "fused_recurrent_kda"), "kda"),
                                (delta_net, ("chunk_delta_rule", "fused_recurrent_delta_rule"), "deltanet"),
                                (gla, ("chunk_gla", "fused_recurrent_gla"), "gla"),
                                (hgrn2, ("chunk_gla", "fused_recurrent_gla"), "gla")):
        patches += [(module, name, functools.partial(fla_reference_op, kind)) for name in names]
    patches += [(comba, name, functools.partial(getattr(ops, name), backend="reference"))
                for name in ("chunk_comba", "fused_recurrent_comba")]
    patches += [(rwkv7, "chunk_rwkv7", _fla_rwkv7), (rwkv7, "fused_mul_recurrent_rwkv7", _fla_fused_mul_rwkv7)]
    patches += [(attn, "flash_attn_func", _flash_attn_by_sdpa)]
    patches += [(hgrn, name, _fla_hgrn) for name in ("chunk_hgrn", "fused_recurrent_hgrn")]
    patches += [(linear_attn, name, _fla_linear_attn)
                for name in ("chunk_linear_attn", "fused_chunk_linear_attn", "fused_recurrent_linear_attn")]
    patches += [(retention, name, _fla_retention)
                for name in ("chunk_retention", "fused_chunk_retention", "parallel_retention",
                             "fused_recurrent_retention")]
    patches += [(rwkv6, name, _fla_rwkv6) for name in ("chunk_rwkv6", "fused_recurrent_rwkv6")]
    patches += [(gated_deltaproduct, "chunk_gated_delta_product", _fla_gated_delta_product),
                (gated_deltaproduct, "fused_recurrent_gated_delta_rule", _fla_gated_delta_product)]
    return patches


def _fla_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla's HGRN op calls by fla's ``naive_recurrent_hgrn`` (no ``cu_seqlens``)."""
    from fla.ops.hgrn.naive import naive_recurrent_hgrn
    if cu_seqlens is not None:
        raise NotImplementedError("_fla_hgrn: no cu_seqlens")
    return naive_recurrent_hgrn(x, g, initial_state, output_final_state)


def _fla_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **unused):
    """fla's retention op calls: by fla's ``naive_retention`` (head-first, its own scale K^-1/2) where
    no state goes in or out and nothing is packed, else by fastweight's reference op."""
    from fla.ops.retention.naive import naive_retention

    from fastweight import ops
    if initial_state is None and not output_final_state and cu_seqlens is None and scale is None:
        o = naive_retention(*(t.transpose(1, 2) for t in (q, k, v)))
        return o.transpose(1, 2), None
    return ops.chunk_retention(q, k, v, scale, initial_state, output_final_state, cu_seqlens, backend="reference")


def _fla_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **unused):
    """fla's RWKV-6 op calls by fla's ``naive_recurrent_rwkv6`` (head-first; no ``cu_seqlens``)."""
    from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6
    if cu_seqlens is not None:
        raise NotImplementedError("_fla_rwkv6: no cu_seqlens")
    o, S = naive_recurrent_rwkv6(*(t.transpose(1, 2) for t in (r, k, v, w)), u, scale, initial_state,
                                 output_final_state)
    return o.transpose(1, 2), S


def _fla_gated_delta_product(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                             cu_seqlens=None, num_householder=1, use_qk_l2norm_in_kernel=False, **unused):
    """fla's Gated DeltaProduct op calls by fla's ``naive_recurrent_gated_delta_product``, q and k by
    fla's ``l2norm``; its decode call (``fused_recurrent_gated_delta_rule`` over the T*n substeps, q
    and g zero where unread) is the same function at n = 1."""
    from fla.modules.norm.l2norm import l2norm
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    o, S = naive_recurrent_gated_delta_product(q, k, v, g, beta, q.shape[-1] ** -0.5 if scale is None else scale,
                                               cu_seqlens, initial_state, output_final_state, num_householder)
    return o, S if output_final_state else None


def _fla_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=False,
                     cu_seqlens=None, **unused):
    """fla's linear-attention op calls by fla's ``naive_recurrent_linear_attn`` (no ``cu_seqlens``)."""
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
    if cu_seqlens is not None:
        raise NotImplementedError("_fla_linear_attn: no cu_seqlens")
    return naive_recurrent_linear_attn(q, k, v, scale, initial_state, output_final_state, normalize)


def _flash_attn_by_sdpa(q, k, v, causal=True, window_size=(-1, -1), **unused):
    """flash-attn's ``flash_attn_func`` (q [B, T, H, D], k and v [B, S, H_kv, D], the causal mask
    aligned to the last key, ``window_size`` (left, right), -1 unbounded) by PyTorch's SDPA, for
    fla's attention layers on a CPU (flash-attn has no CPU build)."""
    import torch.nn.functional as F
    T, S, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    query = torch.arange(S - T, S)[:, None]
    key = torch.arange(S)[None, :]
    mask = key <= query if causal else torch.ones(T, S, dtype=torch.bool)
    if window_size[0] >= 0:
        mask = mask & (key >= query - window_size[0])
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return o.transpose(1, 2)


def _fla_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
               **numerics):
    """fla's layer call of chunk_rwkv7, fla's arguments passed on to fastweight's reference op (its
    ``safe_gate``/``lower_bound``/``chunk_size`` choose kernel numerics only: ``fla_compat.gate_bound``)."""
    from fastweight import ops
    return ops.chunk_rwkv7(r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                           backend="reference", **numerics)


def _fla_fused_mul_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=None, output_final_state=False,
                         cu_seqlens=None, **unused):
    """fla's decode form of RWKV-7 (its removal key kk and rate a) as the DPLR op's a = -kk, b = kk a."""
    return _fla_rwkv7(r, w, k, v, -kk, kk * a, scale, initial_state, output_final_state, cu_seqlens)


def fla_reference_op(kind: str, q, k, v, g=None, beta=None, gk=None, scale=None, initial_state=None,
                     output_final_state=False, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                     use_gate_in_kernel=False, A_log=None, dt_bias=None, allow_neg_eigval=False, state_v_first=False,
                     cu_seqlens=None, **options):
    """One of fla's layer op calls (``kind``: "gdn", "kda", "deltanet", "gla") by fla's references:
    the in-kernel gate by fla's ``naive_*_gate``, beta's in-kernel sigmoid, q and k by fla's
    ``l2norm``, grouped value heads by repeating q and k, the state returned ``[N, H, V, K]`` with
    ``state_v_first``. No initial state, no ``cu_seqlens``."""
    from fla.modules.norm.l2norm import l2norm
    if cu_seqlens is not None or initial_state is not None or (options.get("safe_gate") and kind != "kda"):
        raise NotImplementedError("fla_reference_op: no cu_seqlens, initial_state or safe_gate (but KDA's)")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if beta is not None and use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid() * (2 if allow_neg_eigval else 1)
    if kind == "gdn":
        from fla.ops.gated_delta_rule.gate import naive_gdn_gate
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
        g = naive_gdn_gate(g, A_log, dt_bias) if use_gate_in_kernel else g
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
        o, S = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale, None, output_final_state)
    elif kind == "kda":
        # fla's KDA: lower_bound changes the in-kernel gate; safe_gate only picks a kernel
        from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
        from fla.ops.kda.naive import naive_recurrent_kda
        bound = options.get("lower_bound")
        if use_gate_in_kernel:
            g = naive_kda_gate(g, A_log, dt_bias) if bound is None else naive_kda_lowerbound_gate(g, A_log, dt_bias,
                                                                                                 bound)
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
        o, S = naive_recurrent_kda(q, k, v, g, beta, scale, None, output_final_state)
    elif kind == "deltanet":
        from fla.ops.delta_rule.naive import delta_rule_recurrence
        o, S = delta_rule_recurrence(*(t.transpose(1, 2) for t in (q, k, v, beta)), None, output_final_state)
        o = o.transpose(1, 2)
    else:
        from fla.ops.gla.naive import naive_recurrent_gla
        if scale is not None and scale != q.shape[-1] ** -0.5:
            q = q * (scale * q.shape[-1] ** 0.5)   # fla's naive GLA applies K^-0.5 itself
        o, S = naive_recurrent_gla(q, k, v, g if gk is None else gk, None, output_final_state)
    if S is not None and state_v_first:
        S = S.transpose(-1, -2)
    return o.to(v.dtype), S
