"""Stage kernels of the delta family against the PyTorch chunk algorithm's pieces (fastweight.chunk).

Under TRITON_INTERPRET=1 (fp32). Shapes: T = 100 (one full chunk of 64 and a tail of 36).
"""

import pytest
import torch

from fastweight.chunk.common import chunk_layout, decayed_scores, from_chunks, local_cumsum, to_chunks
from fastweight.chunk.solve_tril import solve_unit_lower
from fastweight.dispatch import l2norm as l2norm_reference
from fastweight.kernels import common
from fastweight.kernels.common import prepare_chunks
from fastweight.kernels.cumsum import chunk_cumsum
from fastweight.kernels.intra import intra_bwd, intra_fwd
from fastweight.kernels.kkt_solve import kkt_solve, solve
from fastweight.kernels.l2norm import l2norm
from fastweight.testing import generator, rel_err

T, H, K = 100, 2, 32


@pytest.fixture(autouse=True)
def poison():
    with common.poisoned_outputs():
        yield


def chunked(x):
    """[1, T, H, ...] -> [H, NT, 64, ...] zero padded, float64."""
    return to_chunks(x.double(), chunk_layout(1, T, 64, None, x.device), torch.float64)[0]


def rows(A):
    """Kernel layout [1, T, H, 64] -> [H, NT, 64, 64] zero padded (the chunk rows)."""
    return chunked(A)


def inputs(seed=0):
    gen = generator(seed)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    q = torch.randn(1, T, H, K, generator=gen)
    p = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    beta = torch.rand(1, T, H, generator=gen)
    g = -torch.rand(1, T, H, generator=gen) * 0.5
    gk = -torch.rand(1, T, H, K, generator=gen) * 0.5
    return q, k, p, beta, g, gk


def test_chunks_order_longest_first():
    """The state passes take sequences longest first (ties, empty ones last, in their order); the
    varlen tests of test_delta.py / test_decay.py / test_dplr.py run the permuted order end to end."""
    ch = prepare_chunks(torch.tensor([0, 1, 64, 100, 100, 129, 130]), 1, 130, 64, "cpu")
    assert ch.order.tolist() == [1, 2, 4, 0, 5, 3]
    assert ch.order.dtype == torch.int32
    assert prepare_chunks(None, 3, 100, 64, "cpu").order.tolist() == [0, 1, 2]


@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_varlen_scalar_and_vector(reverse):
    cu = torch.tensor([0, 37, 100])
    ch = prepare_chunks(cu, 1, T, 64, "cpu")
    for g in (torch.randn(1, T, H), torch.randn(1, T, H, 5)):
        want = torch.cat([torch.cat([c.flip(1).cumsum(1).flip(1) if reverse else c.cumsum(1)
                                     for c in g[:, a:b].split(64, 1)], 1) for a, b in ((0, 37), (37, 100))], 1)
        assert rel_err(chunk_cumsum(g, ch, reverse=reverse), want) < 1e-6


@pytest.mark.parametrize("read_key", [False, True])
def test_kkt_solve(read_key):
    """Ai = (I + strictLower(Diag(beta) (R K^T * Gamma)))^{-1}; R = k, or Comba's p with the exclusive gate."""
    q, k, p, beta, g, _ = inputs()
    ch = prepare_chunks(None, 1, T, 64, "cpu")
    g_cum = chunk_cumsum(g, ch)
    G = local_cumsum(chunked(g))
    if read_key:
        Ai = kkt_solve(k, beta, g_cum, ch, p=p, g_read=g_cum - g)
        A = decayed_scores(chunked(p), chunked(k), G - chunked(g), G, strict=True)
    else:
        Ai = kkt_solve(k, beta, g_cum, ch)
        A = decayed_scores(chunked(k), chunked(k), G, G, strict=True)
    want = solve_unit_lower(chunked(beta) * A)
    got = rows(Ai)
    valid = torch.arange(64)[None, :] < torch.tensor([64, 36])[:, None]  # [NT, 64]: rows that exist
    mask = (valid[:, :, None] & valid[:, None, :])[None]
    assert rel_err(got * mask, want * mask) < 1e-6


def test_kkt_solve_folds_beta():
    """``fold_beta``: Ai Diag(beta), column j of each chunk's inverse times beta_j (varlen, a short last chunk)."""
    _, k, _, beta, g, _ = inputs(3)
    ch = prepare_chunks(torch.tensor([0, 37, T]), 1, T, 64, "cpu")
    g_cum = chunk_cumsum(g, ch)
    Ai, folded = kkt_solve(k, beta, g_cum, ch), kkt_solve(k, beta, g_cum, ch, fold_beta=True)
    for a, n in ((0, 37), (37, T - 37)):   # each sequence one chunk: row t, column j its token a + j
        want = Ai[0, a:a + n, :, :n] * beta[0, a:a + n].T[None]
        assert rel_err(folded[0, a:a + n, :, :n], want) < 1e-6


@pytest.mark.parametrize("gated", [True, False])
def test_kkt_solve_output_scores(gated):
    """``q``: the inference pass's output scores lower(Gamma * Q K^T) per chunk, zeros above the
    diagonal and past a sequence's end (varlen, a short last chunk), beside the same Ai; refused
    with Comba's read key."""
    q, k, p, beta, g, _ = inputs(4)
    ch = prepare_chunks(torch.tensor([0, 37, T]), 1, T, 64, "cpu")
    g_cum = chunk_cumsum(g, ch) if gated else None
    Ai, scores = kkt_solve(k, beta, g_cum, ch, fold_beta=True, q=q)
    assert torch.equal(Ai, kkt_solve(k, beta, g_cum, ch, fold_beta=True))
    for a, n in ((0, 37), (37, T - 37)):   # each sequence one chunk: row t, column j its token a + j
        qk = torch.einsum("thk,shk->hts", q[0, a:a + n].double(), k[0, a:a + n].double())
        gam = (g_cum[0, a:a + n].double().T[:, :, None] - g_cum[0, a:a + n].double().T[:, None, :]).exp() \
            if gated else torch.ones(H, n, n, dtype=torch.float64)
        want = (qk * gam).tril().permute(1, 0, 2)
        assert rel_err(scores[0, a:a + n, :, :n], want) < 1e-6
        assert scores[0, a:a + n, :, n:].eq(0).all()
    with pytest.raises(ValueError, match="`q`"):
        kkt_solve(k, beta, g_cum, ch, p=p, g_read=g_cum, q=q)


def test_intra_and_solve_per_channel_gate():
    q, k, _, beta, _, gk = inputs(1)
    ch = prepare_chunks(None, 1, T, 64, "cpu")
    G_kernel = chunk_cumsum(gk, ch)
    Aqk, Akk = intra_fwd(q, k, G_kernel, ch)
    G = local_cumsum(chunked(gk))
    want_qk = decayed_scores(chunked(q), chunked(k), G, G)
    want_kk = decayed_scores(chunked(k), chunked(k), G, G, strict=True)
    valid = torch.arange(64)[None, :] < torch.tensor([64, 36])[:, None]
    mask = (valid[:, :, None] & valid[:, None, :])[None]
    assert rel_err(rows(Aqk) * mask, want_qk * mask) < 1e-6
    assert rel_err(rows(Akk) * mask, want_kk * mask) < 1e-6
    Ai = solve(Akk, beta, ch)
    assert rel_err(rows(Ai) * mask, solve_unit_lower(chunked(beta) * want_kk) * mask) < 1e-6


def test_intra_backward():
    """intra_bwd is the VJP of (Aqk, Akk) with respect to q, k and the cumsum G."""
    q, k, _, _, _, gk = inputs(2)
    ch = prepare_chunks(None, 1, T, 64, "cpu")
    G_kernel = chunk_cumsum(gk, ch)
    qd, kd, Gd = (chunked(x).requires_grad_() for x in (q, k, G_kernel))
    want_qk = decayed_scores(qd, kd, Gd, Gd)
    want_kk = decayed_scores(kd, kd, Gd, Gd, strict=True)
    gen = generator(3)
    dqk, dkk = torch.randn(1, T, H, 64, generator=gen), torch.randn(1, T, H, 64, generator=gen)
    valid = torch.arange(64)[None, :] < torch.tensor([64, 36])[:, None]
    mask = (valid[:, :, None] & valid[:, None, :])[None].double()
    causal = torch.ones(64, 64).tril().double()
    d_qk, d_kk = rows(dqk) * mask * causal, rows(dkk) * mask * causal.tril(-1)
    ((want_qk * d_qk).sum() + (want_kk * d_kk).sum()).backward()
    # back to the kernel layout: chunk rows t -> token t
    flat = lambda x: x.permute(1, 2, 0, 3).reshape(1, -1, H, 64)[:, :T].float().contiguous()  # noqa: E731
    dq, dk, dg = (torch.zeros(1, T, H, K) for _ in range(3))
    intra_bwd(q, k, G_kernel, flat(d_qk), flat(d_kk), dq, dk, dg, ch)
    back = lambda x: x.permute(1, 2, 0, 3).reshape(1, -1, H, K)[:, :T]  # noqa: E731
    assert rel_err(dq, back(qd.grad)) < 1e-5
    assert rel_err(dk, back(kd.grad)) < 1e-5
    assert rel_err(dg, back(Gd.grad)) < 1e-5



@pytest.mark.parametrize("K", [40, 8])
def test_intra_varlen_grouped_strong_gate(K):
    """intra_fwd and intra_bwd against float64 on one set of fp32 inputs: K not a power of two (40) and
    below 16 (8), grouped heads (HK = 2 for H = 4: value head h reads q, k of head h // 2), sequences of
    100 (a tail of 36), 0 and 70 (a last chunk of 6 rows, three of its row blocks past T), log gates
    of -5 per token on some blocks' channels (their 16-row span passes SAFE_SPAN: the pairwise diagonal
    block) and of at most -0.5 elsewhere (the factored one); dq, dk, dg arrive non-zero and dA is
    non-zero above the diagonal (never read)."""
    HV, HK, N = 4, 2, 170
    cu = torch.tensor([0, 100, 100, 170])
    gen = generator(4)
    q = torch.randn(1, N, HK, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, N, HK, K, generator=gen), dim=-1)
    gk = -torch.rand(1, N, HV, K, generator=gen) * 0.5
    strong = ((torch.arange(N) // 16) % 3 == 1)[:, None, None] & (torch.arange(HV)[:, None] < 2) \
        & (torch.arange(K) < K // 2)
    gk = torch.where(strong[None], -5.0 * (0.75 + 0.5 * torch.rand(gk.shape, generator=gen)), gk)
    ch = prepare_chunks(cu, 1, N, 64, "cpu")
    G_kernel = chunk_cumsum(gk, ch)
    layout = chunk_layout(1, N, 64, cu, "cpu")
    chunk = lambda x: to_chunks(x, layout, torch.float64)  # noqa: E731  [3, H, NT, 64, ...]
    G = chunk(G_kernel)
    # each 16-row block's span (its first row's G minus its others', padded rows at G = 0 add none)
    span = G.unflatten(3, (4, 16))
    span = (span[..., :1, :] - span).amax((-2, -1))  # [3, H, NT, 4]
    starts = 64 * torch.arange(2)[:, None] + 16 * torch.arange(4)
    span = span[(torch.tensor([100, 0, 70])[:, None, None] > starts)[:, None].expand_as(span)]
    assert (span >= common.SAFE_SPAN).any() and (span < common.SAFE_SPAN).any()
    qd, kd = (chunk(x.repeat_interleave(HV // HK, 2)).requires_grad_() for x in (q, k))
    Gd = G.clone().requires_grad_()
    want_qk = decayed_scores(qd, kd, Gd, Gd)
    want_kk = decayed_scores(kd, kd, Gd, Gd, strict=True)
    Aqk, Akk = intra_fwd(q, k, G_kernel, ch)
    assert rel_err(chunk(Aqk), want_qk) < 1e-6
    assert rel_err(chunk(Akk), want_kk) < 1e-6
    dqk, dkk = torch.randn(1, N, HV, 64, generator=gen), torch.randn(1, N, HV, 64, generator=gen)
    causal = torch.ones(64, 64, dtype=torch.float64).tril()
    ((want_qk * chunk(dqk) * causal).sum() + (want_kk * chunk(dkk) * causal.tril(-1)).sum()).backward()
    before = [torch.randn(1, N, HV, K, generator=gen) for _ in range(3)]
    dq, dk, dg = (x.clone() for x in before)
    intra_bwd(q, k, G_kernel, dqk, dkk, dq, dk, dg, ch)
    for got, x0, leaf in zip((dq, dk, dg), before, (qd, kd, Gd)):
        assert rel_err(got.double() - x0, from_chunks(leaf.grad, layout)) < 1e-6

def test_l2norm():
    x = torch.randn(3, 7, 2, 40, generator=generator(), dtype=torch.float64)
    mine = x.float().requires_grad_()
    ref = x.clone().requires_grad_()
    y, y_ref = l2norm(mine), l2norm_reference(ref)
    dy = torch.randn_like(y_ref)
    (y * dy.float()).sum().backward()
    (y_ref * dy).sum().backward()
    assert rel_err(y, y_ref) < 1e-6 and rel_err(mine.grad, ref.grad) < 1e-5


@pytest.mark.parametrize("gated", [False, True])
def test_state_pass_fused_read_matches_w_u(gated):
    """The state pass forming R = Ai Diag(beta) (V - Diag(gamma) K S) from the raw rows (``Ai=``)
    gives the outputs, states and reads of the pass that reads W and U (fp32, varlen with an empty
    and a partial sequence, initial state, grouped value heads: k at HK = 1, v at H = 2)."""
    from fastweight.kernels.state import state_fwd
    from fastweight.kernels.wy import recompute_w_u
    q, k, _, beta, g, _ = inputs(5)
    q, k = q[:, :, :1].contiguous(), k[:, :, :1].contiguous()
    v = torch.randn(1, T, H, 48, generator=generator(6))
    cu = torch.tensor([0, 0, 37, T])
    ch = prepare_chunks(cu, 1, T, 64, "cpu")
    h0 = torch.randn(3, H, K, 48, generator=generator(7))
    gc = chunk_cumsum(g, ch) if gated else None
    Ai = kkt_solve(k, beta, gc, ch)
    w, u = recompute_w_u(k, v, beta, gc, Ai, ch)
    kw = dict(g=gc, q=q, scale=0.3, initial_state=h0, output_final_state=True, store_h=True, store_r=True,
              fuse_output=True)
    h1, r1, o1, ht1 = state_fwd("delta", k, u, ch, w=w, u=u, **kw)
    h2, r2, o2, ht2 = state_fwd("delta", k, v, ch, Ai=Ai, beta=beta, **kw)
    for a, b in ((h1, h2), (r1, r2), (o1, o2), (ht1, ht2)):
        assert rel_err(b, a) < 1e-5
    with pytest.raises(ValueError, match="Ai"):
        state_fwd("decay", k, v, ch, g=gc, Ai=Ai, beta=beta)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fused_read", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_pass_k_transposed(gated, fused_read, dtype):
    """The forward state pass reading k as K^T tiles (``k_transposed``) gives the states, reads,
    outputs and final state of the one reading k's rows, from W and U or from the raw rows (varlen
    with an empty and a partial sequence, initial state, k at HK = 1 for v at H = 2): equal within
    the dtype's rounding (the fused read scales K S after the product instead of K before it)."""
    from fastweight.kernels.state import state_fwd
    from fastweight.kernels.wy import recompute_w_u
    q, k, _, beta, g, _ = inputs(11)
    q, k = (x[:, :, :1].to(dtype).contiguous() for x in (q, k))
    v = torch.randn(1, T, H, 48, generator=generator(12)).to(dtype)
    cu = torch.tensor([0, 0, 37, T])
    ch = prepare_chunks(cu, 1, T, 64, "cpu")
    h0 = torch.randn(3, H, K, 48, generator=generator(13))
    gc = chunk_cumsum(g, ch) if gated else None
    Ai = kkt_solve(k, beta, gc, ch)
    read = dict(Ai=Ai, beta=beta) if fused_read else dict(zip("wu", recompute_w_u(k, v, beta, gc, Ai, ch)))
    kw = dict(g=gc, q=q, scale=0.3, initial_state=h0, output_final_state=True, store_h=True, store_r=True,
              fuse_output=True, **read)
    rows_ = state_fwd("delta", k, read.get("u", v), ch, k_transposed=False, **kw)
    cols = state_fwd("delta", k, read.get("u", v), ch, k_transposed=True, **kw)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # measured: 1.4e-7, 3.6e-4
    for a, b in zip(rows_, cols):
        assert rel_err(b.float(), a.float()) < tol


def test_delta_forward_fused_read_backward():
    """A forward that formed the read in the state pass (no W kept) recomputes W for its backward:
    the gradients equal those of the forward that wrote W and U (fp32)."""
    from fastweight.kernels import delta
    q, k, _, beta, g, _ = inputs(8)
    v = torch.randn(1, T, H, K, generator=generator(9))
    ch = prepare_chunks(None, 1, T, 64, "cpu")
    do = torch.randn(1, T, H, K, generator=generator(10))
    grads = []
    for fuse in (False, True):
        o, _, saved = delta.delta_fwd(q, k, v, g, beta, 0.3, None, False, ch, True, fuse_wy=fuse)
        assert (saved[6] is None) == fuse
        grads.append((o,) + delta.delta_bwd(q, k, v, beta, saved, do, None, 0.3, ch, False)[:5])
    for a, b in zip(*grads):
        assert rel_err(b, a) < 1e-5


@pytest.mark.parametrize("transition", ["delta", "decay"])
def test_state_passes_int64_offsets(monkeypatch, transition):
    """The state passes with 64-bit token offsets (taken where a launch's offsets pass int32) give the
    int32 path's states, reads, outputs and gradients exactly (varlen, initial state)."""
    from fastweight.kernels import state
    from fastweight.kernels.state import state_bwd, state_fwd
    from fastweight.kernels.wy import recompute_w_u
    q, k, _, beta, g, _ = inputs(14)
    v = torch.randn(1, T, H, 48, generator=generator(15))
    cu = torch.tensor([0, 0, 37, T])
    ch = prepare_chunks(cu, 1, T, 64, "cpu")
    h0 = torch.randn(3, H, K, 48, generator=generator(16))
    gc = chunk_cumsum(g, ch)
    extra = {}
    if transition == "delta":
        Ai = kkt_solve(k, beta, gc, ch)
        extra = dict(zip("wu", recompute_w_u(k, v, beta, gc, Ai, ch)))
    do = torch.randn(1, T, H, 48, generator=generator(17))
    runs = []
    for off32 in (True, False):
        monkeypatch.setattr(state, "_off32", lambda *_, flag=off32: flag)
        fwd = state_fwd(transition, k, extra.get("u", v), ch, g=gc, q=q, scale=0.3, initial_state=h0,
                        output_final_state=True, store_h=True, store_r=transition == "delta",
                        fuse_output=transition == "delta", **extra)
        bwd = state_bwd(transition, q, do, ch, g=gc, k=k, w=extra.get("w"), scale=0.3, need_dh0=True)
        runs.append([t for t in fwd + bwd if t is not None])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_state_fwd_fused_output_arguments():
    """The forward state pass refuses a fused output it cannot form, naming the arguments, instead of
    failing inside the kernel: the decay transition with a per-channel gate and no intra scores A, or
    past one key block's K, DPLR without A_qb, the delta rule's output scores without the fused output."""
    from fastweight.kernels.state import state_fwd
    T, H, K = 64, 1, 16
    x = torch.randn(1, T, H, K)
    chunks = prepare_chunks(None, 1, T, 64, "cpu")
    g = torch.zeros(1, T, H, K)
    A = torch.zeros(1, T, H, 64)
    with pytest.raises(ValueError, match="fuse_output"):
        state_fwd("decay", x, x, chunks, g=g, q=x, fuse_output=True)
    wide = torch.randn(1, T, H, 256)
    with pytest.raises(ValueError, match="K <= 128"):
        state_fwd("decay", wide, x, chunks, q=wide, fuse_output=True)
    with pytest.raises(ValueError, match="A2"):
        state_fwd("dplr", x, x, chunks, g=g, w=x, u=x, b=x, q=x, A=A, fuse_output=True)
    with pytest.raises(ValueError, match="fuse_output"):   # the delta rule's given output scores
        state_fwd("delta", x, x, chunks, g=torch.zeros(1, T, H), w=x, u=x, q=x, A=A, fuse_output=False)


@pytest.mark.parametrize("dtype, gated, V", [(torch.float32, True, 48), (torch.float16, True, 16),
                                             (torch.float32, False, 80)])
def test_kkt_solve_forms_w_u(dtype, gated, V):
    """``kkt_solve(v=...)``: W and U from the inverse's blocks in the solve's program, against
    ``recompute_w_u`` on the Ai the plain solve stores (bit-equal to the one returned beside them):
    to the rounding of the dtype, grouped heads (k shared by two value heads), varlen with an
    empty sequence, a sequence over two chunks with a short last one, V not a multiple of 32."""
    from fastweight.kernels.wy import recompute_w_u
    T = 150  # the second sequence (113 tokens) spans two chunks
    gen = generator(7)
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, generator=gen).to(dtype)
    beta = torch.rand(1, T, H, generator=gen).to(dtype)
    g = -torch.rand(1, T, H, generator=gen) * 0.5
    ch = prepare_chunks(torch.tensor([0, 37, 37, T]), 1, T, 64, "cpu")
    g_cum = chunk_cumsum(g, ch) if gated else None
    Ai = kkt_solve(k, beta, g_cum, ch)
    w, u = recompute_w_u(k, v, beta, g_cum, Ai, ch)
    Ai2, w2, u2 = kkt_solve(k, beta, g_cum, ch, v=v)
    assert torch.equal(Ai2, Ai)
    # measured (interpreter): fp32 <= 7.6e-8, fp16 <= 1.2e-5 (the order of the sums; both round W and U alike)
    tol = {torch.float32: 4.8e-7, torch.float16: 1e-4}[dtype]
    assert rel_err(w2, w) < tol, f"W {rel_err(w2, w):.3g}"
    assert rel_err(u2, u) < tol, f"U {rel_err(u2, u):.3g}"
    with pytest.raises(ValueError, match="`v`"):
        kkt_solve(k, beta, g_cum, ch, v=v, fold_beta=True)
    with pytest.raises(ValueError, match="`v` must be"):
        kkt_solve(k, beta, g_cum, ch, v=v[:, :, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_solve_forms_gated_w_u(dtype):
    """``solve(wu=...)`` (KDA): W, U and the state pass's gated rows qg, kd from the inverse's blocks,
    against ``recompute_w_u(gk_cum=, q=)`` on the Ai the plain solve stores (bit-equal to the one
    returned): grouped heads, varlen with an empty sequence, a sequence over two chunks with a short
    last one, K and V not multiples of 32. The gated rows are the same elementwise products: bit-equal."""
    from fastweight.kernels.wy import recompute_w_u
    T = 150  # the second sequence (113 tokens) spans two chunks
    gen = generator(8)
    Kx, V = 48, 40
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, Kx, generator=gen), dim=-1).to(dtype)
    q = torch.randn(1, T, 1, Kx, generator=gen).to(dtype)
    v = torch.randn(1, T, H, V, generator=gen).to(dtype)
    beta = torch.rand(1, T, H, generator=gen).to(dtype)
    gk = -torch.rand(1, T, H, Kx, generator=gen) * 0.5
    ch = prepare_chunks(torch.tensor([0, 37, 37, T]), 1, T, 64, "cpu")
    gk_cum = chunk_cumsum(gk, ch)
    _, Akk = intra_fwd(q, k, gk_cum, ch)
    Ai = solve(Akk, beta, ch, dtype=dtype, precision_of=dtype)
    w, u, qg, kd = recompute_w_u(k, v, beta, None, Ai, ch, gk_cum=gk_cum, q=q)
    Ai2, w2, u2, qg2, kd2 = solve(Akk, beta, ch, dtype=dtype, precision_of=dtype, wu=(k, v, gk_cum, q))
    assert torch.equal(Ai2, Ai)
    assert torch.equal(qg2, qg) and torch.equal(kd2, kd)
    tol = {torch.float32: 4.8e-7, torch.float16: 1e-4}[dtype]  # as test_kkt_solve_forms_w_u's
    assert rel_err(w2, w) < tol, f"W {rel_err(w2, w):.3g}"
    assert rel_err(u2, u) < tol, f"U {rel_err(u2, u):.3g}"
    with pytest.raises(ValueError, match="`wu`"):
        solve(Akk, beta, ch, dtype=dtype, precision_of=dtype, wu=(k, v, gk_cum[..., :16], q))


@pytest.mark.parametrize("Kx", [32, 20])
def test_intra_forms_the_gate_sums(Kx):
    """``intra_fwd(g=...)``: the kernel forms the chunk sums from the raw log gate and returns them with the
    scores; all three bit-equal to ``chunk_cumsum`` then ``intra_fwd`` (varlen with an empty sequence, a
    short last chunk, K = 20 padded); both or neither of the gate's forms is refused."""
    gen = generator(7)
    q, k = torch.randn(1, T, H, Kx, generator=gen), torch.randn(1, T, H, Kx, generator=gen)
    gk = -torch.rand(1, T, H, Kx, generator=gen)
    ch = prepare_chunks(torch.tensor([0, 37, 37, T]), 1, T, 64, "cpu")
    G = chunk_cumsum(gk, ch)
    Aqk, Akk, G_kernel = intra_fwd(q, k, None, ch, g=gk)
    assert torch.equal(G_kernel, G)
    want_qk, want_kk = intra_fwd(q, k, G, ch)
    assert torch.equal(Aqk, want_qk) and torch.equal(Akk, want_kk)
    with pytest.raises(ValueError, match="not both"):
        intra_fwd(q, k, G, ch, g=gk)
    with pytest.raises(ValueError, match="not both"):
        intra_fwd(q, k, None, ch)


@pytest.mark.parametrize("dtype, products", [(torch.float32, True), (torch.float16, True), (torch.float32, False)])
def test_intra_forms_the_solve(dtype, products, monkeypatch):
    """``intra_fwd(beta=...)``: the solve Ai = (I + Diag(beta) Akk)^{-1} formed in the intra kernel from Akk's
    blocks in registers; Aqk and Akk bit-equal to the unfused kernel's, Ai to ``solve`` reading that Akk back
    (within one rounding of Ai's dtype: the dots' order may differ) and to float64. Varlen with an empty
    sequence and short last chunks, grouped heads, strong gates on some channels (the pairwise diagonal
    blocks); with the gate sums formed in the kernel too; Akk not stored unless asked for. The diagonal blocks
    both ways (``intra.SOLVE_PRODUCTS_DTYPES``: products of powers, bf16's default, or substitution)."""
    from fastweight.kernels import intra
    monkeypatch.setattr(intra, "SOLVE_PRODUCTS_DTYPES", (dtype,) if products else ())
    HV, HK, N, Kx = 4, 2, 170, 40
    cu = torch.tensor([0, 100, 100, 170])
    gen = generator(8)
    q = torch.randn(1, N, HK, Kx, generator=gen).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(1, N, HK, Kx, generator=gen), dim=-1).to(dtype)
    gk = -torch.rand(1, N, HV, Kx, generator=gen) * 0.5
    strong = ((torch.arange(N) // 16) % 3 == 1)[:, None, None] & (torch.arange(Kx) < Kx // 2)
    gk = torch.where(strong[None], -5.0, gk)
    beta = torch.rand(1, N, HV, generator=gen).to(dtype)
    ch = prepare_chunks(cu, 1, N, 64, "cpu")
    G = chunk_cumsum(gk, ch)
    want_qk, want_kk = intra_fwd(q, k, G, ch)
    want_ai = solve(want_kk, beta, ch, dtype=dtype, precision_of=dtype)
    layout = chunk_layout(1, N, 64, cu, "cpu")
    exact = solve_unit_lower(to_chunks(beta.double(), layout, torch.float64)
                             * to_chunks(want_kk.double(), layout, torch.float64))
    valid = to_chunks(torch.ones(1, N, 1, dtype=torch.float64), layout, torch.float64)  # [3, 1, NT, 64, 1]
    exact = exact * valid * valid.transpose(-1, -2)
    one = torch.finfo(dtype).eps
    for store in (True, False):
        Aqk, Akk, Ai = intra_fwd(q, k, G, ch, beta=beta, store_akk=store)
        assert torch.equal(Aqk, want_qk)
        assert torch.equal(Akk, want_kk) if store else Akk is None
        assert Ai.dtype == dtype and (Ai.float() - want_ai.float()).abs().max() <= 2 * one * want_ai.abs().max()
        assert rel_err(to_chunks(Ai, layout, torch.float64), exact) < (1e-6 if dtype == torch.float32 else 2e-3)
    Aqk, Akk, G_kernel, Ai = intra_fwd(q, k, None, ch, g=gk, beta=beta, store_akk=False)
    assert torch.equal(G_kernel, G) and torch.equal(Aqk, want_qk) and Akk is None
    assert (Ai.float() - want_ai.float()).abs().max() <= 2 * one * want_ai.abs().max()
    with pytest.raises(ValueError, match="`beta`"):
        intra_fwd(q, k, G, ch, beta=beta[:, :-1])


def test_intra_solve_products_stay_under_bf16_rounding(monkeypatch):
    """The fused solve's product form (``intra.SOLVE_PRODUCTS``, bf16's) cancels where A is large: beta up to 2
    (``allow_neg_eigval``), near-parallel keys, no decay. Its Ai, formed in fp32, must stay within bf16's rounding
    of the stored Ai (2^-8 of the largest entry); measured 3.6e-4 here (2.6e-4 to 9.3e-4 over seeds 11-13).
    Substitution, fp32's, keeps fp32 accuracy on the same chunks (7.6e-7; 5.6e-7 to 1.0e-6)."""
    from fastweight.kernels import intra
    N, K = 128, 32
    gen = generator(11)
    base = torch.randn(1, 1, 1, K, generator=gen)
    k = torch.nn.functional.normalize(3 * base + torch.randn(1, N, 1, K, generator=gen), dim=-1)
    G = torch.zeros(1, N, 1, K)
    beta = 2 * torch.rand(1, N, 1, generator=gen)
    ch = prepare_chunks(None, 1, N, 64, "cpu")
    layout = chunk_layout(1, N, 64, None, "cpu")
    _, Akk = intra_fwd(k, k, G, ch)
    exact = solve_unit_lower(to_chunks(beta.double(), layout, torch.float64) * to_chunks(Akk.double(), layout,
                                                                                          torch.float64))
    err = {}
    for products in (True, False):
        monkeypatch.setattr(intra, "SOLVE_PRODUCTS_DTYPES", (torch.float32,) if products else ())
        Ai = intra_fwd(k, k, G, ch, beta=beta, store_akk=False)[-1]
        err[products] = float((to_chunks(Ai, layout, torch.float64) - exact).abs().max() / exact.abs().max())
    assert err[True] < 2 ** -8 and err[False] < 1e-5, err
