"""Run transformers' own Gated DeltaNet and KDA models on fastweight's ops.

    from fastweight.models.transformers_kernels import use_fastweight_kernels
    with use_fastweight_kernels():                 # or: patch = use_fastweight_kernels(); ...; patch.undo()
        model.generate(input_ids, max_new_tokens=32)

Qwen3-Next, Qwen3.5 (and its MoE), OLMo-Hybrid (Gated DeltaNet) and Kimi-Linear (KDA) call
their recurrence through module-level functions that transformers binds, when the modeling
module is imported, to fla's op if fla is installed and to a per-token PyTorch loop otherwise
(``transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback``). That binding
has no registration hook for a third package, so this is a small reversible patch: for the
duration of the ``with`` block (or until ``undo()``), the names those modules call are bound to
``fastweight.ops`` (``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``,
``chunk_kda`` / ``fused_recurrent_kda``), which take fla's arguments as they are: q, k, v in
``[B, T, H, D]`` with more value heads than key heads (GVA), ``use_qk_l2norm_in_kernel=True``,
``cu_seqlens`` for packed sequences, the ``[N, HV, K, V]`` fp32 state of their caches. Arguments
the op does not take are dropped, as transformers' own wrapper drops them. Prefill takes the chunk
op, decode (one token from a cached state) the fused recurrent one, as in those models. A packed
batch (B = 1, ``position_ids`` restarting at each sequence and ``cu_seq_lens_q`` among the model's
kwargs, as transformers' ``DataCollatorWithFlattening`` gives them) reaches the recurrence as
``cu_seqlens``, and their ``causal_conv1d_fn`` is bound to one whose taps stop at each sequence's
start (transformers' PyTorch fallback convolves across the boundary).
"""

from __future__ import annotations

import importlib
import inspect

from fastweight import ops

# modeling module -> {name it calls: fastweight op, or None: its short convolution, made packed-aware}
TARGETS = {
    **{f"transformers.models.{m}.modeling_{m}": {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
                                               "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
                                               "causal_conv1d_fn": None}
       for m in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")},
    "transformers.models.kimi_linear.modeling_kimi_linear": {"chunk_kimi_delta_attention": "chunk_kda",
                                                            "recurrent_kimi_delta_attention": "fused_recurrent_kda",
                                                            "causal_conv1d_fn": None},
}


def function_of(original):
    """The Python function behind a binding: with the ``kernels`` package (a dependency of transformers
    >= 5.2x), transformers turns each such function into an ``nn.Module`` instance whose ``forward``
    calls it (``kernels.use_kernel_forward_from_hub``); its signature and name are the function's."""
    forward = getattr(type(original), "forward", None)
    if forward is not None and getattr(forward, "__closure__", None):
        cells = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__)))
        if callable(cells.get("func")):
            return cells["func"]
    return original


def _bridge(original, op_name: str):
    """A function with ``original``'s calling convention that runs ``fastweight.ops.<op_name>``."""
    fn = getattr(ops, op_name)
    theirs = inspect.signature(function_of(original))
    ours = inspect.signature(fn).parameters

    def call(*args, **kwargs):
        named = theirs.bind_partial(*args, **kwargs).arguments
        named.update(named.pop("kwargs", {}))
        named = {("q" if n == "query" else "k" if n == "key" else "v" if n == "value" else n): x
                 for n, x in named.items()}
        if named.get("cu_seqlens") is None and named.get("cu_seq_lens_q") is not None:
            # a packed batch's boundaries as transformers' attention kwargs carry them (Kimi-Linear
            # hands its kwargs on without naming them)
            named["cu_seqlens"] = named["cu_seq_lens_q"]
        if "allow_neg_eigval" in ours:
            # these models form beta themselves (OLMo-Hybrid's may be 2 sigmoid): the op's range check is theirs
            named.setdefault("allow_neg_eigval", True)
        return fn(**{n: x for n, x in named.items() if n in ours and n != "backend"})

    name = function_of(original).__name__
    call.__name__, call.__doc__ = name, f"fastweight.ops.{op_name} in place of {name}"
    call.__wrapped_fastweight__ = original
    return call


def _packed_conv(original):
    """``causal_conv1d_fn`` that, for a packed batch (``cu_seq_lens_q`` among its kwargs, B = 1),
    lets no tap reach into the previous sequence; otherwise transformers' own."""

    def call(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or hidden_states.shape[0] != 1:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        from transformers.activations import ACT2FN

        from fastweight.layers.base import sequence_positions
        from fastweight.layers.common import packed_conv
        x = hidden_states.to(weight.dtype).transpose(1, 2)       # [1, T, C]
        y = packed_conv(x, weight[:, None], bias, sequence_positions(cu, x.shape[1], x.device)).transpose(1, 2)
        if activation is not None:
            y = ACT2FN[activation](y)
        return y.to(hidden_states.dtype)

    name = function_of(original).__name__
    call.__name__, call.__doc__ = name, f"a packed-batch-aware {name}"
    call.__wrapped_fastweight__ = original
    return call


class Patch:
    """The bindings replaced by :func:`use_fastweight_kernels`; ``undo()`` (or leaving the ``with``) restores them."""

    def __init__(self, replaced: list):
        self.replaced = replaced   # (module, name, original)

    @property
    def modules(self) -> list[str]:
        return sorted({m.__name__ for m, _, _ in self.replaced})

    def undo(self):
        for module, name, original in reversed(self.replaced):
            setattr(module, name, original)
        self.replaced = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def use_fastweight_kernels(models=None) -> Patch:
    """Bind the GDN/KDA recurrences of transformers' modeling modules to fastweight's ops.

    models: module short names (``"qwen3_next"``, ``"qwen3_5"``, ``"qwen3_5_moe"``, ``"olmo_hybrid"``,
    ``"kimi_linear"``) or None for every one this transformers version has. A named model that this
    transformers lacks, or whose module no longer has the expected functions, raises a ValueError.
    """
    known = {path.rsplit(".", 2)[1]: path for path in TARGETS}
    if models is not None:
        unknown = [m for m in models if m not in known]
        if unknown:
            raise ValueError(f"use_fastweight_kernels: unknown model(s) {unknown}; known: {', '.join(known)}")
    replaced = []
    for short, path in known.items():
        if models is not None and short not in models:
            continue
        try:
            module = importlib.import_module(path)
        except ImportError:
            if models is not None:
                raise ValueError(f"use_fastweight_kernels: this transformers has no {path}") from None
            continue
        for name, op_name in TARGETS[path].items():
            original = getattr(module, name, None)
            if original is None:
                Patch(replaced).undo()
                raise ValueError(f"use_fastweight_kernels: {path} has no `{name}` (another transformers version); "
                                 "nothing was patched")
            if hasattr(original, "__wrapped_fastweight__"):
                continue   # already bound
            setattr(module, name, _packed_conv(original) if op_name is None else _bridge(original, op_name))
            replaced.append((module, name, original))
    return Patch(replaced)
