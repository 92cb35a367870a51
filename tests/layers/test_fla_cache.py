"""fla's cache protocol on the fla-named layers (``fastweight.layers.fla_cache``): prefill then
token-by-token decode through a protocol cache equals one full forward (fp32) for every layer, with
a minimal stand-in, with :class:`LayerCache` and with fla's own ``Cache`` (where fla's models
import); the entries are fla's layouts of our state; fla's own layers (where they import) prefill
into the cache that ours decode from; the refusals."""

import os

import pytest
import torch

from fastweight.layers import (Comba, DeltaNet, GatedDeltaNet, GatedLinearAttention, HGRN2Attention,
                               KimiDeltaAttention, Mamba2, RWKV7Attention)
from fastweight.layers.fla_cache import LayerCache, read_layer, write_layer
from fastweight.testing import fla_on_cpu, generator, rel_err

# each layer small; RWKV-7 at layer 0 (it makes v_first there; later layers read it)
LAYERS = {"gdn": (GatedDeltaNet, dict(hidden_size=32, head_dim=8, num_heads=2, expand_v=2)),
          "gdn_gva": (GatedDeltaNet, dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4)),
          "kda": (KimiDeltaAttention, dict(hidden_size=32, head_dim=8, num_heads=2)),
          "deltanet": (DeltaNet, dict(hidden_size=32, num_heads=2, expand_k=0.5)),
          "gla": (GatedLinearAttention, dict(hidden_size=32, num_heads=2)),
          "comba": (Comba, dict(hidden_size=32, head_dim=8, num_heads=2, expand_v=2)),
          "hgrn2": (HGRN2Attention, dict(hidden_size=32, expand_ratio=8)),
          "mamba2": (Mamba2, dict(hidden_size=32, head_dim=8, state_size=8)),
          "rwkv7": (RWKV7Attention, dict(hidden_size=64, head_dim=16, num_hidden_layers=2))}
KINDS = list(LAYERS)


class ProtocolCache:
    """The protocol and nothing else (what fla's layers call): per-layer dicts, ``update`` keeping
    what it is not given."""

    def __init__(self):
        self.entries = []

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, layer_idx):
        return self.entries[layer_idx]

    def update(self, recurrent_state=None, attn_state=None, conv_state=None, ffn_state=None, layer_idx=0,
               offset=1, cache_kwargs=None):
        while len(self.entries) <= layer_idx:
            self.entries.append(None)
        entry = self.entries[layer_idx] or dict.fromkeys(("recurrent_state", "attn_state", "conv_state", "ffn_state"))
        for name, value in (("recurrent_state", recurrent_state), ("conv_state", conv_state)):
            if value is not None:
                entry[name] = value
        self.entries[layer_idx] = entry
        return entry


def _layer(kind, layer_idx=0):
    torch.manual_seed(0)
    cls, kw = LAYERS[kind]
    layer = cls(layer_idx=layer_idx, **kw).eval()
    for p in layer.parameters():   # away from the initialisation's ones and zeros
        p.data.add_(0.1 * torch.randn_like(p))
    return layer


def _input(kind, B=2, T=12):
    return torch.randn(B, T, LAYERS[kind][1]["hidden_size"], generator=generator())


def _prefill_then_decode(layer, x, cache, prefill):
    """Outputs of a prefill over ``prefill`` tokens, then one call per token, all through ``cache``."""
    outs = [layer(x[:, :prefill], past_key_values=cache, use_cache=True)]
    for t in range(prefill, x.shape[1]):
        outs.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True))
    assert all(out[2] is cache for out in outs)   # the cache passed is the one returned, as fla's layers do
    return torch.cat([out[0] for out in outs], 1)


@pytest.mark.parametrize("make", [ProtocolCache, LayerCache], ids=["stand-in", "LayerCache"])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_through_protocol_cache(kind, make):
    layer, x = _layer(kind), _input(kind)
    with torch.no_grad():
        full = layer(x)[0]
        for prefill in (1, 7):
            cache = make()
            assert rel_err(_prefill_then_decode(layer, x, cache, prefill), full) <= 1e-5
    if make is LayerCache:
        assert cache.get_seq_length(0) == x.shape[1] and cache.get_seq_length(3) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_decode_through_protocol_cache_on_triton(kind):
    """The same on the Triton kernels (the convolution's and the recurrence's, from fla's entries)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on a CPU need TRITON_INTERPRET=1")
    from fastweight.layers import use_backend
    layer, x = _layer(kind), _input(kind)
    with torch.no_grad(), use_backend("triton"):
        full = layer(x)[0]
        got = _prefill_then_decode(layer, x, ProtocolCache(), 7)
    assert rel_err(got, full) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_decode_through_fla_cache(kind):
    fla_utils = pytest.importorskip("fla.models.utils")
    layer, x = _layer(kind), _input(kind)
    with torch.no_grad():
        full = layer(x)[0]
        cache = fla_utils.Cache()
        got = _prefill_then_decode(layer, x, cache, 7)
    assert rel_err(got, full) <= 1e-5 and cache.get_seq_length(0) == x.shape[1]


@pytest.mark.parametrize("kind", KINDS)
def test_entries_are_fla_layouts_of_our_state(kind):
    """The same prefill into our dict and into a protocol cache: fla's entry is our state in fla's
    layout (transposed for the V-first layers), bit for bit, the convolutions' last W inputs too (the
    oldest, which no output reads, is x_{T-W}: nonzero); and reading it back gives our dict."""
    layer, x = _layer(kind), _input(kind, T=9)
    with torch.no_grad():
        ours = layer(x, use_cache=True)[2]
        cache = ProtocolCache()
        layer(x, past_key_values=cache, use_cache=True)
    entry, layout = cache[0], layer.FLA_CACHE
    state = entry["recurrent_state"]
    assert torch.equal(state.transpose(-1, -2) if layout.v_first else state, ours["state"])
    if kind in ("gdn", "gdn_gva", "kda", "gla", "hgrn2", "mamba2"):   # fla's state_v_first / mamba's [h, p, n]
        assert layout.v_first
    convs = () if entry["conv_state"] is None else entry["conv_state"]
    convs = (convs,) if isinstance(convs, torch.Tensor) else convs
    assert len(convs) == len(layout.conv)
    for key, conv in zip(layout.conv, convs):
        if key == "shift":
            assert torch.equal(conv, ours[key][:, 0])
        else:
            assert torch.equal(conv, ours[key].transpose(1, 2)) and conv[..., 0].abs().min() > 0
    back = read_layer(cache, 0, layout)
    assert set(back) == set(ours) and all(torch.equal(back[k], ours[k]) for k in ours)


def test_layers_share_one_cache_by_layer_idx():
    """Two layers (RWKV-7 layer 0 and 1: the value residual passed between them) share one cache,
    each at its ``layer_idx``, as an fla model's layers do. In float64: the chunked and the whole
    computation then agree to rounding (~2e-15), where fp32's ~1e-6 reached 1.3e-5 on an input whose
    output norm amplifies it (seed 15317578905695214833)."""
    first, second = _layer("rwkv7", 0).double(), _layer("rwkv7", 1).double()
    x = _input("rwkv7", T=10).double()
    with torch.no_grad():
        o0, _, _, v_first = first(x)
        want = second(o0, v_first=v_first)[0]
        cache, outs = LayerCache(), []
        for t0, t1 in ((0, 6),) + tuple((t, t + 1) for t in range(6, 10)):
            h, _, _, v = first(x[:, t0:t1], past_key_values=cache, use_cache=True)
            outs.append(second(h, v_first=v, past_key_values=cache, use_cache=True)[0])
    assert len(cache) == 2 and rel_err(torch.cat(outs, 1), want) <= 1e-12


def test_cache_advances_without_use_cache():
    """A protocol cache passed is read and written whether or not ``use_cache`` is set (as this
    library's dict is)."""
    layer, x = _layer("gdn"), _input("gdn")
    with torch.no_grad():
        full = layer(x)[0]
        cache = LayerCache()
        o1 = layer(x[:, :8], past_key_values=cache)[0]
        o2 = layer(x[:, 8:], past_key_values=cache)[0]
    assert rel_err(torch.cat([o1, o2], 1), full) <= 1e-5


@pytest.mark.parametrize("kind", ["gdn", "kda", "deltanet", "gla", "comba", "hgrn2", "mamba2", "rwkv7"])
def test_fla_layer_prefills_ours_decodes(kind, monkeypatch):
    """fla's own layer (same weights, fp32) prefills into fla's Cache; ours decodes from it, token by
    token, to fla's full forward; ours prefilling writes the entry fla's layer writes (the
    convolutions' W inputs, the unread oldest too)."""
    fla_layers = fla_on_cpu(monkeypatch)
    fla_utils = pytest.importorskip("fla.models.utils")
    ours = _layer(kind)
    cls = {"gdn": fla_layers.GatedDeltaNet, "kda": fla_layers.KimiDeltaAttention, "deltanet": fla_layers.DeltaNet,
           "gla": fla_layers.GatedLinearAttention, "comba": fla_layers.Comba, "hgrn2": fla_layers.HGRN2Attention,
           "mamba2": fla_layers.Mamba2, "rwkv7": fla_layers.RWKV7Attention}
    theirs = cls[kind](layer_idx=0, **LAYERS[kind][1], **(dict(backend="triton") if kind == "mamba2" else {})).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = _input(kind, T=9)
    with torch.no_grad():
        want = theirs(x)[0]
        cache = fla_utils.Cache()
        outs = [theirs(x[:, :6], past_key_values=cache, use_cache=True)[0]]
        theirs_entry = {k: v for k, v in cache[0].items()}
        outs += [ours(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0] for t in range(6, 9)]
        mine = fla_utils.Cache()
        ours(x[:, :6], past_key_values=mine, use_cache=True)
    assert rel_err(torch.cat(outs, 1), want) <= 1e-5
    assert rel_err(mine[0]["recurrent_state"], theirs_entry["recurrent_state"]) <= 1e-5
    convs = [(a, b) for a, b in zip(*(e if isinstance(e, (tuple, list)) else (e,) for e in
                                      (mine[0]["conv_state"], theirs_entry["conv_state"]))) if a is not None]
    assert len(convs) == len(ours.FLA_CACHE.conv)
    for a, b in convs:
        assert a.shape == b.shape and rel_err(a, b) <= 1e-5


def test_wrong_cache_type_names_past_key_values():
    layer, x = _layer("gdn"), _input("gdn", T=4)
    for wrong in (object(), [None], torch.zeros(3)):
        with pytest.raises(ValueError, match="past_key_values"):
            layer(x, past_key_values=wrong)


def test_transformers_attention_cache_is_refused():
    """transformers' key/value caches have ``update`` too, but not fla's keywords."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    layer, x = _layer("gdn"), _input("gdn", T=4)
    with pytest.raises(ValueError, match="past_key_values.*DynamicCache"):
        layer(x, past_key_values=cache_utils.DynamicCache())


@pytest.mark.parametrize("make", [dict, LayerCache], ids=["dict", "LayerCache"])
@pytest.mark.parametrize("kind", KINDS)
def test_padded_and_packed_prefill_then_decode(kind, make):
    """A left-padded batch (generation's mask [B, past + T] every call) and packed sequences (one of
    them empty) prefill a cache, then decode token by token: each sequence as if alone (float64)."""
    layer = _layer(kind).double()
    D = LAYERS[kind][1]["hidden_size"]
    gen = generator()
    seqs = [torch.randn(1, n, D, dtype=torch.float64, generator=gen) for n in (7, 3, 0)]
    steps = torch.randn(3, 2, D, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        alone = []
        for s, step in zip(seqs, steps):
            first = layer(s, use_cache=True) if s.shape[1] else None
            outs, cache = ([first[0]], first[2]) if first else ([], {})
            for t in range(2):
                outs.append(layer(step[None, t:t + 1], past_key_values=cache, use_cache=True)[0])
            alone.append(torch.cat(outs, 1))
        # left padding: rows of 7 and 3 tokens (and a row of padding only: the empty sequence)
        x = torch.zeros(3, 7, D, dtype=torch.float64)
        mask = torch.zeros(3, 7, dtype=torch.long)
        for i, s in enumerate(seqs):
            if s.shape[1]:
                x[i, 7 - s.shape[1]:], mask[i, 7 - s.shape[1]:] = s[0], 1
        o, cache = layer(x, attention_mask=mask, past_key_values=make(), use_cache=True)[::2]
        assert o[mask == 0].abs().max() == 0
        got = [o[i, 7 - s.shape[1]:] for i, s in enumerate(seqs)]
        for t in range(2):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            o = layer(steps[:, t:t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)[0]
            got = [torch.cat([g, o[i]]) for i, g in enumerate(got)]
        for g, a in zip(got, alone):
            assert rel_err(g, a[0]) < 1e-12
        # packed: cu_seqlens [0, 7, 10, 10], the same three sequences, then a batch of 3 decodes
        o, cache = layer(torch.cat(seqs, 1), cu_seqlens=torch.tensor([0, 7, 10, 10]), past_key_values=make(),
                         use_cache=True)[::2]
        got = [o[0, :7], o[0, 7:10], o[0, 10:]]
        for t in range(2):
            o = layer(steps[:, t:t + 1], past_key_values=cache, use_cache=True)[0]
            got = [torch.cat([g, o[i]]) for i, g in enumerate(got)]
        for g, a in zip(got, alone):
            assert rel_err(g, a[0]) < 1e-12


def test_refusals_leave_the_cache_untouched():
    layer, x = _layer("gdn", layer_idx=None), _input("gdn", B=1, T=6)
    cache = LayerCache()
    with pytest.raises(ValueError, match="layer_idx"):
        layer(x, past_key_values=cache)
    layer.layer_idx = 0
    with pytest.raises(ValueError, match="attention_mask.*cu_seqlens"):
        layer(x, past_key_values=cache, cu_seqlens=torch.tensor([0, 2, 6]),
              attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, past_key_values=cache, attention_mask=torch.tensor([[1, 1, 1]]))
    with pytest.raises(ValueError, match="cu_seqlens.*batch size 1"):
        layer(_input("gdn", B=2, T=6), past_key_values=cache, cu_seqlens=torch.tensor([0, 2, 6]))
    assert len(cache) == 0


def test_conv_state_of_another_layer_is_refused():
    """An entry whose conv_state does not have the layer's convolutions (another layer's index)."""
    gdn = _layer("gdn")
    cache = ProtocolCache()
    cache.update(recurrent_state=None, conv_state=torch.zeros(3, 80, 4), layer_idx=0)   # Mamba-2's one conv, 3 rows
    with pytest.raises(ValueError, match="conv_state"):
        gdn(_input("gdn", T=3), past_key_values=cache)


def test_layer_cache_protocol():
    cache = LayerCache()
    with pytest.raises(KeyError):
        cache[0]
    cache.update(recurrent_state=torch.ones(2, 1), layer_idx=1, offset=5)
    assert len(cache) == 2 and cache[0] is None and cache.get_seq_length(1) == 5
    cache.update(conv_state=(torch.arange(2.0)[:, None],), layer_idx=1, offset=1)
    assert torch.equal(cache[1]["recurrent_state"], torch.ones(2, 1)) and cache.get_seq_length(1) == 6
    k = torch.arange(2 * 3.0).view(2, 3, 1)
    cache.update(attn_state=(k, k), layer_idx=0, cache_kwargs=dict(window_size=4))
    cache.update(attn_state=(k + 10, k + 10), layer_idx=0, cache_kwargs=dict(window_size=4))
    assert torch.equal(cache[0]["attn_state"][0], torch.cat([k, k + 10], 1)[:, -4:])
    cache.reorder_cache(torch.tensor([1, 1]))
    assert torch.equal(cache[1]["conv_state"][0], torch.tensor([[1.0], [1.0]]))


def test_layer_cache_batch_and_crop():
    """transformers' batch expansions (repeat_interleave, select) on every tensor; crop rolls back an
    attention-only entry and refuses a recurrent one (fla's rule), changing nothing then."""
    cache = LayerCache()
    state, conv = torch.arange(2.0).view(2, 1), (torch.arange(2.0).view(2, 1, 1), None)
    cache.update(recurrent_state=state, conv_state=conv, layer_idx=0, offset=3)
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache[0]["recurrent_state"], torch.tensor([[0.0], [0.0], [1.0], [1.0]]))
    assert cache[0]["conv_state"][0].shape == (4, 1, 1) and cache[0]["conv_state"][1] is None
    cache.batch_select_indices(torch.tensor([3]))
    assert torch.equal(cache[0]["recurrent_state"], torch.tensor([[1.0]]))
    with pytest.raises(NotImplementedError, match="layer 0 holds a recurrent state"):
        cache.crop(2)
    assert cache.get_seq_length(0) == 3
    cache.crop(5)   # past what it holds: nothing to forget
    assert cache.get_seq_length(0) == 3
    attn = LayerCache()
    k = torch.arange(5.0).view(1, 5, 1)
    attn.update(attn_state=(k, k), layer_idx=0, offset=5)
    attn.crop(-2)
    assert attn.get_seq_length(0) == 3 and torch.equal(attn[0]["attn_state"][0], k[:, :3])
    window = LayerCache()
    window.update(attn_state=(k, k), layer_idx=0, offset=5, cache_kwargs=dict(window_size=4))
    with pytest.raises(NotImplementedError, match="sliding window"):
        window.crop(2)
    attn.reset()
    assert len(attn) == 1 and attn[0] is None and attn.get_seq_length(0) == 0


def test_write_then_read_round_trips():
    """write_layer then read_layer gives back our dict (the convolutions' W columns, the token shift)."""
    layout = RWKV7Attention.FLA_CACHE
    ours = {"state": torch.randn(2, 4, 16, 16, generator=generator()),
            "shift": torch.randn(2, 1, 64, generator=generator())}
    cache = LayerCache()
    write_layer(cache, 3, layout, ours, T=1)
    back = read_layer(cache, 3, layout)
    assert all(torch.equal(back[k], ours[k]) for k in ours) and read_layer(cache, 0, layout) == {}
