"""Context parallelism: one token stream split across the ranks of a process group.

Every op of :mod:`fastweight.ops` is a recurrence S_t = A_t S_{t-1} + k_t v_t^T whose transition
A_t ([K, K]: diagonal for the decay family, diagonal plus low rank for the delta family and DPLR)
never depends on v, so a segment's final state is affine in its initial state,

    S_out = S_loc + P S_in        S_loc: the segment run from a zero state
                                  P = A_T ... A_1: the same op run with v = 0 from S_in = I,

and its outputs are o = o_loc + o_corr, o_corr the op run with v = 0 from S_in. Each rank holds a
contiguous run of the stream (``[B, T_r, ...]``: every one of the B sequences crosses every rank;
or packed, ``[1, T_r, ...]`` with the *global* ``cu_seqlens``, where sequences may start, end or
straddle anywhere, empty ones included). A rank

1. runs its segment from zero states (the true ``initial_state`` for the sequences that start
   on it): o_loc, S_loc;
2. runs, for a piece that enters from the previous rank and leaves to the next (a sequence
   longer than the rank's segment), the op with v = 0 from the identity: P;
3. all-gathers (S_loc, P) of its outgoing pieces; each rank then forms the true entering state
   of its entering pieces by folding S <- S_loc + P S over the ranks the sequence crossed;
4. runs its entering pieces with v = 0 from that state (o_corr and P S_in, added).

The backward is autograd through the ops and two small collectives (the all-gather's backward
returns each gathered state's gradient to its owner), so the state gradient travels the other way
with no hand-written backward of the recurrence; :class:`ContextGroup` keeps the collectives in one
order on every rank. Layers reach across ranks the same way for their short convolutions and token
shift (:func:`halo`). Per layer and rank, the all-gather moves, per outgoing piece and value head,
K V numbers (the state) plus K (the decay family: P is diagonal) or K^2 (the delta family and
DPLR: P is dense) for the pieces that cross the whole rank; the final states, when asked for, one
all-reduce of [N, HV, K, V] (the same on every rank, as the loss on it is taken to be: its
backward reads each rank's own cotangent for the sequences that end on that rank). Cost: step 2
runs only on the crossing pieces (K value columns), step 4 on the entering ones (V columns).

Gradients of the replicated arguments (``initial_state``, ``g_gamma``, ``u``, ``A_log``,
``dt_bias``) are each rank's share: their sum over the group is the gradient, as a data-parallel
wrapper sums a parameter's across ranks.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from fastweight.ops.decay import _split_z


# arguments shared by every token (replicated on every rank); every other tensor is per token
REPLICATED = ("initial_state", "g_gamma", "u", "A_log", "dt_bias")
# the ops whose transition is diagonal (P travels as its diagonal)
DIAGONAL = ("linear_attn", "retention", "simple_gla", "gla", "rwkv6", "hgrn2")
# (``gv`` gates the value side of the state, where P does not act)
REFUSED = {"reverse": False, "state_v_first": False, "gv": None, "cp_context": None, "chunk_indices": None,
           "cu_seqlens_cpu": None}


def _substep_op(op) -> bool:
    """Whether ``op`` (a ``fastweight.ops`` function) is one whose token takes several DPLR steps."""
    from fastweight.mechanisms import OPS
    for prefix in ("chunk_", "fused_recurrent_"):
        name = op.__name__[len(prefix):] if op.__name__.startswith(prefix) else None
        if name in OPS:
            return OPS[name].dplr_steps is not None
    return False


def _bind(op, args, kwargs) -> dict:
    """The op's arguments by name (its defaults filled in, ``**kwargs`` flattened)."""
    sig = inspect.signature(op)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    out = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _layout(cu: list[int] | None, B: int, bounds: list[int], rank: int):
    """This rank's pieces: (local cu_seqlens or None, global sequence ids, starts here, ends here),
    and for every rank the sequence of its outgoing piece (None: none leaves it; packed only)."""
    a, b = bounds[rank], bounds[rank + 1]
    world = len(bounds) - 1
    if cu is None:
        ids = list(range(B))
        return None, ids, [rank == 0] * B, [rank == world - 1] * B, None
    lengths, ids, starts, ends = [], [], [], []
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        owns_empty = s == e and (a <= s < b or (s == b == cu[-1] and rank == world - 1))
        if (s < b and e > a) or owns_empty:
            lengths.append(min(e, b) - max(s, a))
            ids.append(n)
            starts.append(s >= a)
            ends.append(e <= b)
    outgoing = []
    for r in range(world):
        n = next((n for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])) if s < bounds[r + 1] < e), None)
        outgoing.append(n)
    local = torch.tensor([0] + lengths).cumsum(0)
    return local, ids, starts, ends, outgoing


def _segment_bounds(T_local: int, group) -> list[int]:
    """Every rank's first token index, and the total: [0, T_0, T_0 + T_1, ...] (one small all-gather)."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([T_local], dtype=torch.int64), group=group)
    return [0] + torch.cat(sizes).cumsum(0).tolist()


class ContextGroup:
    """A process group used for context parallelism, and the order of its collectives.

    Every collective's input is tied (with weight 0) to the previous one's output, so that the
    backward runs them in exactly the reverse order on every rank: the autograd engine would
    otherwise order independent branches (a layer's three short convolutions) by each rank's own
    graph, which differs between ranks, and two same-sized all-gathers swapped would exchange the
    wrong gradients without an error. One instance per forward pass (the model makes one)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("context parallelism needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group, or torchrun)")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._last, self._bounds = None, {}

    def bounds(self, T_local: int) -> list[int]:
        """The ranks' segment bounds, gathered once per segment length (every layer of a forward
        pass holds the same tokens)."""
        if T_local not in self._bounds:
            self._bounds[T_local] = _segment_bounds(T_local, self.group)
        return self._bounds[T_local]

    def start(self, T_local: int) -> int:
        """The index in the stream of this rank's first token (rotary positions start there)."""
        return self.bounds(T_local)[self.rank]

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order (autograd: each copy's gradient returns to its owner)."""
        if self._last is not None and torch.is_grad_enabled():
            x = x + (self._last.sum() * 0).to(x.dtype)
        out = _AllGather.apply(x, self.group)
        self._last = out
        return list(out.chunk(self.world))


def halo(x: torch.Tensor, n: int, ctx: ContextGroup) -> torch.Tensor:
    """The previous rank's last ``n`` tokens of ``x`` [B, T_r, C] (zeros on the first rank): the
    history a causal convolution of width n + 1, or a token shift (n = 1), reads across the
    segment boundary."""
    if x.shape[1] < n:
        raise ValueError(f"context parallelism: each rank needs at least {n} tokens for this layer's history, "
                         f"got {x.shape[1]}")
    got = ctx.all_gather(x[:, x.shape[1] - n:].contiguous())
    # the first rank reads zeros, still through the gather (its backward joins the others')
    return got[ctx.rank - 1] if ctx.rank > 0 else got[0] * 0


def context_parallel(op, *args, group=None, **kwargs):
    """``op(*args, **kwargs)`` (any ``fastweight.ops`` function) on this rank's run of the token
    stream; the same (o, final state) as one process running the whole stream, o for this rank's
    tokens and the final state [N, HV, K, V] of every sequence on every rank.

    Tensors per token are this rank's: [B, T_r, ...] (each of the B sequences crossing the ranks
    in rank order), or [1, T_r, ...] with ``cu_seqlens`` the global packed boundaries (the same on
    every rank, over sum_r T_r tokens). ``initial_state`` [N, HV, K, V] and the per-head
    parameters are the same on every rank. ``group``: the process group (default: the world), or
    a :class:`ContextGroup` shared by the calls of one forward pass.
    Every rank needs at least one token. Not supported: Gated DeltaProduct (several steps a token),
    ``reverse``, ``state_v_first``, ``gv``,
    fla's ``cp_context``/``chunk_indices`` (this is the context parallelism).

    Example, under ``torchrun --nproc-per-node 4``: each rank passes its quarter of the tokens,
    ``o, S = context_parallel(ops.chunk_gated_delta_rule, q, k, v, g, beta, output_final_state=True)``."""
    if _substep_op(op):
        raise ValueError(f"context_parallel does not support {op.__name__}: its tokens take several steps "
                         "(k, v, beta at T * n rows) and the ranks' segments are cut in tokens")
    ctx = group if isinstance(group, ContextGroup) else ContextGroup(group)
    x = _bind(op, args, kwargs)
    for name, default in REFUSED.items():
        if name in x and x[name] is not default:
            raise ValueError(f"context_parallel does not support `{name}` (got {x[name]!r}); leave it at {default!r}")
    x.pop("cu_seqlens_cpu", None)
    if x.get("normalize"):
        return _normalized(op, x, ctx)
    return _run(op, x, ctx)


def _normalized(op, x, ctx):
    """linear attention's normaliser scale q_t . z_t, z_t = z_0 + sum_{s <= t} k_s, is linear attention
    with v = 1 from the state z_0: one more value column (z_0 as its initial state column, 0 without
    one), one exchange, then the division of ``ops._normalize_output``; z_state is that column of the
    final state. Returns (o, (final state or None, z_state [N, 1, H, K])) as the op does."""
    v, key = x["v"], x["k"]
    h0, z0 = _split_z(x.get("initial_state"), True, key, x.get("cu_seqlens"))
    N, HV, V = (v.shape[0] if x.get("cu_seqlens") is None else len(x["cu_seqlens"]) - 1), v.shape[2], v.shape[-1]
    H, K = key.shape[2], key.shape[3]
    wide = torch.cat([v, v.new_ones(*v.shape[:3], 1)], dim=-1)
    column = (z0.squeeze(1).repeat_interleave(HV // H, dim=1)[..., None] if z0 is not None
              else key.new_zeros(N, HV, K, 1))
    if h0 is not None or z0 is not None:
        h0 = h0 if h0 is not None else column.new_zeros(N, HV, K, V)
        h0 = torch.cat([h0, column.to(h0.dtype)], dim=-1)
    o, S = _run(op, dict(x, v=wide, initial_state=h0, normalize=False, output_final_state=True), ctx)
    dt = torch.float64 if o.dtype == torch.float64 else torch.float32
    o = (o[..., :V].to(dt) / (o[..., V:].to(dt) + 1e-10)).to(o.dtype)
    z_state = S[:, ::HV // H, :, V].unsqueeze(1).to(key.dtype)     # [N, 1, H, K]
    return o, (S[..., :V] if x.get("output_final_state") else None, z_state)


def _run(op, x, ctx):
    v, h0 = x["v"], x.get("initial_state")
    B, T_local, HV, V = v.shape
    name = op.__name__.split("_", 1)[1] if "_" in op.__name__ else op.__name__
    name = name[len("recurrent_"):] if name.startswith("recurrent_") else name
    key = next(x[n] for n in ("k", "q", "r") if isinstance(x.get(n), torch.Tensor))
    K = key.shape[-1]
    cu = x.get("cu_seqlens")
    if T_local < 1:
        raise ValueError(f"context_parallel: this rank holds no token (v has {T_local}); every rank needs at least one")
    if cu is not None and B != 1:
        raise ValueError(f"context_parallel: with `cu_seqlens` the batch must be 1, got {B}")
    group, rank = ctx.group, ctx.rank
    bounds = ctx.bounds(T_local)
    cu_host = None if cu is None else [int(c) for c in cu.tolist()]
    if cu_host is not None and (cu_host[0] != 0 or cu_host[-1] != bounds[-1]):
        raise ValueError(f"context_parallel: `cu_seqlens` spans {cu_host[0]}..{cu_host[-1]} but the ranks hold "
                         f"{bounds[-1]} tokens in all ({bounds})")
    N = B if cu is None else len(cu_host) - 1
    if h0 is not None and h0.shape[0] != N:
        raise ValueError(f"`initial_state` has {h0.shape[0]} states for {N} sequences")
    local_cu, ids, starts, ends, outgoing = _layout(cu_host, B, bounds, rank)
    per_token = {n: t for n, t in x.items() if isinstance(t, torch.Tensor) and n not in REPLICATED
                 and n != "cu_seqlens"}
    want_final = bool(x.get("output_final_state"))

    def call(tensors, init, cu_seqlens):
        return op(**dict(x, **tensors, initial_state=init, output_final_state=True, cu_seqlens=cu_seqlens))

    # 1. the segment from zero states (the given ones where a sequence starts here)
    init = None
    if h0 is not None:
        first = torch.tensor(starts, dtype=h0.dtype, device=h0.device)[:, None, None, None]
        init = h0[torch.tensor(ids, device=h0.device)] * first
    o, S_loc = call({}, init, None if local_cu is None else local_cu.to(cu.device, cu.dtype))
    # the entering pieces' tokens: every batch row (uniform) or the first piece (packed)
    entering = [i for i, s in enumerate(starts) if not s]
    span = None if cu is None else (0, int(local_cu[1]))

    def piece_tokens(tensors):
        return tensors if span is None else {n: t[:, span[0]:span[1]] for n, t in tensors.items()}

    # 2. P of the pieces crossing the whole segment
    crossing = [i for i in entering if not ends[i]]
    eye = torch.eye(K, dtype=S_loc.dtype, device=S_loc.device)
    P = None
    if crossing:
        zeros = piece_tokens(dict(per_token, v=v.new_zeros(B, T_local, HV, K)))
        _, P = call(zeros, eye.expand(len(crossing), HV, K, K).contiguous(), None)
    # 3. the outgoing pieces' (S_loc, P), gathered
    slots = B if cu is None else 1
    out_S = S_loc.new_zeros(slots, HV, K, V)
    out_P = eye.expand(slots, HV, K, K)
    leaving = [i for i, e in enumerate(ends) if not e]
    if leaving:
        out_S = S_loc if cu is None else S_loc[leaving[-1]:leaving[-1] + 1]
        if P is not None:
            out_P = P
    diagonal = name in DIAGONAL
    packed_P = out_P.diagonal(dim1=-2, dim2=-1) if diagonal else out_P
    # one all-gather of both (one collective, so that every rank's backward runs the same ones)
    sent = torch.cat([out_S.reshape(slots, -1), packed_P.reshape(slots, -1).to(out_S.dtype)], dim=1)
    if S_loc.requires_grad and not sent.requires_grad:
        # nothing leaves this rank: still in the graph, so that its backward joins the others'
        sent = sent + S_loc.sum() * 0
    got = ctx.all_gather(sent)
    # every rank's outputs depend on what it received (with weight 0 where nothing enters it), so
    # that every rank's backward reaches the all-gather's and returns the others' gradients
    anchor = sum(g.sum() for g in got) * 0
    all_S = [g[:, :HV * K * V].reshape(slots, HV, K, V) for g in got]
    all_P = [g[:, HV * K * V:].reshape((slots, HV, K) if diagonal else (slots, HV, K, K)) for g in got]
    all_P = [torch.diag_embed(p) if diagonal else p for p in all_P]
    if not entering:
        S_in = None
    elif cu is None:
        S_in = all_S[0]
        for r in range(1, rank):
            S_in = all_S[r] + all_P[r] @ S_in
    else:
        n = ids[entering[0]]
        crossed = [r for r in range(rank) if outgoing[r] == n]
        S_in = all_S[crossed[0]]
        for r in crossed[1:]:
            S_in = all_S[r] + all_P[r] @ S_in
    # 4. the entering pieces from their true state, with v = 0
    if S_in is not None:
        zeros = piece_tokens(dict(per_token, v=v.new_zeros(B, T_local, HV, V)))
        o_corr, S_corr = call(zeros, S_in.to(S_loc.dtype), None)
        o = o + o_corr if span is None else torch.cat([o[:, :span[1]] + o_corr, o[:, span[1]:]], dim=1)
        fix = torch.zeros_like(S_loc)
        fix = fix.index_copy(0, torch.tensor(entering, device=fix.device), S_corr)
        S_loc = S_loc + fix
    o = o + anchor.to(o.dtype)
    if not want_final:
        return o, None
    done = [i for i, e in enumerate(ends) if e]
    # (an index_add even when no sequence ends here: the result stays in the graph on every rank,
    # so that every rank's backward joins the all-reduce's)
    index = torch.tensor([ids[i] for i in done], dtype=torch.long, device=S_loc.device)
    final = S_loc.new_zeros(N, HV, K, V).index_add(0, index, S_loc[torch.tensor(done, dtype=torch.long,
                                                                                 device=S_loc.device)])
    return o, _Assemble.apply(final + anchor, group)


class _AllGather(torch.autograd.Function):
    """Every rank's x stacked along dim 0; backward: the sum over ranks of the gradient of this
    rank's copy (an all-reduce of the whole gradient, then this rank's block)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _Assemble(torch.autograd.Function):
    """The sum over ranks of disjoint parts (each rank's sequences that end on it), the same tensor
    on every rank afterwards. As for any gathered tensor, the computation on it is taken to be
    the same on every rank, so each rank back-propagates its own cotangent into its own parts
    (no communication; a sum would count a loss that every rank computes once per rank)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None
