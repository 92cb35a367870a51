"""nn.Modules: the token mixers of every mechanism, and the parts they share.

``build_mixer(name, cfg)`` makes the mixer a model config names (``LMConfig.mixer``).
Every mixer follows the call convention of :mod:`fastweight.layers.base`.
"""

from fastweight.layers.attention import Attention
from fastweight.layers.base import Mixer
from fastweight.layers.common import GatedRMSNorm, LowRank, RMSNorm, ShortConv, SwiGLU, TokenShift
from fastweight.layers.delta import DeltaRuleMixer
from fastweight.layers.fla_layers import (Comba, DeltaNet, GatedDeltaNet, GatedLinearAttention, HGRN2Attention,
                                         KimiDeltaAttention, Mamba2, RWKV7Attention)
from fastweight.layers.fla_layers_decay import HGRNAttention, LinearAttention, MultiScaleRetention, RWKV6Attention
from fastweight.layers.fla_layers_delta import GatedDeltaProduct
from fastweight.layers.gated import DecayMixer, Mamba2Mixer
from fastweight.layers.linear_op import force_generic, linear_op, use_backend
from fastweight.mechanisms import MIXERS


def build_mixer(name: str, cfg) -> Mixer:
    """The token mixer called ``name`` (one of ``fastweight.models.config.MIXERS``): attention, or
    the layer class its mechanism file names (``fastweight.mechanisms.MIXERS``)."""
    if name == "attn":
        return Attention(cfg)
    if name == "swa":
        return Attention(cfg, window=cfg.window_size)
    spec = MIXERS.get(name)
    if spec is None:
        raise ValueError(f"unknown mixer {name!r}")
    if spec.layer == "delta":
        return DeltaRuleMixer(cfg, name)
    if spec.layer == "decay":
        return DecayMixer(cfg, name)
    if spec.layer == "mamba2":
        return Mamba2Mixer(cfg)
    from fastweight.layers.rwkv import RWKV6TimeMix, RWKV7TimeMix
    return {"rwkv6": RWKV6TimeMix, "rwkv7": RWKV7TimeMix}[spec.layer](cfg)


__all__ = ["Attention", "Comba", "DecayMixer", "DeltaNet", "DeltaRuleMixer", "GatedDeltaNet", "GatedDeltaProduct", "GatedLinearAttention", "GatedRMSNorm", "HGRN2Attention", "HGRNAttention",
           "KimiDeltaAttention",
           "LinearAttention", "LowRank", "Mamba2", "Mamba2Mixer", "Mixer", "MultiScaleRetention", "RMSNorm", "RWKV6Attention", "RWKV7Attention", "ShortConv", "SwiGLU", "TokenShift", "build_mixer", "force_generic", "linear_op", "use_backend"]
