"""The fuzz's cases: the spaces they are drawn from, the case record, its inputs and cotangents.

Everything here is a pure function of a case (or of its seed) and is drawn on the CPU, so the
same seed gives the same case and the same tensors on any device; running and checking a case
is ``fastweight.fuzz``.
"""

from __future__ import annotations

import inspect
import random
import zlib
from dataclasses import dataclass, field

import torch

from fastweight import ops
from fastweight.mechanisms import OPS
from fastweight.mechanisms.base import l2norm

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("chunk", "fused_recurrent")
CHUNK = 64
GATE_STRENGTHS = ("mild", "mixed", "strong", "strong_tail")
COTANGENTS = ("dense", "expanded", "ones", "transposed", "sliced", "permuted", "heads_first", "none")

# the per-token log gates of each op (name -> per key channel or one per value head)
GATES = {name: {n: kind == "channel" for n, kind in op.gates.items()} for name, op in OPS.items() if op.gates}
# L2-normalised keys, and the options allow_neg_eigval and use_qk_l2norm_in_kernel
NEG_EIGVAL = tuple(name for name, op in OPS.items() if op.neg_eigval)
GATE_IN_KERNEL = tuple(name for name, op in OPS.items() if op.gate_in_kernel)  # where the op's signature has it
SAME_HEADS = ("rwkv6",)                                             # raise for HV != H (fastweight.ops)


@dataclass(frozen=True)
class Space:
    """Where cases are drawn from. Each op gets ``common`` (K, V) pairs plus one of ``odd``
    (by its index), so the number of distinct head sizes, hence of Triton compilations, stays small."""
    name: str
    lengths: tuple
    batch: tuple
    heads: tuple
    groups: tuple
    max_value_heads: int
    common: tuple
    odd: tuple
    max_tokens: int
    reference_tokens: int
    varlen: float = 0.35
    profiles: dict = field(default_factory=dict)   # "mode" or "mode/dtype" -> profiles (none: every case its own)


SPACES = {
    "ci": Space("ci", lengths=(1, 43, 63, 64, 65, 100, 130), batch=(1, 2), heads=(1, 2), groups=(1, 2),
                max_value_heads=2, common=((16, 16),), odd=((16, 32), (32, 16), (32, 32)), max_tokens=130,
                reference_tokens=10 ** 9),
    "smoke": Space("smoke", lengths=(1, 20, 65), batch=(1, 2), heads=(1,), groups=(1, 2), max_value_heads=2,
                   common=((16, 16),), odd=((16, 32),), max_tokens=80, reference_tokens=10 ** 9),
    "gpu": Space("gpu", lengths=(1, 43, 64, 65, 130, 257, 700, 1000, 2048), batch=(1, 2, 4), heads=(1, 2, 4, 8),
                 groups=(1, 2, 4), max_value_heads=8, common=((128, 128),),
                 odd=((16, 256), (256, 16), (32, 128), (128, 32), (64, 64), (256, 256), (16, 16), (64, 128)),
                 max_tokens=4096, reference_tokens=256,
                 profiles={"chunk": 2, "chunk/fp32": 1, "fused_recurrent": 3}),
}


@dataclass(frozen=True)
class Case:
    space: str
    op: str
    mode: str
    backend: str
    dtype: str
    seed: int
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    lengths: tuple | None      # cu_seqlens' sequence lengths (B = 1), or None
    cu_dtype: str
    initial_state: bool
    output_final_state: bool
    gates: str                 # GATE_STRENGTHS
    gate_dtype: str            # log gates and beta: the case's dtype or fp32
    scale: float | None
    options: tuple             # (name, value) pairs passed to the op
    do: str                    # cotangent of o (COTANGENTS)
    dS: str                    # cotangent of the final state

    @property
    def N(self):
        return self.B if self.lengths is None else len(self.lengths)

    def describe(self) -> str:
        shape = f"B={self.B} T={self.T}" if self.lengths is None else f"lengths={list(self.lengths)}({self.cu_dtype})"
        opts = " ".join(f"{n}={v}" for n, v in self.options)
        gated = self.op in GATES or dict(self.options).get("use_gate_in_kernel")
        gates = f" gates={self.gates}/{self.gate_dtype}" if gated else ""
        return (f"{self.mode}_{self.op} {self.backend} {self.dtype} {shape} H={self.H} HV={self.HV} K={self.K} "
                f"V={self.V} h0={int(self.initial_state)} final={int(self.output_final_state)}{gates}"
                f" scale={self.scale} do={self.do} dS={self.dS} {opts}".rstrip())

    @classmethod
    def from_json(cls, fields: dict) -> "Case":
        """The case of :meth:`Result.to_json`'s ``case`` (JSON turns tuples into lists)."""
        return cls(**{**fields, "lengths": tuple(fields["lengths"]) if fields["lengths"] else None,
                      "options": tuple(tuple(o) for o in fields["options"])})

    def repro(self) -> str:
        return (f"python -m fastweight.fuzz --space {self.space} --op {self.op} --mode {self.mode} "
                f"--backend {self.backend} --dtype {self.dtype} --seed {self.seed}")


def op_shapes(space: Space, op: str) -> tuple:
    return space.common + (space.odd[ops.OPS.index(op) % len(space.odd)],)


def _varlen_lengths(rng: random.Random, space: Space) -> tuple:
    n = rng.choice((2, 3, 4))
    pool = (0, 1) + space.lengths
    lengths = [rng.choice(pool) for _ in range(n)]
    while sum(lengths) > space.max_tokens:
        lengths[lengths.index(max(lengths))] //= 2
    if sum(lengths) == 0:
        lengths[-1] = rng.choice(space.lengths)
    return tuple(lengths)


def draw(space: Space | str, op: str, seed: int, mode: str, backend: str, dtype: str) -> Case:
    """The case of ``seed`` for (op, mode, backend, dtype) in ``space``: a pure function of its arguments.

    With ``space.profiles`` the fields that select compiled kernels (head sizes, grouping, flags,
    options, cotangent layouts, T's divisibility) come from one of a few profiles per (op, mode,
    dtype), the rest (lengths, batch, heads, gate strength, scale, values) from the seed."""
    space = SPACES[space] if isinstance(space, str) else space
    rng = random.Random(f"{space.name}/{op}/{mode}/{backend}/{dtype}/{seed}")
    n_profiles = space.profiles.get(f"{mode}/{dtype}", space.profiles.get(mode, 0))
    cfg = random.Random(f"{space.name}/{op}/{mode}/{backend}/{dtype}/profile{rng.randrange(n_profiles)}") \
        if n_profiles else rng
    K, V = cfg.choice(op_shapes(space, op))
    group = cfg.choice([g for g in space.groups if g == 1 or op not in SAME_HEADS])
    varlen, t_kind = cfg.random() < space.varlen, cfg.choice(("one", "aligned", "ragged", "ragged", "ragged"))
    final, initial = cfg.random() < 0.7, cfg.random() < 0.7
    cu_dtype = cfg.choice(("int32", "int64"))
    gate_dtype = dtype if dtype in ("fp64", "fp32") or cfg.random() < 0.5 else "fp32"
    options = []
    if op == "linear_attn":
        options.append(("normalize", cfg.random() < 0.3))
    if op == "simple_gla":
        options.append(("gate_parts", cfg.choice(("g", "g_gamma", "both", "both"))))
    if op in NEG_EIGVAL:
        options += [("use_qk_l2norm_in_kernel", cfg.random() < 0.4), ("allow_neg_eigval", cfg.random() < 0.4)]
    if op in GATE_IN_KERNEL and "use_gate_in_kernel" in inspect.signature(getattr(ops, f"{mode}_{op}")).parameters:
        options.append(("use_gate_in_kernel", cfg.random() < 0.4))
    if op == "comba":
        options.append(("p_is_k", cfg.random() < 0.2))
    options += [(name, cfg.choice(values)) for name, values in OPS[op].sample_options.items()]
    do = cfg.choice(COTANGENTS[:-1] + (("none",) if final else ()))
    dS = cfg.choice(COTANGENTS if do != "none" else COTANGENTS[:-1]) if final else "none"

    H = rng.choice([h for h in space.heads if h * group <= space.max_value_heads] or [1])
    group = min(group, space.max_value_heads // H)
    lengths = _varlen_lengths(rng, space) if varlen else None
    if lengths is None:
        pool = {"one": (1,), "aligned": tuple(t for t in space.lengths if t % 16 == 0)}.get(t_kind) or \
            tuple(t for t in space.lengths if t % 16)
        B, T = rng.choice(space.batch), rng.choice(pool)
        while B > 1 and B * T > space.max_tokens:
            B //= 2
        T = min(T, space.max_tokens)
    else:
        B, T = 1, sum(lengths)
    return Case(space=space.name, op=op, mode=mode, backend=backend, dtype=dtype, seed=seed, B=B, T=T, H=H,
                HV=H * group, K=K, V=V, lengths=lengths, cu_dtype=cu_dtype, initial_state=initial,
                output_final_state=final, gates=rng.choice(GATE_STRENGTHS), gate_dtype=gate_dtype,
                scale=rng.choice((None, None, 0.5)), options=tuple(options), do=do, dS=dS)


# Inputs, by the op's argument names, drawn in float64 on the CPU.

def _tail_mask(case: Case) -> torch.Tensor:
    """[T] bool: the tokens of each sequence's last chunk (partial or not)."""
    lengths = case.lengths or (case.T,)
    parts = []
    for L in lengths:
        t = torch.arange(L)
        parts.append(t >= CHUNK * ((L - 1) // CHUNK) if L else t.bool())
    return torch.cat(parts)


def _log_gate(case: Case, shape, gen) -> torch.Tensor:
    """Log decays per token: mild in [-0.5, -0.01], strong in [-6, -0.5], mixed (a quarter strong),
    or mild but in [-6, -3] over each sequence's last chunk."""
    u = lambda: torch.rand(shape, dtype=torch.float64, generator=gen)  # noqa: E731
    mild, strong = -(0.01 + 0.49 * u()), -(0.5 + 5.5 * u())
    if case.gates == "mild":
        return mild
    if case.gates == "strong":
        return strong
    if case.gates == "mixed":
        return torch.where(u() < 0.25, strong, mild)
    tail = _tail_mask(case).view(1, shape[1], *([1] * (len(shape) - 2)))
    return torch.where(tail, -(3 + 3 * u()), mild)


def draw_inputs(case: Case) -> dict:
    """float64 tensors by argument name (``initial_state`` included when the case has one)."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    opt = dict(case.options)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, dtype=torch.float64, generator=gen)  # noqa: E731
    op = case.op
    if OPS[op].sample is not None:   # the op draws its own tensors (Op.sample), gates as the case says
        x = OPS[op].sample(B, T, H, HV, K, V, dtype=torch.float64, device="cpu", generator=gen,
                           log_gate=lambda shape: _log_gate(case, shape, gen), **opt)
        if case.initial_state:
            x["initial_state"] = r(case.N, HV, K, V)
        return x
    q, v = r(B, T, H, K), r(B, T, HV, V)
    if opt.get("use_qk_l2norm_in_kernel"):
        k = r(B, T, H, K) * 2
    elif op in NEG_EIGVAL:
        k = l2norm(r(B, T, H, K))
    else:
        k = r(B, T, H, K) * K ** -0.5
    x = dict(q=q, k=k, v=v)
    if op == "linear_attn" and opt["normalize"]:
        # positive feature maps keep the normaliser away from zero
        x.update(q=torch.nn.functional.softplus(q), k=torch.nn.functional.softplus(k))
    gates = {n: _log_gate(case, (B, T, HV, K) if op == "kda" else (B, T, H, K) if per_channel else (B, T, HV),
                          gen) for n, per_channel in GATES.get(op, {}).items()}
    x.update(gates)
    if op == "simple_gla":
        parts = opt["gate_parts"]
        strong = case.gates in ("strong", "mixed")
        if parts == "g_gamma":
            del x["g"]
        if parts != "g":
            x["g_gamma"] = -(0.5 + 2.5 * u(HV)) if strong else -(0.01 + 0.09 * u(HV))
    if op == "rwkv6":
        x = dict(r=x.pop("q"), k=x["k"], v=v, w=x["w"], u=r(H, K) * 0.5)
    if op == "hgrn2":
        del x["k"]
    if op in NEG_EIGVAL:
        x["beta"] = u(B, T, HV) * (2.0 if opt["allow_neg_eigval"] else 1.0)
    if OPS[op].beta == "positive":
        x["beta"] = 0.1 + 2 * u(B, T, HV)
    if op == "comba":
        base = x["k"] if not opt["use_qk_l2norm_in_kernel"] else l2norm(x["k"])
        p = l2norm(base + 0.5 * r(B, T, H, K)) * (0.5 + 0.5 * u(B, T, H, 1))
        x["p"] = None if opt["p_is_k"] else (p * 2 if opt["use_qk_l2norm_in_kernel"] else p)
    if op in GATE_IN_KERNEL and opt.get("use_gate_in_kernel"):
        lo, hi = {"mild": (0.05, 0.5), "strong": (1.0, 6.0)}.get(case.gates, (0.05, 2.0))
        x["A_log"] = (lo + (hi - lo) * u(HV)).log()
        x["dt_bias"] = 0.5 * r(HV * K if op == "kda" else HV)
        x["g"] = r(*x["g"].shape) + (4.0 * _tail_mask(case).view(1, T, *([1] * (x["g"].dim() - 2)))
                                       if case.gates == "strong_tail" else 0.0)
    if op in ("dplr_delta_rule", "rwkv7"):
        kappa = l2norm(r(B, T, H, K))
        x.update(a=-kappa, b=kappa * u(B, T, H, K))
        if op == "rwkv7":
            x = dict(r=x["q"], w=x["w"], k=x["k"], v=v, a=x["a"], b=x["b"])
    if case.initial_state:
        x["initial_state"] = r(case.N, HV, K, V)
    return x


def input_dtypes(case: Case, x: dict) -> dict:
    """The dtype each input is passed in: vectors in the case's dtype, gates and beta in the gate
    dtype, the state and Mamba-2's parameters in float32 (float64 for float64 cases)."""
    low, gate = DTYPES[case.dtype], DTYPES[case.gate_dtype]
    high = torch.float64 if low == torch.float64 else torch.float32
    gate_names = set(GATES.get(case.op, {})) | {"beta", "g_gamma"}
    return {n: high if n in ("initial_state", "A_log", "dt_bias") else gate if n in gate_names else low for n in x}


def _cotangent(kind: str, shape, gen):
    """(base float64 tensor, view making the cotangent's layout from the base)."""
    shape = tuple(shape)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=gen)  # noqa: E731
    if kind == "dense":
        return r(*shape), lambda t: t
    if kind == "ones":
        return torch.ones(()), lambda t: t.expand(shape)
    if kind == "expanded":
        dims = [i for i in range(len(shape)) if torch.rand((), generator=gen) < 0.5] or [1]
        return r(*[1 if i in dims else s for i, s in enumerate(shape)]), lambda t: t.expand(shape)
    if kind == "transposed":
        return r(*shape[:-2], shape[-1], shape[-2]), lambda t: t.mT
    if kind == "sliced":
        return r(*shape[:-1], 2 * shape[-1] + 1), lambda t: t[..., 1::2]
    if kind == "permuted":
        return r(shape[1], shape[0], *shape[2:]), lambda t: t.transpose(0, 1)
    if kind == "heads_first":
        return r(shape[0], shape[2], shape[1], *shape[3:]), lambda t: t.transpose(1, 2)
    raise ValueError(kind)


def draw_cotangents(case: Case) -> dict:
    """{"o": (base, view), "final_state": (base, view)} for the outputs the loss reads."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    out = {}
    if case.do != "none":
        out["o"] = _cotangent(case.do, (case.B, case.T, case.HV, case.V), gen)
    if case.dS != "none":
        out["final_state"] = _cotangent(case.dS, (case.N, case.HV, case.K, case.V), gen)
    return out


def case_seed(base: int, *parts) -> int:
    """A seed per (base seed, op, slot): stable across runs and Python versions."""
    return zlib.crc32("/".join(map(str, (base,) + parts)).encode())
