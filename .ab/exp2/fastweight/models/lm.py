"""One language model for every mixer and any hybrid pattern of them.

    h_0 = Embed(ids)
    h <- h + Mixer_l(RMSNorm(h))         (the mixer of layer l from cfg.mixers)
    h <- h + MLP_l(RMSNorm(h))           (SwiGLU; RWKV's channel mixing after RWKV layers;
                                          none after Mamba-2, whose block is the mixer alone)
    logits = RMSNorm(h) Embed^T          (tied embeddings)

``LMConfig(rwkv7_official=True)`` is the official RWKV-7 (``RWKV_x070``): LayerNorm for every
RMSNorm, h_0 = LayerNorm(Embed(ids)) (the official ``ln0``), the official time mixing
(``fastweight.layers.fla_layers.RWKV7OfficialTimeMix``) and channel mix. ``LMConfig(fla_form=True)``
builds fla's forms of the comba and hgrn2 layers (``fastweight.layers.fla_forms``; with
``hgrn2_lower_bounds``, fla's per-layer forget-gate lower bounds ``lower_bounds``).

Generation keeps a :class:`Cache`: per layer the recurrent state, the short-conv inputs,
the token-shift input and the attention keys/values (a window of W for SWA). For every
linear mixer its size does not depend on the number of tokens seen.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fastweight import checks
from fastweight.layers import RMSNorm, SwiGLU, build_mixer
from fastweight.layers.base import sequence_positions
from fastweight.layers.fla_forms import FLA_FORMS
from fastweight.models.config import LMConfig


class Cache:
    """The decode state of every layer (a dict per layer, filled by the layers) and the number
    of tokens seen."""

    def __init__(self, n_layers: int):
        self.layers = [dict() for _ in range(n_layers)]
        self.seen = 0

    def nbytes(self) -> int:
        """Memory held, in bytes."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values()
                   if isinstance(t, torch.Tensor))

    def select(self, index: torch.Tensor) -> None:
        """Keep (and reorder) the batch rows ``index`` of every tensor (beam search)."""
        for layer in self.layers:
            for name, t in layer.items():
                if isinstance(t, torch.Tensor):
                    layer[name] = t.index_select(0, index.to(t.device))


def build_norm(cfg: LMConfig) -> nn.Module:
    """The model's norm: RMSNorm, or LayerNorm for the official RWKV-7 (``cfg.rwkv7_official``)."""
    return nn.LayerNorm(cfg.d_model, cfg.norm_eps) if cfg.rwkv7_official else RMSNorm(cfg.d_model, cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: LMConfig, mixer: str, layer_idx: int | None = None):
        super().__init__()
        self.mixer_name, self.layer_idx = mixer, layer_idx
        self.mixer_norm = build_norm(cfg)
        self.mlp_norm = self.mlp = None
        if cfg.rwkv7_official:
            from fastweight.layers.fla_layers import RWKV7OfficialTimeMix
            from fastweight.layers.rwkv import ChannelMix
            self.mixer = RWKV7OfficialTimeMix(cfg, layer_idx)
            if cfg.use_mlp:
                self.mlp_norm, self.mlp = build_norm(cfg), ChannelMix(cfg, width=cfg.intermediate_size)
            return
        if cfg.fla_form and mixer in FLA_FORMS:   # fla's Comba / HGRN2 (fla_forms.py)
            self.mixer = FLA_FORMS[mixer](cfg, layer_idx=layer_idx)
        else:
            self.mixer = build_mixer(mixer, cfg)
        if not cfg.use_mlp:
            return
        if mixer in ("rwkv6", "rwkv7"):
            from fastweight.layers.rwkv import ChannelMix
            self.mlp_norm, self.mlp = RMSNorm(cfg.d_model, cfg.norm_eps), ChannelMix(cfg, receptance=mixer == "rwkv6")
        elif mixer != "mamba2":
            self.mlp_norm, self.mlp = RMSNorm(cfg.d_model, cfg.norm_eps), SwiGLU(cfg.d_model, cfg.mlp_dim)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), cache, shared)
        if self.mlp is not None:
            x = x + self.mlp(self.mlp_norm(x), cache, shared)
        return x


class LanguageModel(nn.Module):
    """A causal LM: ``model(input_ids [B, T]) -> logits [B, T, vocab]``; see the module docstring."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        if not isinstance(cfg, LMConfig):
            raise TypeError(f"`cfg` must be an LMConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_norm = build_norm(cfg) if cfg.rwkv7_official else None
        self.blocks = nn.ModuleList(Block(cfg, m, i) for i, m in enumerate(cfg.mixers))
        self.norm = build_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # fla's HGRN2: the forget gates' lower bounds, one row per layer (cfg.hgrn2_lower_bounds)
        self.lower_bounds = nn.Parameter(torch.zeros(cfg.n_layers, cfg.d_model)) if cfg.hgrn2_lower_bounds else None
        self.apply(self._init_weights)
        for i, block in enumerate(self.blocks):
            for module in block.modules():
                # a mechanism's own initial parameters, which depend on the layer's depth (RWKV-7's)
                if hasattr(module, "reset_layer_parameters"):
                    module.reset_layer_parameters(i, cfg.n_layers)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def new_cache(self) -> Cache:
        return Cache(len(self.blocks))

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None, logits_to_keep: int = 0,
                cu_seqlens: torch.Tensor | None = None, context_parallel=None) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` (only the last ``logits_to_keep`` positions when > 0). With
        ``cache`` the tokens continue the cached sequence and the cache is updated in place.
        ``cu_seqlens`` (int64 ``[N+1]``, B = 1, no cache) packs N sequences along T: each is
        computed as if alone (recurrences, convolutions, token shift, attention, positions).
        ``context_parallel`` (a torch.distributed process group, or True for the world): each
        rank's ``input_ids`` are its run of the same B sequences (rank order; no cache, no
        ``cu_seqlens``), and the logits are what one process would give for those tokens
        (``fastweight.context_parallel``; linear mixers only)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"`input_ids` must be an int64 tensor [B, T], got "
                            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"`input_ids` must have shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        checks.check_token_ids("input_ids", input_ids, self.cfg.vocab_size)
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"`logits_to_keep` must be an int >= 0 (0: every position), got {logits_to_keep!r}")
        if cache is not None and len(cache.layers) != len(self.blocks):
            raise ValueError(f"`cache` has {len(cache.layers)} layers, the model {len(self.blocks)}")
        shared = {"offset": 0 if cache is None else cache.seen}
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("`cu_seqlens` (packed sequences) cannot be combined with a `cache`")
            checks.check_cu_seqlens(cu_seqlens, input_ids.shape[0], input_ids.shape[1])
            shared.update(cu_seqlens=cu_seqlens,
                          positions=sequence_positions(cu_seqlens, input_ids.shape[1], cu_seqlens.device))
        if context_parallel is not None and context_parallel is not False:
            if cache is not None or cu_seqlens is not None:
                raise ValueError("`context_parallel` cannot be combined with a `cache` or `cu_seqlens`")
            from fastweight.context_parallel import ContextGroup
            ctx = ContextGroup(None if context_parallel is True else context_parallel)
            shared.update(context_parallel=ctx, offset=ctx.start(input_ids.shape[1]))
        x = self.embed(input_ids)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        bounds = None
        if self.lower_bounds is not None:   # fla's HGRN2: lb_l = cumsum_l(softmax over layers) - softmax_0
            p = self.lower_bounds.softmax(0, dtype=torch.float32)
            bounds = p.cumsum(0) - p[0]
        for i, block in enumerate(self.blocks):
            if bounds is not None:
                shared["lower_bound"] = bounds[i]
            x = block(x, None if cache is None else cache.layers[i], shared)
        if cache is not None:
            cache.seen += input_ids.shape[1]
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_k: int | None = None, eos_token_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Prefill the prompt, then decode one token at a time from the cache.

        Greedy when ``temperature == 0``, else sampling from softmax(logits / temperature)
        (restricted to the ``top_k`` largest). Returns ``[B, T + new]`` (stops early once every
        row has produced ``eos_token_id``).
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"`max_new_tokens` must be an int >= 0, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"`temperature` must be a number >= 0, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"`top_k` must be None or an int >= 1, got {top_k!r}")
        was_training = self.training
        self.eval()
        try:
            cache = self.new_cache()
            logits = self(input_ids, cache=cache, logits_to_keep=1)
            out, done = [input_ids], torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            for step in range(max_new_tokens):
                token = sample_next(logits[:, -1], temperature, top_k, generator)
                out.append(token[:, None])
                if eos_token_id is not None:
                    done |= token == eos_token_id
                    if bool(done.all()):
                        break
                if step + 1 < max_new_tokens:
                    logits = self(token[:, None], cache=cache)
            return torch.cat(out, dim=1)
        finally:
            self.train(was_training)

    @torch.no_grad()
    def mixer_states(self, input_ids: torch.Tensor) -> list:
        """The final recurrent state of every layer after reading ``input_ids`` (``[B, H, K, V]``
        fp32; None for attention layers)."""
        was_training = self.training
        self.eval()
        try:
            cache = self.new_cache()
            self(input_ids, cache=cache)
            return [layer.get("state") for layer in cache.layers]
        finally:
            self.train(was_training)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [B] from logits [B, vocab]: argmax, or a sample at ``temperature``."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
