"""transformers' own Gated DeltaNet and KDA models on fastweight's ops (fastweight.models.transformers_kernels):
tiny random-init models of Qwen3-Next, Qwen3.5, OLMo-Hybrid and Kimi-Linear, fp32 on the CPU, against
transformers' PyTorch path: logits, greedy generation (prefill then decode from their cache), gradients.
The PyTorch path whether or not fla is installed (``torch_path``)."""

import importlib
import inspect
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastweight.models.transformers_kernels import TARGETS, function_of, use_fastweight_kernels  # noqa: E402
from fastweight.testing import rel_err  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
           layer_types=["linear_attention", "full_attention"])


def configs():
    out = {}
    if hasattr(transformers, "Qwen3NextConfig"):
        out["qwen3_next"] = lambda: transformers.Qwen3NextConfig(
            **SMALL, **GDN, head_dim=32, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2)
    if hasattr(transformers, "Qwen3_5TextConfig"):
        out["qwen3_5"] = lambda: transformers.Qwen3_5TextConfig(**SMALL, **GDN, head_dim=32)
    if hasattr(transformers, "OlmoHybridConfig"):
        out["olmo_hybrid"] = lambda: transformers.OlmoHybridConfig(**SMALL, **GDN, linear_allow_neg_eigval=True)
    if hasattr(transformers, "KimiLinearConfig"):
        out["kimi_linear"] = lambda: transformers.KimiLinearConfig(
            **SMALL, linear_num_heads=2, linear_head_dim=16, layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "dense"], moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    return out


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The recurrences of the models' modules bound as transformers binds them without fla.

    transformers binds them when a modeling module is imported, to fla's op where ``import fla`` succeeds
    (``hub_kernels.use_kernel_func_from_hub_with_fallback(<fla's name>, "fla")``); fla's kernels do not run on
    a CPU. So each is bound again by the same decorator around its PyTorch function (``__wrapped__``; with the
    ``kernels`` package the binding is an ``nn.Module`` around it, ``function_of``), with ``import fla``
    failing: transformers' own fallback wrapper, as on a machine without fla.
    """
    from transformers.integrations import hub_kernels
    if not hasattr(hub_kernels, "use_kernel_func_from_hub_with_fallback"):
        return   # a transformers from before this binding: nothing to rebind
    rebound = []
    for module_name, names in TARGETS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an older transformers without this model
            continue
        rebound += [(module, name, fla_name) for name, fla_name in names.items() if fla_name is not None]
    with monkeypatch.context() as without_fla:
        without_fla.setitem(sys.modules, "fla", None)
        fallback = [hub_kernels.use_kernel_func_from_hub_with_fallback(fla_name, "fla")(
            inspect.unwrap(function_of(getattr(module, name)))) for module, name, fla_name in rebound]
    for (module, name, _), fn in zip(rebound, fallback):
        monkeypatch.setattr(module, name, fn)


def model(name):
    torch.manual_seed(0)
    cfg = configs()[name]()
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # random init leaves some gates near zero: a log decay of a few per token tests more of the recurrence
    for p in m.parameters():
        p.data.copy_(torch.randn_like(p) * 0.2 if p.dim() >= 1 else p)
    return m


@pytest.mark.parametrize("name", sorted(configs()))
def test_logits_generation_and_gradients_match_transformers(name):
    m = model(name)
    x = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(1))  # two chunks, the second partial
    out = m(x, labels=x)
    out.loss.backward()
    want_grad = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    with use_fastweight_kernels() as patch:
        assert f"transformers.models.{name}.modeling_{name}" in patch.modules
        got = m(x, labels=x)
        got.loss.backward()
    assert rel_err(got.logits, out.logits) <= 1e-5
    for n, g in want_grad.items():
        assert rel_err(dict(m.named_parameters())[n].grad, g) <= 1e-4, n
    with torch.no_grad():
        want = m.generate(x[:, :9], max_new_tokens=6, do_sample=False)
        with use_fastweight_kernels():
            tokens = m.generate(x[:, :9], max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, want)


def test_patch_is_reversible_and_checked():
    import importlib
    mod = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    before = mod.torch_chunk_gated_delta_rule
    patch = use_fastweight_kernels(["qwen3_next"])
    assert mod.torch_chunk_gated_delta_rule is not before and patch.modules == [mod.__name__]
    patch.undo()
    assert mod.torch_chunk_gated_delta_rule is before
    with pytest.raises(ValueError, match="unknown model"):
        use_fastweight_kernels(["qwen9"])


@pytest.mark.parametrize("name", sorted(configs()))
def test_packed_batch_matches_its_sequences_alone(name):
    """A packed batch as transformers' DataCollatorWithFlattening gives it (B = 1, position_ids
    restarting per sequence, cu_seq_lens_q/k; no cache): the same logits and gradients as each
    sequence alone (an empty-free mix of 5, 70 (two chunks), 1 and 12 tokens). transformers' own
    path refuses it for GDN without fla, and for Kimi-Linear convolves across the boundaries."""
    m = model(name).train()
    lengths = [5, 70, 1, 12]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 64, (1, L), generator=g) for L in lengths]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    w = torch.randn(1, sum(lengths), 64, generator=g)
    with use_fastweight_kernels():
        alone = torch.cat([m(s, use_cache=False).logits for s in seqs], 1)
        (alone * w).sum().backward()
        want = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad()
        packed = m(torch.cat(seqs, 1), use_cache=False, position_ids=torch.cat([torch.arange(L) for L in lengths])[None],
                   cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)).logits
        (packed * w).sum().backward()
    # measured (fp32): logits <= 6.4e-7
    assert rel_err(packed, alone) <= 1e-5
    for n, grad in want.items():
        assert rel_err(dict(m.named_parameters())[n].grad, grad) <= 1e-4, n
