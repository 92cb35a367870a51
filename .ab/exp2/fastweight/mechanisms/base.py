"""What a mechanism is: a small spec over the one DPLR core.

A mechanism file defines, for its own paper's recurrence:

- ``step(S, x) -> S_new``: the update as the paper writes it. ``S`` is the state
  ``[B, H, K, V]``; ``x`` holds the inputs at one time step (``[B, H, ...]``), plus
  time-invariant parameters under names starting with ``_``.
- ``readout(S_prev, S_new, x, scale) -> o_t [B, H, V]`` (default ``S_new^T (scale q)``).
- ``to_dplr(inputs) -> dict(q, k, v, a, b, gk[, u])``: the map onto
  ``S_t = (Diag(exp gk_t) + a_t b_t^T) S_{t-1} + k_t v_t^T`` (whole ``[B, T, H, ...]`` tensors).
- ``objective(S, x) -> (S_anchor, [(lr, loss_fn), ...], implicit)``: the online-learning
  view. The explicit step is ``S_anchor - sum_j lr_j * grad loss_fn_j(S_anchor)`` (``lr`` None
  means 1; a tensor broadcasts against ``[B, H, K, V]``: a row-wise learning rate). The anchor
  is ``S`` itself, or the decayed state for decay-then-step mechanisms (GDN, KDA). With
  ``implicit=True`` the step is the proximal one, ``argmin_X 1/2 ||X - S_anchor||^2 + sum_j lr_j
  loss_fn_j(X)``, solved numerically by the checker.
- ``sample(B, T, H, K, V, *, dtype, device, generator) -> inputs``: valid random inputs
  (keys normalised where the mechanism expects it, gates in range).
- ``op``: the public op of ``fastweight.ops`` that serves it (``chunk_<op>``), with
  ``to_op(inputs) -> kwargs`` mapping the mechanism's inputs onto that op's arguments.
- ``dplr_steps``: how many DPLR steps one token expands to (an int, or ``dplr_steps(inputs) ->
  int`` read off the inputs, whole or at one step); 1 for all but Gated DeltaProduct, whose token
  is a product of n DPLR factors. With n > 1, ``to_dplr`` maps onto the expanded sequence of T * n
  steps (token t at rows t*n ... t*n+n-1, its output read at the last), ``cu_seqlens`` counts
  tokens (the checkers scale it by n), and ``objective(S, x, substep)`` is the objective of
  substep j at the state after substep j - 1: the token's update is their composition.
- ``variants``: the other forms its op computes under an option (Longhorn's ``diagonal_step``),
  each a :class:`Mechanism` with its own name, ``to_op`` passing the option: not registry entries
  (the registry holds one mechanism per op), but each gets its row in ``fastweight verify``.

A mechanism file also declares the public op it owns (:class:`Op`, fla's name; RetNet owns
``retention``, Mamba-2 ``simple_gla``) and the layer mixer built on it (:class:`Mixer`).
Everything that lists ops or mixers (``ops.OPS``, ``models.MIXERS``, ``build_mixer``, the
references, the generic DPLR route of the layers, the fuzz and the benchmarks) reads these
two tables: :data:`OPS` and :data:`MIXERS`, in registration order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fastweight.reference.recurrence import default_readout, run_recurrence

KERNEL_PATHS = ("scalar_decay", "vector_decay", "delta", "dplr")


@dataclass(frozen=True)
class Mechanism:
    name: str
    title: str
    paper: str
    kernel_path: str
    dplr_in_words: str
    input_names: tuple
    sample: Callable
    step: Callable
    to_dplr: Callable
    objective: Callable | None = None
    readout: Callable = default_readout
    options: dict = field(default_factory=dict)
    op: str | None = None
    to_op: Callable | None = None
    dplr_steps: int | Callable = 1
    variants: tuple = ()

    def __post_init__(self):
        if self.kernel_path not in KERNEL_PATHS:
            raise ValueError(f"kernel_path must be one of {KERNEL_PATHS}, got {self.kernel_path!r}")
        for variant in self.variants:
            if variant.op != self.op or variant.variants:
                raise ValueError(f"variant {variant.name!r} of {self.name!r} must serve the same op "
                                 f"({self.op!r}) and have no variants of its own")

    def steps(self, inputs: dict) -> int:
        """How many DPLR steps one token of ``inputs`` takes (``dplr_steps``)."""
        return int(self.dplr_steps(inputs)) if callable(self.dplr_steps) else self.dplr_steps

    def recurrent(self, inputs: dict, scale: float | None = None, initial_state=None,
                  output_final_state: bool = False, cu_seqlens=None):
        """Run the mechanism's own recurrence: returns (o [B, T, H, V], final state or None)."""
        K = inputs["q"].shape[-1] if "q" in inputs else inputs["k"].shape[-1]
        scale = K ** -0.5 if scale is None else scale
        return run_recurrence(self.step, inputs, key_dim=K, value_dim=inputs["v"].shape[-1],
                              scale=scale, readout=self.readout, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens)


@dataclass(frozen=True)
class Preconditioner:
    """A learning rate that is a matrix: the step is ``- matrix @ grad`` (matrix [B, H, K, K])."""
    matrix: torch.Tensor

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhij,bhjv->bhiv", self.matrix, grad)


@dataclass(frozen=True)
class Impl:
    """One implementation of an op: ``fn(**tensors, scale, initial_state, output_final_state,
    cu_seqlens, **options) -> (o, final state or None)`` (``fastweight.dispatch``), and what it
    does itself that the dispatcher would otherwise do first: read q, k at H heads and the rest
    at HV (``grouped_heads``), take ``use_qk_l2norm_in_kernel`` (``fused_l2norm``), take
    ``use_gate_in_kernel``, ``A_log``, ``dt_bias`` (``fused_gate``). ``unverified(device, K, V)``:
    why the kernel must not run at those head sizes on that device (a shape known to fail on some
    GPU), else None; the dispatcher then serves the PyTorch path with a warning."""
    fn: Callable
    grouped_heads: bool = False
    fused_l2norm: bool = False
    fused_gate: bool = False
    unverified: Callable | None = None


@dataclass(frozen=True)
class Op:
    """A public op (``fastweight.ops.chunk_<name>`` / ``fused_recurrent_<name>``) as the rest of
    the package needs to know it.

    ``args``: its tensor arguments in fla's order. ``family``: the kernel family that serves it,
    ``"decay"`` (no transition beyond a diagonal), ``"delta"`` or ``"dplr"`` (both solve a WY
    system per chunk). ``gates``: its log-decay arguments, name -> ``"head"`` ([B, T, HV]) or
    ``"channel"`` ([B, T, H, K]; KDA's are per value head). ``beta``: its learning rate's range,
    ``"unit"`` (in (0, 1], (0, 2) with ``allow_neg_eigval``, which the op then takes) or
    ``"positive"`` (any beta > 0). ``gate_in_kernel``: the op forms Mamba-2's gate from
    ``A_log``, ``dt_bias``.

    Its implementations, by direct reference: ``reference`` (the per-token definition,
    float64-exact: ``backend="reference"``), ``torch`` (the PyTorch chunk algorithm, any device;
    it also serves ``fused_recurrent_<name>`` on ``backend="torch"``), ``triton_chunk`` and
    ``triton_fused_recurrent`` (the Triton kernels; their wrappers import Triton only when
    called). ``dplr(**tensors) -> dict(q, k, v, a, b, gk[, u])``: the same recurrence as the
    generic DPLR op's arguments, fla's meaning (``a`` read against the state; ``u``: RWKV-6's
    bonus, which the DPLR op lacks), or None where there is no such form.

    ``dplr_steps``: the argument that says how many DPLR steps one token takes (Gated
    DeltaProduct's ``num_householder``; its ``k``, ``v``, ``beta`` then have that many rows per
    token), or None (one). ``dplr`` then returns the factors of the expanded sequence, q read at
    each token's last row; ``cu_seqlens`` counts tokens and scales by it.
    ``sample(B, T, H, HV, K, V, *, dtype, device, generator, log_gate=None, **options)``: valid
    random tensors by argument name, where the op's arguments are not the common ones the fuzz and
    the benchmarks draw (None: theirs); ``log_gate(shape)`` draws the log gates (the fuzz's gate
    strengths; default mild decays). ``sample_options``: its options' values to draw from, name ->
    tuple, the first the default (:attr:`defaults`), which the call of the op takes beside them.
    """
    name: str
    mechanism: str
    args: tuple
    family: str
    reference: Callable
    torch: Impl | None = None
    triton_chunk: Impl | None = None
    triton_fused_recurrent: Impl | None = None
    dplr: Callable | None = None
    gates: dict = field(default_factory=dict)
    beta: str | None = None
    gate_in_kernel: bool = False
    dplr_steps: str | None = None
    sample: Callable | None = None
    sample_options: dict = field(default_factory=dict)

    @property
    def defaults(self) -> dict:
        """The options a call of the op with :attr:`sample`'s tensors takes by default."""
        return {name: values[0] for name, values in self.sample_options.items()}

    @property
    def wy(self) -> bool:
        """Whether its chunk kernels solve a WY system (the delta and DPLR families)."""
        return self.family in ("delta", "dplr")

    @property
    def neg_eigval(self) -> bool:
        """Whether it takes ``allow_neg_eigval`` (beta in (0, 2))."""
        return self.beta == "unit"

    def impl(self, backend: str, mode: str) -> Impl | None:
        """Its implementation on ``backend`` ("triton", "torch", "reference") in ``mode``."""
        if backend == "reference":
            return Impl(self.reference)
        if backend == "torch":
            return self.torch
        return self.triton_chunk if mode == "chunk" else self.triton_fused_recurrent


@dataclass(frozen=True)
class Mixer:
    """A token mixer of ``fastweight.layers`` (``LMConfig.mixer``) built on one op.

    ``layer``: which layer class builds it (``"delta"``, ``"decay"``, ``"mamba2"``, ``"rwkv6"``,
    ``"rwkv7"``); ``options``: that class's per-mixer settings.
    """
    name: str
    op: str
    layer: str
    options: dict = field(default_factory=dict)


REGISTRY: dict[str, Mechanism] = {}
OPS: dict[str, Op] = {}
MIXERS: dict[str, Mixer] = {}
FAMILIES = ("decay", "delta", "dplr")


def _add(table: dict, entry, what: str):
    if entry.name in table:
        raise ValueError(f"{what} {entry.name!r} registered twice")
    table[entry.name] = entry
    return entry


def register(mechanism: Mechanism) -> Mechanism:
    return _add(REGISTRY, mechanism, "mechanism")


def register_op(op: Op) -> Op:
    if op.family not in FAMILIES:
        raise ValueError(f"Op.family must be one of {FAMILIES}, got {op.family!r}")
    return _add(OPS, op, "op")


def register_mixer(mixer: Mixer) -> Mixer:
    return _add(MIXERS, mixer, "mixer")


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known: {', '.join(OPS)}") from None


def reference_op(mechanism: Mechanism, inputs: Callable | None = None) -> Callable:
    """The op's reference: its tensors mapped by ``inputs(**tensors) -> mechanism inputs`` (None:
    the op's tensors are the mechanism's inputs, by the same names), then ``mechanism``'s own
    recurrence; the op's other options (``allow_neg_eigval``, ...) are already folded into the
    tensors by then."""
    def reference(*, scale, initial_state=None, output_final_state=False, cu_seqlens=None, **tensors):
        tensors = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor) or t is None}
        x = {n: tensors[n] for n in mechanism.input_names} if inputs is None else inputs(**tensors)
        return mechanism.recurrent(x, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return reference


def get(name: str) -> Mechanism:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown mechanism {name!r}; known: {', '.join(REGISTRY)}") from None


def randn(shape, *, dtype, device, generator):
    return torch.randn(*shape, dtype=dtype, device=device, generator=generator)


def rand(shape, *, dtype, device, generator):
    return torch.rand(*shape, dtype=dtype, device=device, generator=generator)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + eps)


def sample_log_decay(shape, *, dtype, device, generator, low=0.01, high=0.5):
    """Log decays g = log alpha in [-high, -low]: alpha in [exp(-high), exp(-low)]."""
    return -(low + (high - low) * rand(shape, dtype=dtype, device=device, generator=generator))


def hebbian(k: torch.Tensor, v: torch.Tensor):
    """The loss -<S^T k, v> (linear attention's objective; its gradient is -k v^T)."""
    return lambda X: -(kT_S(k, X) * v).sum()


def weight_decay(w: torch.Tensor):
    """The loss 1/2 ||sqrt(Diag(1 - w)) S||_F^2 for a decay factor w ([B, H] or [B, H, K]).

    One unit step on it gives Diag(w) S.
    """
    c = (1 - w)[..., None, None] if w.dim() == 2 else (1 - w)[..., None]
    return lambda X: 0.5 * (c * X * X).sum()


def regression(k: torch.Tensor, v: torch.Tensor):
    """The loss 1/2 ||S^T k - v||^2 (the delta rule's objective; gradient k (S^T k - v)^T)."""
    return lambda X: 0.5 * ((kT_S(k, X) - v) ** 2).sum()


def outer(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k v^T for batched vectors: [..., K], [..., V] -> [..., K, V]."""
    return k[..., None] * v[..., None, :]


def kT_S(k: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """S^T k: [B, H, K], [B, H, K, V] -> [B, H, V]."""
    return torch.einsum("bhk,bhkv->bhv", k, S)
