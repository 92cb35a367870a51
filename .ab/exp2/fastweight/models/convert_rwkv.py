"""The official RWKV-7 checkpoints (``RWKV_x070`` ``.pth``, BlinkDL/RWKV-LM) in and out of our LM.

    from fastweight.models.convert_rwkv import load_rwkv7, save_rwkv7
    model = load_rwkv7("RWKV-x070-World-0.1B.pth")   # LMConfig(rwkv7_official=True), the same logits
    save_rwkv7(model, "out.pth")                      # back to the official names and shapes

    fastweight convert SRC.pth DST                    # -> a fastweight (transformers) folder
    fastweight convert SRC DST.pth                    # a fastweight folder of the official form -> .pth

The configuration comes from the tensors' shapes: ``emb`` (vocab, n_embd), the ``blocks.{i}``
(n_layer), ``att.r_k`` [H, head size], ``att.{w,a,v,g}1`` (the LoRA ranks; ``v1`` from block 1),
``ffn.key`` (the channel mix's width). Names: ``emb`` -> ``embed``, ``blocks.0.ln0`` ->
``embed_norm``, ``ln1``/``ln2`` -> ``mixer_norm``/``mlp_norm``, ``att.*`` -> the mixer
(``receptance``/``key``/``value``/``output`` -> ``{r,k,v,o}_proj``, ``ln_x`` -> ``g_norm``, the
LoRA ``c0, c1, c2`` -> ``c_lora.up.bias, down.weight^T, up.weight^T``), ``ffn.x_k`` ->
``mlp.mu_k``, ``ln_out`` -> ``norm``, ``head`` -> ``lm_head``. The load is strict: a tensor left
over or missing (another RWKV version's names: ``time_maa_*``, ``xx_*``) is an error. The LayerNorm
eps is the official 1e-5 and ``ln_x``'s 64e-5.
"""

from __future__ import annotations

import re

import torch

from fastweight.models.config import LMConfig
from fastweight.models.lm import LanguageModel

# official name in a block -> (ours, how: "" the same tensor, "T" transposed, "flat" [1, 1, C] -> [C])
BLOCK = {
    "ln1.weight": ("mixer_norm.weight", ""), "ln1.bias": ("mixer_norm.bias", ""),
    "ln2.weight": ("mlp_norm.weight", ""), "ln2.bias": ("mlp_norm.bias", ""),
    **{f"att.x_{c}": (f"mixer.x_{c}", "") for c in "rwkvag"},
    "att.k_k": ("mixer.k_k", "flat"), "att.k_a": ("mixer.k_a", "flat"), "att.r_k": ("mixer.r_k", ""),
    "att.receptance.weight": ("mixer.r_proj.weight", ""), "att.key.weight": ("mixer.k_proj.weight", ""),
    "att.value.weight": ("mixer.v_proj.weight", ""), "att.output.weight": ("mixer.o_proj.weight", ""),
    "att.ln_x.weight": ("mixer.g_norm.weight", ""), "att.ln_x.bias": ("mixer.g_norm.bias", ""),
    **{f"att.{c}0": (f"mixer.{c}_lora.up.bias", "flat") for c in "wav"},
    **{f"att.{c}1": (f"mixer.{c}_lora.down.weight", "T") for c in "wavg"},
    **{f"att.{c}2": (f"mixer.{c}_lora.up.weight", "T") for c in "wavg"},
    "ffn.x_k": ("mlp.mu_k", "flat"), "ffn.key.weight": ("mlp.key.weight", ""),
    "ffn.value.weight": ("mlp.value.weight", ""),
}
MODEL = {"emb.weight": "embed.weight", "blocks.0.ln0.weight": "embed_norm.weight",
         "blocks.0.ln0.bias": "embed_norm.bias", "ln_out.weight": "norm.weight", "ln_out.bias": "norm.bias",
         "head.weight": "lm_head.weight"}
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.*)")


def _get(state_dict: dict, key: str) -> torch.Tensor:
    if key not in state_dict:
        raise KeyError(f"RWKV-7 checkpoint: no tensor {key!r} (an RWKV_x070 .pth has emb, blocks.{{i}}.att.w1, "
                       f"..., ln_out, head)")
    return state_dict[key]


def lm_config_from_rwkv7(state_dict: dict) -> LMConfig:
    """Our LMConfig for an official RWKV-7 state dict, from its tensors' shapes."""
    vocab, C = _get(state_dict, "emb.weight").shape
    layers = sorted({int(m.group(1)) for m in map(_BLOCK_KEY.fullmatch, state_dict) if m})
    if not layers or layers != list(range(len(layers))):
        raise KeyError(f"RWKV-7 checkpoint: blocks {layers} are not 0..n_layer-1")
    r_k = _get(state_dict, "blocks.0.att.r_k")
    if r_k.ndim != 2 or r_k.numel() != C:
        raise ValueError(f"RWKV-7 checkpoint: att.r_k must be [n_head, head_size] with n_head * head_size = "
                         f"n_embd ({C}), got {tuple(r_k.shape)}")
    H, N = r_k.shape
    if tuple(_get(state_dict, "blocks.0.att.receptance.weight").shape) != (C, C):
        raise NotImplementedError("RWKV-7 checkpoint: dim_att != n_embd is not supported")
    ranks = []
    for c in "wavg":
        first = 1 if c == "v" else 0
        found = {int(_get(state_dict, f"blocks.{i}.att.{c}1").shape[1]) for i in layers[first:]}
        if len(found) > 1:
            raise NotImplementedError(f"RWKV-7 checkpoint: the {c} LoRA has ranks {sorted(found)} across layers "
                                      f"(one rank per gate is supported)")
        ranks.append(found.pop() if found else 32)   # a one-layer model has no v LoRA
    width = int(_get(state_dict, "blocks.0.ffn.key.weight").shape[0])
    return LMConfig(vocab_size=int(vocab), d_model=int(C), n_layers=len(layers), n_heads=int(H), mixer="rwkv7",
                    head_dim=int(N), rwkv7_official=True, rwkv7_ranks=tuple(ranks),
                    intermediate_size=None if width == 4 * C else width, norm_eps=1e-5, tie_embeddings=False)


def state_dict_from_rwkv7(state_dict: dict) -> dict:
    """The official names and shapes -> ours (the same values); a name that fits neither table is a KeyError."""
    out = {}
    for key, t in state_dict.items():
        m = _BLOCK_KEY.fullmatch(key)
        if key in MODEL:
            out[MODEL[key]] = t
        elif m is not None and m.group(2) in BLOCK:
            ours, how = BLOCK[m.group(2)]
            out[f"blocks.{m.group(1)}.{ours}"] = t.t() if how == "T" else t.reshape(-1) if how == "flat" else t
        else:
            raise KeyError(f"RWKV-7 checkpoint tensor {key!r} has no counterpart in fastweight's model")
    return out


def state_dict_to_rwkv7(state_dict: dict, cfg: LMConfig) -> dict:
    """Our names and shapes -> the official ones (the inverse of :func:`state_dict_from_rwkv7`)."""
    if not cfg.rwkv7_official:
        raise NotImplementedError("only an LMConfig(rwkv7_official=True) model converts to the official RWKV-7")
    if not cfg.use_mlp:
        raise NotImplementedError("the official RWKV-7 has a channel mix in every block; this model has use_mlp=False")
    model = {ours: theirs for theirs, ours in MODEL.items()}
    block = {ours: (theirs, how) for theirs, (ours, how) in BLOCK.items()}
    out = {}
    for key, t in state_dict.items():
        m = _BLOCK_KEY.fullmatch(key)
        if key in model:
            out[model[key]] = t
        elif m is not None and m.group(2) in block:
            theirs, how = block[m.group(2)]
            out[f"blocks.{m.group(1)}.{theirs}"] = t.t() if how == "T" else t.view(1, 1, -1) if how == "flat" else t
        else:
            raise KeyError(f"fastweight tensor {key!r} has no counterpart in the official RWKV-7")
    return out


def from_rwkv7(state_dict: dict) -> LanguageModel:
    """Our LanguageModel holding an official RWKV-7 model's weights (strict: every tensor placed, none
    left), in the checkpoint's dtype when all its tensors share one."""
    model = LanguageModel(lm_config_from_rwkv7(state_dict))
    model.load_state_dict(state_dict_from_rwkv7(state_dict), strict=True)
    dtypes = {t.dtype for t in state_dict.values()}
    if len(dtypes) == 1 and next(iter(dtypes)).is_floating_point:
        model.to(next(iter(dtypes)))
    return model


def load_rwkv7(path: str) -> LanguageModel:
    """Our LanguageModel from an official ``.pth`` (``torch.load``, tensors only)."""
    return from_rwkv7(torch.load(path, map_location="cpu", weights_only=True))


def save_rwkv7(model: LanguageModel, path: str) -> None:
    """``model`` (of the official form) as an official ``.pth``."""
    state = state_dict_to_rwkv7(model.state_dict(), model.cfg)
    torch.save({k: v.contiguous() for k, v in state.items()}, path)
