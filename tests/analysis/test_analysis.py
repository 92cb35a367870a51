import torch

from fastweight.analysis.spectra import recurrence_eigenvalues
from fastweight.analysis import (accuracy_by_length, accuracy_by_width, layer_attention_maps, model_state_norms,
                                 recorded_recurrences, recurrence_attention_map, sample_spectra, sample_state_norms,
                                 state_norms)
from fastweight.dispatch import l2norm
from fastweight.mechanisms import get
from fastweight.models import LanguageModel, LMConfig
from fastweight.testing import generator, rel_err
from fastweight.theory import householder_eigenvalues


def test_spectra_match_the_closed_forms():
    ev = sample_spectra("deltanet", T=5, H=2, K=8, seed=1)  # [T, H, K]
    inputs = get("deltanet").sample(1, 5, 2, 8, 8, dtype=torch.float64, device="cpu", generator=generator(1))
    # l2norm leaves ||k|| = 1 - O(1e-6): the eigenvalue along k is 1 - beta ||k||^2
    want = householder_eigenvalues(inputs["beta"][0] * inputs["k"][0].norm(dim=-1) ** 2, 8)  # [T, H, K]
    assert rel_err(ev.real.sort(dim=-1).values, want) < 1e-10 and ev.imag.abs().max() < 1e-10
    ev = sample_spectra("rwkv7", T=8, K=8, seed=2)
    assert ev.imag.abs().max() < 1e-8 and ev.real.min() >= -1 and ev.real.max() < 1
    ev = sample_spectra("gla", T=4, K=8, seed=3)
    assert ev.real.min() > 0 and ev.real.max() < 1


def test_state_norms_over_time():
    mech = get("gla")
    inputs = mech.sample(2, 7, 2, 4, 3, dtype=torch.float64, device="cpu", generator=generator())
    norms = state_norms(mech, inputs)
    _, final = mech.recurrent(inputs, output_final_state=True)
    assert norms.shape == (2, 7, 2)
    assert rel_err(norms[:, -1], final.norm(dim=(-2, -1))) < 1e-12
    long = {m: sample_state_norms(m, T=1024, K=8, decay_factor=0.001, write_bias=0.5)[:, 0]
            for m in ("rwkv6", "rwkv7")}
    # RWKV-6 with slow decays piles coherent writes up; RWKV-7's delta term keeps its state bounded
    assert long["rwkv6"][-1] > 20 * long["rwkv7"][-1]
    assert long["rwkv6"][-1] > 1.5 * long["rwkv6"][511]
    assert long["rwkv7"][512:].max() < 1.5 * long["rwkv7"][256:512].max()


def test_attention_maps_of_model_layers_reproduce_their_outputs():
    torch.manual_seed(0)
    model = LanguageModel(LMConfig.preset("tiny", mixer="gdn,swa,rwkv7,mamba2,rwkv6,kda,hgrn2,longhorn",
                                          n_layers=8, vocab_size=32, d_model=32))
    ids = torch.randint(0, 32, (2, 63))
    with recorded_recurrences() as records:
        model(ids)
    assert [r.op for r in records] == ["gated_delta_rule", "rwkv7", "simple_gla", "rwkv6", "kda", "hgrn2", "longhorn"]
    for r in records:
        A = recurrence_attention_map(r)
        assert A.shape == (2, r.tensors["v"].shape[2], 63, 63)
        assert A.triu(1).abs().max() == 0
        o = torch.einsum("bhij,bjhv->bihv", A, r.tensors["v"].float())
        assert rel_err(o, r.output) < 1e-5, r.op
    maps = layer_attention_maps(model, ids)
    assert [layer for layer, _ in maps] == [0, 2, 3, 4, 5, 6, 7]
    norms = model_state_norms(model, ids, every=16)
    assert norms.shape == (4, 8) and torch.isnan(norms[:, 1]).all() and (norms[:, [0, 2, 3]] > 0).all()


def test_attention_map_of_a_deltaproduct_layer():
    """Gated DeltaProduct's tokens take n = 2 steps: its map is [T, 2T], causal by token, and A @ v
    (v at 2T rows) is the layer's recurrence output."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig.preset("tiny", mixer="gdp", n_layers=1, vocab_size=32, d_model=32))
    ids = torch.randint(0, 32, (2, 37))
    with recorded_recurrences() as records:
        model(ids)
    (r,) = records
    A = recurrence_attention_map(r)
    assert r.op == "gated_delta_product" and A.shape == (2, r.tensors["v"].shape[2], 37, 74)
    future = torch.arange(74)[None, :] > 2 * torch.arange(37)[:, None] + 1
    assert A[..., future].abs().max() == 0 and A[..., ~future].abs().max() > 0
    o = torch.einsum("bhij,bjhv->bihv", A, r.tensors["v"].float())
    assert rel_err(o, r.output) < 1e-5
    assert [layer for layer, _ in layer_attention_maps(model, ids)] == [0]


def test_accuracy_by_length():
    results = [dict(label="gdn", eval=[dict(task="s_niah_1:context_len=128,value_len=3", acc=0.5),
                                       dict(task="s_niah_1:context_len=64,value_len=3", acc=1.0),
                                       dict(task="mqar", acc=0.3)])]
    assert accuracy_by_length(results) == {"s_niah_1": {"gdn": [(64, 1.0), (128, 0.5)]}}


def test_accuracy_by_width_keeps_each_cells_best_rate():
    """Zoology's Fig. 2: per (length, mixer, width), the rate with the best mean over its seeds."""
    def run(mixer, d, T, lr, acc, group="zoology"):
        return dict(group=group, config=dict(mixer=mixer, d_model=d, lr=lr, task=f"mqar:seq_len={T},n_pairs=4"),
                    eval=[dict(task=f"mqar:seq_len={T},n_pairs=4", acc=acc)])
    results = [run("gdn", 128, 64, 1e-3, 0.75), run("gdn", 128, 64, 1e-3, 0.25), run("gdn", 128, 64, 1e-2, 0.4),
               run("gdn", 64, 64, 1e-2, 0.2), run("attn", 64, 128, 1e-3, 1.0), run("gdn", 64, 64, 1e-3, 1.0, "recall")]
    assert accuracy_by_width(results) == {64: {"gdn": [(64, 0.2, 0.2, 0.2), (128, 0.5, 0.25, 0.75)]},
                                          128: {"attn": [(64, 1.0, 1.0, 1.0)]}}


def test_eigenvalues_of_a_model_layer():
    torch.manual_seed(1)
    model = LanguageModel(LMConfig.preset("tiny", mixer="deltanet,rwkv7", n_layers=2, vocab_size=16, d_model=32,
                                          allow_neg_eigval=True))
    with recorded_recurrences() as records:
        model(torch.randint(0, 16, (2, 20)))
    delta, rwkv7 = records
    ev = recurrence_eigenvalues(delta)  # [B, T, H, K]
    k, beta = delta.tensors["k"], delta.tensors["beta"].double()
    if delta.tensors.get("use_qk_l2norm_in_kernel"):
        k = l2norm(k)
    k = k.double()
    want = householder_eigenvalues(beta * k.norm(dim=-1) ** 2, k.shape[-1])
    assert rel_err(ev.real.sort(dim=-1).values, want) < 1e-6 and ev.imag.abs().max() < 1e-6
    assert beta.max() > 1  # allow_neg_eigval reaches the layer: beta in (0, 2)
    ev = recurrence_eigenvalues(rwkv7)
    assert ev.imag.abs().max() < 1e-6 and ev.real.min() >= -1 and ev.real.max() < 1
