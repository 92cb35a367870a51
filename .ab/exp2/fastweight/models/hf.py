"""Hugging Face ``transformers`` integration (optional dependency: ``pip install fastweight[hf]``).

    from fastweight.models.hf import FastweightConfig, FastweightForCausalLM   # registers the Auto classes
    model = FastweightForCausalLM(FastweightConfig(mixer="gdn,swa", vocab_size=64, d_model=64, n_layers=2, n_heads=2))
    model.save_pretrained(path)                              # config.json + model.safetensors
    model = AutoModelForCausalLM.from_pretrained(path)
    model.generate(input_ids, max_new_tokens=8)              # prefill, then decode from the recurrent cache

``FastweightConfig`` holds the fields of :class:`fastweight.models.LMConfig`;
``FastweightForCausalLM`` wraps one :class:`fastweight.models.LanguageModel` (``.model``), so a
plain model converts either way with ``from_language_model`` / ``.model``. Generation passes
the model's own :class:`fastweight.models.Cache` between steps (fixed size for linear
mixers); left padding is not supported (an ``attention_mask`` with zeros is refused).
``from_pretrained`` loads strictly: weights that do not fill the model of the ``config.json``
exactly (another mixer, another number of layers, another width) raise a ValueError listing the
keys (``strict=False``: transformers' behaviour, the missing tensors initialised as in a new model).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput, generic

from fastweight import checks
from fastweight.models.config import LMConfig
from fastweight.layers import RMSNorm
from fastweight.models.lm import Block, Cache, LanguageModel

FIELDS = tuple(f.name for f in dataclasses.fields(LMConfig))
# transformers >= 5.x (late) names the generation cache `cache`; earlier versions `past_key_values`
CACHE_KEY = "cache" if hasattr(generic, "_rename_kwargs_for_bc") else "past_key_values"


# transformers' standard names for our fields: accepted by the constructor and readable as attributes
STANDARD_NAMES = {"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                  "num_key_value_heads": "n_kv_heads", "rms_norm_eps": "norm_eps", "sliding_window": "window_size",
                  "head_dim": "head_dim"}
# what PretrainedConfig itself (and generation) takes; anything else that is not ours is refused
_BASE = set(PretrainedConfig().__dict__) | set(PretrainedConfig().to_dict()) | {
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "tie_word_embeddings", "torch_dtype", "num_labels", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "max_length", "output_attentions", "name_or_path", "attn_implementation",
    "pruned_heads", "is_decoder", "add_cross_attention", "auto_map", "use_bfloat16", "tf_legacy_loss",
    "max_position_embeddings"}


class FastweightConfig(PretrainedConfig):
    """The fields of :class:`LMConfig` (same names, same defaults) as a ``PretrainedConfig``.

    transformers' standard names work as well, in the constructor and as attributes
    (``hidden_size`` = ``d_model``, ``num_hidden_layers`` = ``n_layers``, ``num_attention_heads`` =
    ``n_heads``, ``num_key_value_heads`` = ``n_kv_heads``, ``rms_norm_eps`` = ``norm_eps``,
    ``sliding_window`` = ``window_size``); an argument that is neither ours nor one that
    ``PretrainedConfig`` takes is a TypeError, never silently kept."""

    model_type = "fastweight"
    attribute_map = {k: v for k, v in STANDARD_NAMES.items() if k != v}

    def __init__(self, **kwargs):
        for std, own in self.attribute_map.items():
            if std in kwargs:
                if own in kwargs and kwargs[own] != kwargs[std]:
                    raise ValueError(f"FastweightConfig: `{std}` and `{own}` name the same field; got {kwargs[std]!r} "
                                     f"and {kwargs[own]!r}")
                kwargs[own] = kwargs.pop(std)
        unknown = [n for n in kwargs if n not in FIELDS and n not in _BASE and not n.startswith("_")]
        if unknown:
            raise TypeError(f"FastweightConfig: unknown argument(s) {unknown}; the model's fields are "
                            f"{', '.join(FIELDS)} (or transformers' names {', '.join(self.attribute_map)})")
        defaults = {f.name: f.default for f in dataclasses.fields(LMConfig)}
        own = {name: kwargs.pop(name, defaults[name]) for name in FIELDS}
        lm = LMConfig(**own)  # validates, resolves head_dim
        for name in FIELDS:
            setattr(self, name, getattr(lm, name))
        kwargs.setdefault("tie_word_embeddings", lm.tie_embeddings)
        super().__init__(**kwargs)

    def to_lm_config(self) -> LMConfig:
        return LMConfig(**{name: getattr(self, name) for name in FIELDS})

    @classmethod
    def from_lm_config(cls, cfg: LMConfig, **kwargs) -> "FastweightConfig":
        return cls(**cfg.to_dict(), **kwargs)


@dataclass
class FastweightCausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None


@dataclass
class LegacyCausalLMOutput(ModelOutput):
    """The same for transformers versions that call the cache ``past_key_values``."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: Cache | None = None


OUTPUT = FastweightCausalLMOutput if CACHE_KEY == "cache" else LegacyCausalLMOutput


class FastweightCache(Cache):
    """The model's cache with the methods ``generate`` calls on a cache."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.select(beam_idx)

    def __len__(self) -> int:
        return len(self.layers)


class FastweightForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FastweightConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _is_stateful = True
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
    _supports_cache_class = False

    def __init__(self, config: FastweightConfig):
        super().__init__(config)
        self.model = LanguageModel(config.to_lm_config())
        # The LanguageModel initialised itself: marked, its tensors are skipped by post_init's
        # initialize_weights. The mark goes after it, as transformers would take a marked tensor
        # for one loaded from a checkpoint.
        tensors = list(self.model.parameters())
        for t in tensors:
            t._is_hf_initialized = True
        self.post_init()
        for t in tensors:
            del t._is_hf_initialized

    @classmethod
    def from_language_model(cls, model: LanguageModel) -> "FastweightForCausalLM":
        hf = cls(FastweightConfig.from_lm_config(model.cfg))
        hf.model.load_state_dict(model.state_dict())
        return hf

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialise the tensors of ``module`` that are not yet (transformers calls it for those a
        checkpoint did not fill, and for new embeddings when resizing) as the LanguageModel does:
        in a block, every such tensor of the block takes its value in a new ``Block`` of the same
        mixer (the layer's constructor, then the LanguageModel's init of its Linear layers);
        outside, normal(``initializer_range``) for Embedding and Linear weights, zero biases, ones
        for the RMSNorm weight. Each tensor set is marked ``_is_hf_initialized``."""
        def todo(tensors):
            return [(name, t) for name, t in tensors if t is not None and not getattr(t, "_is_hf_initialized", False)]

        block = next((b for b in self.model.blocks if any(m is module for m in b.modules())), None)
        if block is not None:
            # the whole block from one new block (built once, whichever of its modules comes first)
            tensors = todo(block.named_parameters())
            if tensors:
                with torch.device("cpu"):
                    fresh = Block(self.model.cfg, block.mixer_name, block.layer_idx)
                fresh.apply(self.model._init_weights)
                for name, t in tensors:
                    t.copy_(fresh.get_parameter(name))
        else:
            tensors = todo(module.named_parameters(recurse=False))
            if isinstance(module, (nn.Embedding, nn.Linear)):
                for name, t in tensors:
                    nn.init.zeros_(t) if name == "bias" else nn.init.normal_(t, std=self.model.cfg.initializer_range)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                for name, t in tensors:
                    nn.init.zeros_(t) if name == "bias" else nn.init.ones_(t)
            elif tensors:
                raise TypeError(f"no initialisation for the tensors {[name for name, _ in tensors]} of a "
                                f"{type(module).__name__} outside the model's blocks")
        for _, t in tensors:
            t._is_hf_initialized = True

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def new_cache(self) -> FastweightCache:
        return FastweightCache(len(self.model.blocks))

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, attention_mask: torch.Tensor | None = None,
                past_key_values: Cache | None = None, return_dict: bool | None = None, logits_to_keep: int = 0,
                **kwargs):
        """Logits (and the LM loss when ``labels`` is given, shifted inside). With ``use_cache``
        the returned ``cache`` continues the sequence."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("`attention_mask` with zeros (padding) is not supported by fastweight models; "
                             "pass sequences of equal length or pack them")
        cache = cache if isinstance(cache, Cache) else past_key_values if isinstance(past_key_values, Cache) else None
        if cache is None and use_cache:
            cache = self.new_cache()
        logits = self.model(input_ids, cache=cache, logits_to_keep=logits_to_keep if labels is None else 0)
        loss = None
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
                raise ValueError(f"`labels` must have the shape of `input_ids` {tuple(input_ids.shape)}, got "
                                 f"{tuple(getattr(labels, 'shape', ())) or type(labels).__name__}")
            checks.check_token_ids("labels", labels[labels != -100], self.model.cfg.vocab_size)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                     labels[:, 1:].flatten(), ignore_index=-100)
        return OUTPUT(loss=loss, logits=logits, **{CACHE_KEY: cache})

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, use_cache=True,
                                      attention_mask=None, **kwargs):
        cache = cache if isinstance(cache, Cache) else past_key_values if isinstance(past_key_values, Cache) else None
        if cache is not None and cache.seen > 0:
            input_ids = input_ids[:, cache.seen:]
        return {"input_ids": input_ids, "cache": cache, "use_cache": use_cache, "attention_mask": attention_mask}

    def _reorder_cache(self, cache, beam_idx):
        cache.select(beam_idx)
        return cache

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, strict: bool = True, **kwargs):
        """As ``PreTrainedModel.from_pretrained``, with two checks. A ``config`` that differs from
        the checkpoint's own in any model field is refused with a ValueError naming the fields.
        With ``strict`` (the default) the weights must be exactly the model's: missing, unexpected
        or (unless ``ignore_mismatched_sizes``) mismatched keys raise a ValueError listing them.
        ``strict=False`` loads as transformers does: a warning, and the missing or mismatched
        tensors initialised as in a new model (``_init_weights``). A folder of one of fla's models
        (``fastweight.models.convert.FLA_MODELS``) is converted on the way in."""
        saved = os.path.join(str(pretrained_model_name_or_path), "config.json")
        if config is None and os.path.isfile(saved):
            from fastweight.models.convert import FLA_MODELS, load_fla
            with open(saved) as f:
                if json.load(f).get("model_type") in FLA_MODELS:
                    return cls.from_language_model(load_fla(str(pretrained_model_name_or_path)))
        if isinstance(config, FastweightConfig):
            if os.path.isfile(saved):
                with open(saved) as f:
                    stored = json.load(f)
                diff = [f"{n}: checkpoint {stored[n]!r}, config {getattr(config, n)!r}" for n in FIELDS
                        if n in stored and stored[n] != getattr(config, n)]
                if diff:
                    raise ValueError(f"the config does not match the checkpoint at {pretrained_model_name_or_path}: "
                                     + "; ".join(diff))
        if not strict:
            return super().from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        # transformers raises on mismatched shapes without naming them; take them in the report instead
        ignore_sizes = kwargs.pop("ignore_mismatched_sizes", False)
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, config=config,
                                              ignore_mismatched_sizes=True, output_loading_info=True, **kwargs)
        mismatched = [] if ignore_sizes else sorted(
            f"{key} (checkpoint {tuple(saved_shape)}, model {tuple(model_shape)})"
            for key, saved_shape, model_shape in info["mismatched_keys"])
        problems = [(what, keys) for what, keys in (("missing", sorted(info["missing_keys"])),
                                                     ("unexpected", sorted(info["unexpected_keys"])),
                                                     ("mismatched", mismatched)) if keys]
        if problems:
            cfg = model.model.cfg
            raise ValueError(
                f"the weights at {pretrained_model_name_or_path} do not match the model of its config "
                f"(mixer {cfg.mixer!r}, n_layers {cfg.n_layers}, d_model {cfg.d_model}): "
                + "; ".join(f"{len(keys)} {what} key(s): {', '.join(keys[:20])}" + (", ..." if len(keys) > 20 else "")
                            for what, keys in problems)
                + ". Fix the config.json, or pass strict=False to load them anyway (missing tensors newly initialised)")
        return (model, info) if output_loading_info else model


def register() -> None:
    """Register with AutoConfig / AutoModelForCausalLM (done on import; safe to call twice)."""
    try:
        AutoConfig.register("fastweight", FastweightConfig)
    except ValueError:
        pass
    try:
        AutoModelForCausalLM.register(FastweightConfig, FastweightForCausalLM)
    except ValueError:
        pass


register()
