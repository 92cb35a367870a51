"""Checkpoints in and out of fla's format (flash-linear-attention 0.6.0's ``*ForCausalLM`` models).

    from fastweight.models.convert import load_fla, save_fla
    model = load_fla("path/to/fla-hub-folder")     # a LanguageModel with the same weights and logits
    save_fla(model, "path/to/out")                 # back to fla's config.json + model.safetensors

    fastweight convert SRC DST                      # an fla folder -> a fastweight (transformers) folder,
                                                    # or a fastweight folder -> fla's format
    fastweight convert SRC.pth DST                  # an official RWKV-7 .pth -> fastweight (convert_rwkv.py)

fla's models and ours have the same blocks (pre-norm mixer, pre-norm SwiGLU MLP, final RMSNorm, an
optionally tied head): the tensors are the same, only their names differ. The model-level names
(:data:`MODEL_NAMES`) are the same for every model; the mixer-level names are those of the fla
layer class (``fastweight.layers.fla_layers``, ``FLA_NAMES``), so a layer and a model convert alike.
:data:`FLA_MODELS` lists the models (by fla's ``model_type``): GatedDeltaNet, KDA, DeltaNet, GLA,
Mamba-2 (``backbone.*``, ``mamba_ssm``'s names; norm and mixer blocks without an MLP, as ours),
RWKV-7 (fla's ``RWKV7ForCausalLM`` is the official x070 form: ``LMConfig(rwkv7_official=True)``,
block 0's ``pre_norm`` the official ``ln0`` = our ``embed_norm``, ``ffn`` the channel mix; fla's
``g_norm`` eps ``head_dim * norm_eps`` as ``rwkv7_group_norm_eps`` where head_dim is not 64), Comba and
HGRN2 (fla's forms, ``LMConfig(fla_form=True)``; HGRN2's ``model.lower_bounds``). fla's hybrid
``attn`` layers are our ``attn`` / ``swa`` layers (:func:`_with_fla_attention`; their names are
ours, the layer class's ``FLA_NAMES`` do not apply to them). A config option that our model does
not implement (another MLP activation, attention specs that differ in heads or window, the layer
options the fla layer class refuses) raises an error that names it: a conversion is exact or
refused. fla's recurrent caches keep the state as ``[N, H, V, K]``
(``state_v_first``), ours as ``[N, H, K, V]``: :func:`state_from_fla` transposes one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass

import torch

from fastweight.layers import fla_layers
from fastweight.models.config import LMConfig
from fastweight.models.lm import LanguageModel

# fla's model-level names -> ours (the block index in between is kept); Mamba-2's are mamba_ssm's
MODEL_NAMES = {"model.embeddings.": "embed.", "model.norm.": "norm.", "lm_head.": "lm_head."}
BLOCK_NAMES = {"attn_norm.": "mixer_norm.", "attn.": "mixer.", "mlp_norm.": "mlp_norm.", "mlp.": "mlp."}
MAMBA_MODEL_NAMES = {"backbone.embeddings.": "embed.", "backbone.norm_f.": "norm.", "lm_head.": "lm_head."}
MAMBA_BLOCK_NAMES = {"norm.": "mixer_norm.", "mixer.": "mixer."}
# fla's RWKV7ForCausalLM: block 0's pre_norm is the official ln0 (our embed_norm), the ffn the channel mix
RWKV7_MODEL_NAMES = {"model.layers.0.pre_norm.": "embed_norm.", **MODEL_NAMES}
RWKV7_BLOCK_NAMES = {"attn_norm.": "mixer_norm.", "attn.": "mixer.", "ffn_norm.": "mlp_norm.",
                     "ffn.x_k": "mlp.mu_k", "ffn.": "mlp."}


@dataclass(frozen=True)
class FlaModel:
    """One of fla's model types: our mixer, the fla layer class that names its weights, fla's
    ``architectures`` entry, and the config fields that must keep their one supported value."""

    mixer: str
    layer: type
    architecture: str
    fixed: tuple = ()
    model_names: tuple = tuple(MODEL_NAMES.items())
    block_names: tuple = tuple(BLOCK_NAMES.items())
    layers: str = "model.layers."


_COMMON_FIXED = (("hidden_act", "swish"), ("attnres_block_size", None))
ATTENTION = ("attn", "swa")
FLA_MODELS = {
    "gated_deltanet": FlaModel("gdn", fla_layers.GatedDeltaNet, "GatedDeltaNetForCausalLM",
                               (("use_gate", True), ("use_short_conv", True))),
    "kda": FlaModel("kda", fla_layers.KimiDeltaAttention, "KDAForCausalLM", (("use_short_conv", True),)),
    "delta_net": FlaModel("deltanet", fla_layers.DeltaNet, "DeltaNetForCausalLM",
                          (("use_gate", False), ("use_short_conv", True), ("use_beta", True),
                           ("use_output_norm", True), ("qk_norm", "l2"), ("qk_activation", "silu"))),
    "gla": FlaModel("gla", fla_layers.GatedLinearAttention, "GLAForCausalLM",
                    (("num_kv_heads", None), ("feature_map", None), ("use_short_conv", False),
                     ("use_output_gate", True), ("clamp_min", None), ("elementwise_affine", True),
                     ("use_gk", True), ("use_gv", False), ("fuse_norm", True))),
    "mamba2": FlaModel("mamba2", fla_layers.Mamba2, "Mamba2ForCausalLM",
                       (("hidden_act", "silu"), ("n_groups", 1), ("use_bias", False), ("use_conv_bias", True),
                        ("D_has_hdim", False), ("rmsnorm", True), ("norm_before_gate", False),
                        ("dt_limit", (0.0, float("inf")))),
                       tuple(MAMBA_MODEL_NAMES.items()), tuple(MAMBA_BLOCK_NAMES.items()), "backbone.layers."),
    # fla's Comba and HGRN2 layers compute other forms than the LM's mixers: LMConfig(fla_form=True).
    # fla 0.6.0's CombaBlock passes only use_output_gate on: its layers take the defaults of
    # use_output_correction, use_inner_decay and correction_factor whatever the config says (as here)
    "comba": FlaModel("comba", fla_layers.Comba, "CombaForCausalLM", (("use_short_conv", True),
                                                                        ("use_output_gate", True))),
    "hgrn2": FlaModel("hgrn2", fla_layers.HGRN2Attention, "HGRN2ForCausalLM",
                      (("use_short_conv", False), ("elementwise_affine", True)),
                      (("model.lower_bounds", "lower_bounds"), *MODEL_NAMES.items())),
    # fla's RWKV-7 computes the official x070 form (LayerNorm blocks, ln0, the official time and
    # channel mixing): LMConfig(rwkv7_official=True), as convert_rwkv.py's .pth
    "rwkv7": FlaModel("rwkv7", fla_layers.RWKV7Attention, "RWKV7ForCausalLM",
                      (("hidden_act", "sqrelu"), ("norm_first", True), ("norm_bias", True)),
                      tuple(RWKV7_MODEL_NAMES.items()), tuple(RWKV7_BLOCK_NAMES.items())),
}
_MIXER_TO_TYPE = {spec.mixer: name for name, spec in FLA_MODELS.items()}


def fla_mlp_size(hidden_size: int, hidden_ratio: float | None = 4, intermediate_size: int | None = None) -> int:
    """fla's ``GatedMLP`` width: ``intermediate_size``, else 2/3 of ``hidden_ratio * hidden_size``
    rounded up to a multiple of 256."""
    if intermediate_size is not None:
        return intermediate_size
    width = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return 256 * ((width + 255) // 256)


def lm_config_from_fla(config: dict) -> LMConfig:
    """Our LMConfig for fla's ``config.json`` (a dict): the same sizes, heads, norms and options,
    and fla's hybrid ``attn`` layers as our ``attn`` / ``swa`` ones."""
    cfg = _lm_config_from_fla_mixer(config)
    attn = config.get("attn")
    return cfg if attn is None else _with_fla_attention(cfg, attn, config["model_type"])


def _with_fla_attention(cfg: LMConfig, attn, model_type: str) -> LMConfig:
    """fla's ``attn`` (one spec or a list: ``layers``, ``num_heads``, ``num_kv_heads``, ``qkv_bias``,
    ``window_size``, ``rope_theta``) as attention layers of the LM: ``attn`` where ``window_size`` is
    None, else ``swa`` (flash-attn's window (W - 1, 0) is our W keys, the token's own included);
    the specs must agree on the heads, the window and rope_theta (one each in LMConfig)."""
    if model_type in ("mamba2", "rwkv7"):
        raise NotImplementedError(f"fla {model_type}: hybrid attention layers (`attn`) are not supported by the "
                                  "conversion (the LM's attention blocks are the pre-norm SwiGLU ones)")
    mixers, seen = list(cfg.mixers), {}
    for spec in [attn] if isinstance(attn, dict) else attn:
        if spec.get("qkv_bias", False):
            raise NotImplementedError("fla attn: `qkv_bias=True` is not supported by the conversion (no biases)")
        values = dict(num_heads=spec["num_heads"], num_kv_heads=spec.get("num_kv_heads") or spec["num_heads"],
                      rope_theta=float(spec.get("rope_theta", 10000.0)))
        if spec.get("window_size") is not None:
            values["window_size"] = spec["window_size"]
        for name, value in values.items():
            if seen.setdefault(name, value) != value:
                raise NotImplementedError(f"fla attn: specs with different `{name}` ({seen[name]}, {value}) are "
                                          "not supported by the conversion (one value per model)")
        for i in spec["layers"]:
            mixers[i] = "attn" if spec.get("window_size") is None else "swa"
    H, KV = seen["num_heads"], seen["num_kv_heads"]
    return cfg.replace(mixer=",".join(mixers), attn_heads=None if H == cfg.n_heads else H,
                       n_kv_heads=None if KV == H else KV, rope_theta=seen["rope_theta"],
                       window_size=seen.get("window_size", cfg.window_size))


def _lm_config_from_fla_mixer(config: dict) -> LMConfig:
    """The LMConfig of fla's model with its own mixer in every layer."""
    model_type = config.get("model_type")
    if model_type not in FLA_MODELS:
        raise ValueError(f"fla model_type {model_type!r} is not supported; supported: {', '.join(FLA_MODELS)}")
    spec = FLA_MODELS[model_type]
    for name, ours in dict(_COMMON_FIXED + spec.fixed).items():
        value = _json_value(config.get(name, ours))
        if value != ours and not (name == "hidden_act" and {value, ours} == {"silu", "swish"}):
            raise NotImplementedError(f"fla {model_type}: `{name}={value!r}` is not supported by the conversion "
                                      f"(only {name}={ours!r})")
    D, H = config.get("hidden_size", 2048), config.get("num_heads")
    common = dict(vocab_size=config.get("vocab_size", 32000), d_model=D, n_layers=config["num_hidden_layers"],
                  tie_embeddings=config.get("tie_word_embeddings", False),
                  initializer_range=config.get("initializer_range", 0.02))
    if model_type == "rwkv7":
        return _lm_config_from_fla_rwkv7(config, common)
    if model_type == "hgrn2":
        return _lm_config_from_fla_hgrn2(config, common)
    if model_type == "mamba2":
        return LMConfig(**common, n_heads=1, mixer="mamba2", head_dim=config.get("state_size", 128),
                        mamba_expand=config.get("expand", 2), mamba_head_dim=config.get("head_dim", 64),
                        conv_size=config.get("conv_kernel", 4), norm_eps=config.get("norm_eps", 1e-5))
    if model_type in ("delta_net", "gla"):
        defaults = (1.0, 1.0) if model_type == "delta_net" else (0.5, 1.0)
        head_k, head_v = fla_layers._head_dims(model_type, D, config.get("expand_k", defaults[0]),
                                               config.get("expand_v", defaults[1]), H)
    else:
        head_k = config["head_dim"]
        head_v = head_k * config.get("expand_v", 2.0 if model_type in ("gated_deltanet", "comba") else 1.0)
    n_v_heads = config.get("num_v_heads")
    kda = _kda_options(config, head_k, head_v) if model_type == "kda" else {}
    return LMConfig(
        **common, **kda, n_heads=H, mixer=spec.mixer, head_dim=head_k, expand_v=head_v / head_k,
        n_v_heads=None if n_v_heads in (None, H) else n_v_heads, fla_form=model_type == "comba",
        allow_neg_eigval=config.get("allow_neg_eigval", False),
        use_short_conv=config.get("use_short_conv", model_type != "gla"), conv_size=config.get("conv_size", 4),
        intermediate_size=fla_mlp_size(D, config.get("hidden_ratio", 4), config.get("intermediate_size")),
        norm_eps=config.get("norm_eps", 1e-6))


def _lm_config_from_fla_hgrn2(config: dict, common: dict) -> LMConfig:
    """fla's HGRN2Config -> LMConfig(fla_form=True): heads of forget width expand_ratio (our head_dim)
    and input width hidden_size / num_heads, one resolved from the other as fla does."""
    D = common["d_model"]
    H, ratio = config.get("num_heads"), config.get("expand_ratio", 128)
    if H is None and ratio is None:
        raise ValueError("fla hgrn2: one of `num_heads` or `expand_ratio` must be given")
    H = D // ratio if H is None else H
    ratio = D // H if ratio is None else ratio
    bounds = config.get("use_lower_bound", True)
    if D % H or (bounds and H * ratio != D):
        raise NotImplementedError(f"fla hgrn2: `num_heads={H}`, `expand_ratio={ratio}` with hidden_size {D} are not "
                                  f"supported by the conversion (num_heads must divide hidden_size, and with "
                                  f"use_lower_bound num_heads * expand_ratio must be hidden_size)")
    return LMConfig(**common, n_heads=H, mixer="hgrn2", head_dim=ratio, expand_v=(D // H) / ratio, fla_form=True,
                    hgrn2_lower_bounds=bool(bounds), use_short_conv=False,
                    intermediate_size=fla_mlp_size(D, config.get("hidden_ratio", 4), config.get("intermediate_size")),
                    norm_eps=config.get("norm_eps", 1e-6))


def _kda_options(config: dict, head_k: int, head_v: float) -> dict:
    """fla's KDA options as LMConfig fields: its low-rank gate maps have rank head_v_dim
    (``kda_gate_rank``), ``lower_bound`` bounds its gate (``kda_lower_bound``); ``safe_gate`` only
    picks fla's kernel for gates in [lower_bound, 0) (the same function), checked as fla does."""
    bound, safe = config.get("lower_bound"), config.get("safe_gate", False)
    if bound is not None and not (isinstance(bound, (int, float)) and bound < 0):
        raise ValueError(f"fla kda: `lower_bound={bound!r}` must be a number < 0 (a log decay)")
    if safe and (bound is None or not -5 <= bound < 0):
        raise ValueError(f"fla kda: `safe_gate=True` needs `lower_bound` in [-5, 0), got {bound!r}")
    if head_v != int(head_v):
        raise ValueError(f"fla kda: `expand_v={config.get('expand_v')}` gives a non-integer head_v_dim {head_v}")
    return dict(kda_gate_rank=None if head_v == head_k else int(head_v),
                kda_lower_bound=None if bound is None else float(bound))


def _lm_config_from_fla_rwkv7(config: dict, common: dict) -> LMConfig:
    """fla's RWKV7Config -> LMConfig(rwkv7_official=True). fla's ``g_norm`` (the official ln_x) has
    eps ``head_dim * norm_eps``, the official code's 64e-5 whatever the head size: another head_dim
    sets ``rwkv7_group_norm_eps``."""
    D, L = common["d_model"], common["n_layers"]
    value_dim = _json_value(config.get("value_dim"))
    if value_dim not in (None, D, (D,) * L):
        raise NotImplementedError(f"fla rwkv7: `value_dim={value_dim!r}` is not supported by the conversion (only "
                                  f"value_dim=hidden_size)")
    K = config.get("head_dim", 64)
    K = K if K is not None else D // config["num_heads"]   # fla's rule, head_dim from num_heads
    H = D // K
    if D % K or config.get("num_heads") not in (None, H):
        raise NotImplementedError(f"fla rwkv7: `head_dim={K!r}` (num_heads {config.get('num_heads')}) is not supported "
                                  f"by the conversion (only head_dim * num_heads = hidden_size)")
    width = config.get("intermediate_size")
    if width is None:
        ratio = config.get("hidden_ratio", 4)
        width = 32 * ((int(D * (4 if ratio is None else ratio)) + 31) // 32)
    ranks = tuple(int(config.get(n, d)) for n, d in (("decay_low_rank_dim", 64), ("a_low_rank_dim", 64),
                                                      ("v_low_rank_dim", 16), ("gate_low_rank_dim", 128)))
    eps = config.get("norm_eps", 1e-5)
    return LMConfig(**common, n_heads=H, mixer="rwkv7", head_dim=K, rwkv7_official=True, rwkv7_ranks=ranks,
                    intermediate_size=None if width == 4 * D else width, norm_eps=eps,
                    rwkv7_group_norm_eps=None if K == 64 else K * eps)


def _json_value(value):
    """A config value as Python compares it: lists as tuples, transformers' ``{"__float__": "Infinity"}``
    as a float."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, list):
        return tuple(_json_value(v) for v in value)
    return value


def fla_config_from_lm(cfg: LMConfig) -> dict:
    """fla's ``config.json`` for our LMConfig: one of :data:`FLA_MODELS`' mixers, and attention
    layers (``attn``, ``swa``) as fla's hybrid ``attn`` specs."""
    linear = sorted({m for m in cfg.mixers if m not in ATTENTION})
    if len(linear) != 1 or linear[0] not in _MIXER_TO_TYPE:
        raise NotImplementedError(f"only models of one mixer among {sorted(_MIXER_TO_TYPE)} (with attn / swa "
                                  f"layers) convert to fla's format; this one has mixer {cfg.mixer!r}")
    out = _fla_config_from_lm_mixer(cfg, linear[0])
    specs = [dict(layers=[i for i, m in enumerate(cfg.mixers) if m == kind], num_heads=cfg.attention_heads,
                  num_kv_heads=cfg.n_kv_heads or cfg.attention_heads, qkv_bias=False,
                  window_size=cfg.window_size if kind == "swa" else None, rope_theta=cfg.rope_theta)
             for kind in ATTENTION if kind in cfg.mixers]
    if specs and out["model_type"] in ("mamba2", "rwkv7"):
        raise NotImplementedError(f"fla's {out['model_type']} models have no hybrid attention layers in the "
                                  f"conversion; this model has mixer {cfg.mixer!r}")
    if specs:
        out["attn"] = specs[0] if len(specs) == 1 else specs
    return out


def _fla_config_from_lm_mixer(cfg: LMConfig, mixer: str) -> dict:
    model_type = _MIXER_TO_TYPE[mixer]
    spec = FLA_MODELS[model_type]
    if not cfg.use_mlp and model_type != "mamba2":
        raise NotImplementedError(f"fla's {spec.architecture} has an MLP in every block; this model has "
                                  "use_mlp=False")
    if model_type == "gla" and cfg.gla_short_conv:
        raise NotImplementedError("fla's GatedLinearAttention with use_short_conv=True is not converted (its "
                                  "convolutions' names and cache); this model has gla_short_conv=True")
    if model_type == "rwkv7":
        if not cfg.rwkv7_official:
            raise NotImplementedError("the LM's own rwkv7 mixer (per-head RMSNorm, one LoRA rank) has no fla model; "
                                      "only LMConfig(rwkv7_official=True) converts to fla's RWKV7ForCausalLM")
        if not math.isclose(cfg.rwkv7_ln_x_eps, cfg.head_dim * cfg.norm_eps, rel_tol=1e-9):
            raise NotImplementedError(f"fla's RWKV-7 GroupNorm eps is head_dim * norm_eps "
                                      f"({cfg.head_dim * cfg.norm_eps}); this model's is {cfg.rwkv7_ln_x_eps} "
                                      f"(rwkv7_group_norm_eps)")
        fixed = dict(spec.fixed)
        w, a, v, g = cfg.rwkv7_lora_ranks
        return dict(model_type=model_type, architectures=[spec.architecture], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_heads=cfg.n_heads,
                    head_dim=cfg.head_dim,
                    intermediate_size=cfg.intermediate_size or 4 * cfg.d_model, norm_eps=cfg.norm_eps,
                    decay_low_rank_dim=w, a_low_rank_dim=a,
                    v_low_rank_dim=v, gate_low_rank_dim=g, tie_word_embeddings=cfg.tie_embeddings,
                    initializer_range=cfg.initializer_range, **fixed)
    if model_type in ("comba", "hgrn2") and not cfg.fla_form:
        raise NotImplementedError(f"the LM's own {mixer} mixer is not fla's form; only "
                                  f"LMConfig(fla_form=True) converts to fla's {spec.architecture}")
    if model_type == "comba" and (cfg.allow_neg_eigval or not cfg.use_short_conv):
        raise NotImplementedError("fla's Comba has no allow_neg_eigval and always short convolutions; this model "
                                  f"has allow_neg_eigval={cfg.allow_neg_eigval}, use_short_conv={cfg.use_short_conv}")
    if model_type == "hgrn2":
        return dict(model_type=model_type, architectures=[spec.architecture], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_heads=cfg.n_heads,
                    expand_ratio=cfg.head_dim, use_lower_bound=cfg.hgrn2_lower_bounds, intermediate_size=cfg.mlp_dim,
                    hidden_act="swish", norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                    initializer_range=cfg.initializer_range, **dict(spec.fixed))
    if model_type == "mamba2":
        if cfg.allow_neg_eigval:
            raise NotImplementedError("fla's Mamba2 has no allow_neg_eigval (a_t = 2 exp(dt A) - 1); this model has "
                                      "allow_neg_eigval=True")
        fixed = dict(spec.fixed, dt_limit=[0.0, {"__float__": "Infinity"}])
        return dict(model_type=model_type, architectures=[spec.architecture], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, state_size=cfg.head_dim,
                    expand=cfg.mamba_expand, head_dim=cfg.mamba_head_dim, conv_kernel=cfg.conv_size,
                    norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                    initializer_range=cfg.initializer_range, **fixed)
    out = dict(model_type=model_type, architectures=[spec.architecture], vocab_size=cfg.vocab_size,
               hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_heads=cfg.n_heads,
               intermediate_size=cfg.mlp_dim, hidden_act="swish", norm_eps=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.initializer_range,
               conv_size=cfg.conv_size, **dict(spec.fixed))
    out.pop("attn", None)
    if model_type in ("delta_net", "gla"):
        out.update(expand_k=cfg.n_heads * cfg.head_dim / cfg.d_model,
                   expand_v=cfg.n_heads * cfg.head_v_dim / cfg.d_model)
    else:
        out.update(head_dim=cfg.head_dim, expand_v=cfg.expand_v, num_v_heads=cfg.n_v_heads)
    if model_type == "kda":
        if (cfg.kda_gate_rank or cfg.head_dim) != cfg.head_v_dim:
            raise NotImplementedError(f"fla's KDA gate maps have rank head_dim * expand_v ({cfg.head_v_dim}); this "
                                      f"model's kda_gate_rank is {cfg.kda_gate_rank or cfg.head_dim}")
        out.update(lower_bound=cfg.kda_lower_bound, safe_gate=False)
    if model_type not in ("gla", "comba"):
        out.update(use_short_conv=cfg.use_short_conv, allow_neg_eigval=cfg.allow_neg_eigval)
    return out


def _rename(key: str, table: dict) -> str | None:
    for old, new in table.items():
        if key.startswith(old):
            return new + key[len(old):]
    return None


def state_dict_from_fla(state_dict: dict, config: dict) -> dict:
    """fla's model state dict (names as in its ``model.safetensors``) -> ours, the same tensors.

    A tied fla checkpoint that omits ``lm_head.weight`` gets the embedding under both names (as
    our tied model holds it); a name that fits neither table is a KeyError."""
    spec = FLA_MODELS[config["model_type"]]
    layer_names = {theirs: ours for ours, theirs in spec.layer.FLA_NAMES.items()}
    attention = {i for i, m in enumerate(lm_config_from_fla(config).mixers) if m in ATTENTION}
    block = re.compile(re.escape(spec.layers) + r"(\d+)\.(.*)")
    out = {}
    for key, t in state_dict.items():
        m = None if _rename(key, dict(spec.model_names)) else block.fullmatch(key)
        if m is None:
            new = _rename(key, dict(spec.model_names))
        else:
            rest = _rename(m.group(2), dict(spec.block_names))
            if rest is not None and rest.startswith("mixer.") and int(m.group(1)) not in attention:
                rest = "mixer." + (_rename(rest[6:], layer_names) or rest[6:])
            new = None if rest is None else f"blocks.{m.group(1)}.{rest}"
        if new is None:
            raise KeyError(f"fla checkpoint tensor {key!r} has no counterpart in fastweight's model")
        out[new] = t
    if "lm_head.weight" not in out and config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = out["embed.weight"]
    return out


def state_dict_to_fla(state_dict: dict, cfg: LMConfig) -> dict:
    """Our model state dict -> fla's names (the inverse of :func:`state_dict_from_fla`)."""
    spec = FLA_MODELS[fla_config_from_lm(cfg)["model_type"]]
    layer_names = spec.layer.FLA_NAMES
    model_names = {ours: theirs for theirs, ours in spec.model_names}
    block_names = {ours: theirs for theirs, ours in spec.block_names}
    out = {}
    for key, t in state_dict.items():
        m = re.fullmatch(r"blocks\.(\d+)\.(.*)", key)
        if m is None:
            new = _rename(key, model_names)
        else:
            rest = m.group(2)
            if rest.startswith("mixer.") and cfg.mixers[int(m.group(1))] not in ATTENTION:
                rest = "mixer." + (_rename(rest[6:], layer_names) or rest[6:])
            rest = _rename(rest, block_names)
            new = None if rest is None else f"{spec.layers}{m.group(1)}.{rest}"
        if new is None:
            raise KeyError(f"fastweight tensor {key!r} has no counterpart in fla's model")
        out[new] = t
    return out


def state_from_fla(state: torch.Tensor) -> torch.Tensor:
    """A recurrent state of fla's caches ``[N, H, V, K]`` as ours ``[N, H, K, V]`` (and back: the
    same transpose)."""
    return state.transpose(-1, -2)


def read_folder(path: str) -> tuple[dict, dict]:
    """``(config, state_dict)`` of a Hugging Face model folder: ``config.json`` and the weights
    (``model.safetensors``, sharded ``model-*.safetensors`` with their index, or ``pytorch_model.bin``)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        from safetensors.torch import load_file
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for name in files:
            state.update(load_file(os.path.join(path, name)))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        from safetensors.torch import load_file
        state = load_file(os.path.join(path, "model.safetensors"))
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no model.safetensors(.index.json) or pytorch_model.bin in {path}")
    return config, state


def from_fla(config: dict, state_dict: dict) -> LanguageModel:
    """Our LanguageModel holding an fla model's weights (strict: every tensor placed, none left)."""
    model = LanguageModel(lm_config_from_fla(config))
    model.load_state_dict(state_dict_from_fla(state_dict, config), strict=True)
    return model


def load_fla(path: str) -> LanguageModel:
    """Our LanguageModel from an fla hub folder (config.json + weights)."""
    return from_fla(*read_folder(path))


def save_fla(model: LanguageModel, path: str) -> None:
    """``model`` as an fla folder: fla's config.json and model.safetensors (a tied head is stored
    once, under the embedding's name, as transformers saves tied weights)."""
    from safetensors.torch import save_file
    config = fla_config_from_lm(model.cfg)
    state = state_dict_to_fla(model.state_dict(), model.cfg)
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})


def convert(src: str, dst: str) -> str:
    """Convert ``src`` into ``dst``: an fla folder or an official RWKV-7 ``.pth``
    (:mod:`fastweight.models.convert_rwkv`) into a fastweight folder (transformers'
    ``FastweightForCausalLM`` format), a fastweight folder into fla's (or, for an
    ``LMConfig(rwkv7_official=True)`` model, into an official ``.pth``). Returns the direction."""
    from fastweight.models import convert_rwkv
    from fastweight.models.hf import FastweightForCausalLM
    if os.path.isfile(src) and src.endswith(".pth"):
        model = convert_rwkv.load_rwkv7(src)
        hf = FastweightForCausalLM.from_language_model(model).to(next(model.parameters()).dtype)
        hf.save_pretrained(dst)
        return "RWKV-7 .pth -> fastweight"
    config, state = read_folder(src)
    if config.get("model_type") == "fastweight":
        model = FastweightForCausalLM.from_pretrained(src).model
        if model.cfg.rwkv7_official and dst.endswith(".pth"):
            convert_rwkv.save_rwkv7(model, dst)
            return "fastweight -> RWKV-7 .pth"
        save_fla(model, dst)
        return "fastweight -> fla"
    FastweightForCausalLM.from_language_model(from_fla(config, state)).save_pretrained(dst)
    return f"fla {config.get('model_type')} -> fastweight"


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("convert", help="checkpoints between fla's (or official RWKV-7's) format and "
                                   "fastweight's",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="a model folder: fla's (config.json model_type among "
                        f"{', '.join(FLA_MODELS)}) or fastweight's; or an official RWKV-7 .pth")
    parser.add_argument("dst", help="the output folder (a .pth file for a fastweight RWKV-7 of the official form)")
    parser.set_defaults(func=_run)
    return parser


def _run(args) -> int:
    print(f"{convert(args.src, args.dst)}: {args.src} -> {args.dst}")
    return 0


def main(argv=None) -> int:
    from fastweight.cli import run_subcommand
    return run_subcommand(register, "convert", argv)


if __name__ == "__main__":
    sys.exit(main())
