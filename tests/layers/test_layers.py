import pytest
import torch

from fastweight import ops
from fastweight.layers import Attention, ShortConv, build_mixer, force_generic
from fastweight.layers.common import TokenShift
from fastweight.layers.linear_op import GENERIC
from fastweight.models import MIXERS, LMConfig
from fastweight.testing import generator, rel_err

LINEAR = [m for m in MIXERS if m not in ("attn", "swa")]


def cfg(mixer="gdn", **kw):
    return LMConfig.preset("tiny", mixer=mixer, vocab_size=64, **kw)


def x(B=2, T=19, D=64, seed=None):
    return torch.randn(B, T, D, generator=generator(seed))


def test_short_conv_is_causal_and_cached():
    conv = ShortConv(8, 4, "silu")
    inp = x(D=8)
    full, tail = conv(inp)
    assert torch.equal(tail, inp[:, -3:])
    first, cache = conv(inp[:, :10])
    steps = [first]
    for t in range(10, 19):
        y, cache = conv(inp[:, t:t + 1], cache)
        steps.append(y)
    assert rel_err(torch.cat(steps, 1), full) < 1e-6
    changed = inp.clone()
    changed[:, 12] += 1
    assert torch.equal(conv(changed)[0][:, :12], full[:, :12])


def test_token_shift():
    inp = x(D=4)
    prev, last = TokenShift()(inp)
    assert torch.equal(prev[:, 1:], inp[:, :-1]) and not prev[:, 0].any() and torch.equal(last, inp[:, -1:])


@pytest.mark.parametrize("window", [None, 5])
def test_attention_window_matches_a_dense_softmax(window):
    layer = Attention(cfg(window_size=window or 8), window=window)
    inp = x(B=1, T=11)
    y = layer(inp)
    # output i depends only on the tokens of its window: changing the others leaves it as it is
    for i in (0, 6, 10):
        lo = 0 if window is None else max(0, i - window + 1)
        part = inp.clone()
        part[:, :lo] = torch.randn_like(part[:, :lo])
        part[:, i + 1:] = torch.randn_like(part[:, i + 1:])
        assert rel_err(layer(part)[:, i], y[:, i]) < 1e-6


@pytest.mark.parametrize("mixer", LINEAR)
def test_specialised_op_matches_its_dplr_form(mixer):
    """Each layer's fla-named op and the layer's own mapping onto the generic DPLR op agree."""
    torch.manual_seed(0)
    layer = build_mixer(mixer, cfg(mixer))
    inp = x(seed=3)
    cache_a, cache_b = {}, {}
    out = layer(inp, cache_a)
    with force_generic():
        ref = layer(inp, cache_b)
    assert rel_err(out, ref) < 1e-5
    if "state" in cache_a:
        assert rel_err(cache_a["state"], cache_b["state"]) < 1e-5


def test_every_op_has_a_dplr_form():
    assert set(ops.OPS) - {"dplr_delta_rule"} <= set(GENERIC)


@pytest.mark.parametrize("mixer", ["gdn", "deltanet", "kda", "comba"])
def test_allow_neg_eigval_doubles_beta(mixer):
    torch.manual_seed(0)
    layer = build_mixer(mixer, cfg(mixer, allow_neg_eigval=True))
    beta = layer.gates(x())["beta"]
    assert beta.max() > 1 and beta.max() <= 2
    layer(x())  # the op accepts beta in [0, 2]


@pytest.mark.parametrize("mixer", ["gdn", "rwkv7", "mamba2"])
def test_eval_decode_switches_to_fused_recurrent(mixer):
    layer = build_mixer(mixer, cfg(mixer))
    assert layer.mode(1000) == "chunk" and layer.mode(1) == "chunk"
    layer.eval()
    assert layer.mode(1) == "fused_recurrent" and layer.mode(1000) == "chunk"


@pytest.mark.parametrize("T", [8, 13, 24])
def test_window_blocks_match_the_masked_dense_form(T):
    from fastweight.layers.attention import window_blocks
    g = generator()
    q, k, v = (torch.randn(2, 3, T, 8, generator=g) for _ in range(3))
    pos = torch.arange(T)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert rel_err(window_blocks(q, k, v, 4), ref) < 1e-6


def test_full_attention_cache_grows_in_place():
    layer = Attention(cfg("attn"))
    cache = {}
    inp = x(B=1, T=9)
    ref = layer(inp)
    outs = [layer(inp[:, :4], cache, {"offset": 0})]
    for t in range(4, 9):
        outs.append(layer(inp[:, t:t + 1], cache, {"offset": t}))
    assert cache["length"] == 9 and cache["k"].shape[1] == 4 + 1 + 256  # the prompt, then room for 256 more
    assert rel_err(torch.cat(outs, 1), ref) < 1e-6


@pytest.mark.parametrize("T", [1, 2, 7])
def test_short_conv_short_inputs_keep_a_full_cache(T):
    conv = ShortConv(8, 4, None)
    inp = x(T=T, D=8)
    y, tail = conv(inp)
    y2, tail2 = conv(inp, torch.zeros(2, 3, 8))
    assert tail.shape == (2, 3, 8) and torch.equal(tail, tail2) and rel_err(y, y2) < 1e-6


@pytest.mark.parametrize("chunks", [(3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 1, 1, 1, 5, 1), (1,) * 23, (9, 1, 1, 12)])
def test_window_ring_cache_matches_one_pass(chunks):
    """Prefill, single steps that wrap the ring of W slots, then several tokens at once, then steps."""
    layer = Attention(cfg("swa", window_size=5), window=5)
    inp = x(B=2, T=sum(chunks))
    ref = layer(inp)
    cache, outs, t = {}, [], 0
    for n in chunks:
        outs.append(layer(inp[:, t:t + n], cache, {"offset": t}))
        t += n
        assert cache["k"].shape[1] == 5 and cache["length"] == min(t, 5)
    assert rel_err(torch.cat(outs, 1), ref) < 1e-6


def test_flash_attention_is_cuda_only():
    from fastweight.layers.attention import flash_usable
    assert not flash_usable(torch.randn(1, 4, 2, 8))


def flash_semantics(q, k, v, T, S, left, causal=True):
    """What aten::_flash_attention_forward computes (q [B, T, H, d], k, v [B, S, Hk, d]): query i sees
    the keys j <= i + S - T (causal, aligned to the last key) and j >= i + S - T - left."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    i = torch.arange(T)[:, None] + S - T
    j = torch.arange(S)[None, :]
    mask = j <= i
    if left is not None:
        mask = mask & (j >= i - left)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask)
    return o.transpose(1, 2)


def fake_flash_op(shift=0):
    """A CPU stand-in for aten::_flash_attention_forward (``shift`` widens the window: a wrong kernel)."""
    def op(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, window_size_left=None,
           window_size_right=None):
        assert causal and window_size_right in (None, 0) and max_q == q.shape[1] and max_k == k.shape[1]
        left = None if window_size_left is None else window_size_left + shift
        return (flash_semantics(q, k, v, q.shape[1], k.shape[1], left),)
    return op


@pytest.mark.parametrize("window", [None, 5])
def test_attention_flash_path_matches_sdpa(window, monkeypatch):
    """The layer's calls of the flash op (window, last-key alignment, grouped heads, the ring cache)
    under the op's documented semantics give the SDPA path's outputs."""
    from fastweight.layers import attention
    layer = Attention(cfg("swa", window_size=5, n_kv_heads=1), window=window)
    inp = x(B=2, T=17)
    ref = layer(inp)
    cache = {}
    ref_steps = [layer(inp[:, :9], cache, {"offset": 0})]
    ref_steps += [layer(inp[:, t:t + 1], cache, {"offset": t}) for t in range(9, 17)]
    monkeypatch.setattr(attention, "flash_usable", lambda q: True)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake_flash_op())
    assert rel_err(layer(inp), ref) < 1e-6
    cache = {}
    steps = [layer(inp[:, :9], cache, {"offset": 0})]
    steps += [layer(inp[:, t:t + 1], cache, {"offset": t}) for t in range(9, 17)]
    assert rel_err(torch.cat(steps, 1), torch.cat(ref_steps, 1)) < 1e-6


def test_flash_probe_accepts_the_right_kernel_and_rejects_a_wrong_one(monkeypatch):
    from fastweight.layers import attention
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake_flash_op())
    assert attention._probe(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake_flash_op(shift=1))
    with pytest.warns(UserWarning, match="disagrees"):
        assert not attention._probe(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("width", [3, 4], ids=["W-1", "W"])
def test_short_conv_tails_over_calls_and_packed(width):
    """A stream cut into calls of 2, 1 and 3 tokens (shorter than the kernel: the tail reaches into the
    cache) gives the full call's outputs, and each tail is the stream's last ``tail_width`` inputs;
    packed sequences continuing from per-sequence caches do the same, an empty one keeping its cache."""
    conv = ShortConv(5, 4, "silu").double()
    conv.tail_width = width
    gen = generator()
    x = torch.randn(2, 6, 5, dtype=torch.float64, generator=gen)
    full, _ = conv(x)
    outs, cache = [], None
    for a, b in ((0, 2), (2, 3), (3, 6)):
        y, cache = conv(x[:, a:b], cache)
        outs.append(y)
        want = torch.nn.functional.pad(x[:, :b], (0, 0, max(width - b, 0), 0))[:, -width:]
        assert cache.shape == (2, width, 5) and torch.equal(cache, want)
    assert rel_err(torch.cat(outs, 1), full) < 1e-12
    # packed: sequence 0 continues with 2 more tokens, sequence 1 with none
    more = torch.randn(1, 2, 5, dtype=torch.float64, generator=gen)
    y, tails = conv(more, cache, positions=torch.arange(2), cu_seqlens=torch.tensor([0, 2, 2]))
    alone, tail0 = conv(more, cache[:1])
    assert rel_err(y, alone) < 1e-12 and torch.equal(tails[0], tail0[0]) and torch.equal(tails[1], cache[1])
    with pytest.raises(ValueError, match="convolution cache"):
        conv(more, cache[:, :2])


def _signed_loop(q, k, v, g, h0, cu):
    """S_t = (2 exp(g_t) - 1) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t per sequence of ``cu`` (B = 1)."""
    outs, finals = [], []
    for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        S = h0[n]
        for t in range(bos, eos):
            S = (2 * g[0, t].exp() - 1)[:, None, None] * S + k[0, t][:, :, None] * v[0, t][:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[0, t]))
        finals.append(S)
    return torch.stack(outs)[None], torch.stack(finals)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_mamba2_negative_eigenvalues_are_the_signed_recurrence(mode):
    """Mamba-2 with ``allow_neg_eigval`` (a_t = 2 exp(g_t) - 1, both signs drawn): the mixer's recurrence
    equals the signed one written out, float64, packed with an empty sequence and per-sequence caches,
    a partial chunk, every gradient; two calls through a cache equal one."""
    layer = build_mixer("mamba2", cfg("mamba2", allow_neg_eigval=True)).double()
    layer.train(mode == "chunk")
    if mode == "fused_recurrent":   # the packed call's 75 tokens would otherwise take the chunk path
        layer.recurrent_threshold = 10 ** 6
    assert layer.mode(75) == mode and layer.mode(33) == mode
    gen = generator()
    cu, H, N, P = [0, 70, 70, 75], 2, 4, 3
    T = cu[-1]
    q, k, v = (torch.randn(1, T, H, d, dtype=torch.float64, generator=gen) for d in (N, N, P))
    g = torch.rand(1, T, H, dtype=torch.float64, generator=gen).log()          # a uniform in (-1, 1)
    h0 = torch.randn(3, H, N, P, dtype=torch.float64, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, h0)]
    cache = {"state": leaves[4]}
    shared = dict(cu_seqlens=torch.tensor(cu), positions=torch.cat([torch.arange(70), torch.arange(5)]))
    o = layer._signed_recur(cache, shared, *leaves[:4])
    o_ref, S_ref = _signed_loop(*leaves, cu)
    assert (2 * g.exp() - 1).min() < -0.5 and rel_err(o, o_ref) < 1e-12 and rel_err(cache["state"], S_ref) < 1e-12
    do, dS = torch.randn_like(o_ref), torch.randn_like(S_ref)
    got = torch.autograd.grad((o * do).sum() + (cache["state"] * dS).sum(), leaves)
    want = torch.autograd.grad((o_ref * do).sum() + (S_ref * dS).sum(), leaves)
    for name, a, b in zip(("q", "k", "v", "g", "initial_state"), got, want):
        assert rel_err(a, b) < 1e-10, f"d{name}: {rel_err(a, b):.3g}"
    with torch.no_grad():   # one sequence in two calls through the cache
        one = {"state": h0[:1].clone()}
        whole = layer._signed_recur(one, None, q[:, :70], k[:, :70], v[:, :70], g[:, :70])
        two = {"state": h0[:1].clone()}
        parts = [layer._signed_recur(two, None, *(t[:, a:b] for t in (q, k, v, g))) for a, b in ((0, 33), (33, 70))]
    assert rel_err(torch.cat(parts, 1), whole) < 1e-12 and rel_err(two["state"], one["state"]) < 1e-12


def test_mamba2_negative_eigenvalues_in_the_model():
    """The flag reaches the layer (it was ignored before): outputs differ from [0, 1], the LM trains a
    step and decodes token by token as it prefills."""
    from fastweight.models import LanguageModel
    torch.manual_seed(0)
    pos, neg = (build_mixer("mamba2", cfg("mamba2", allow_neg_eigval=f)).double() for f in (False, True))
    neg.load_state_dict(pos.state_dict())
    inp = x(seed=4).double()
    assert rel_err(neg(inp), pos(inp)) > 1e-3
    model = LanguageModel(cfg("mamba2", allow_neg_eigval=True)).double()
    ids = torch.randint(0, 64, (2, 12), generator=generator())
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache)] + [model(ids[:, t:t + 1], cache) for t in range(5, 12)]
    assert rel_err(torch.cat(steps, 1), full) < 1e-10


def test_packed_caches_refuse_a_batch_and_form_positions():
    conv, shift = ShortConv(5, 4, None).double(), TokenShift()
    x = torch.randn(1, 6, 5, dtype=torch.float64, generator=generator())
    cu = torch.tensor([0, 2, 6])
    for module in (conv, shift):
        given = module(x, None, torch.tensor([0, 1, 0, 1, 2, 3]), cu)
        formed = module(x, None, None, cu)
        assert all(torch.equal(a, b) for a, b in zip(given, formed))
        with pytest.raises(ValueError, match="cu_seqlens.*batch size 1"):
            module(x.expand(2, 6, 5), None, None, cu)
