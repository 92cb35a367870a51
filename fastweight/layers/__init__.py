"""nn.Modules: the token mixers of every mechanism, and the parts they share.

``build_mixer(name, cfg)`` makes the mixer a model config names (``LMConfig.mixer``).
Every mixer follows the call convention of :mod:`fastweight.layers.base`.
"""

from fastweight.layers.attention import Attention
from fastweight.layers.base import Mixer
from fastweight.layers.common import GatedRMSNorm, LowRank, RMSNorm, ShortConv, SwiGLU, TokenShift
from fastweight.layers.delta import DeltaRuleMixer
from fastweight.layers.fla_layers import GatedDeltaNet, KimiDeltaAttention
from fastweight.layers.gated import DecayMixer, Mamba2Mixer
from fastweight.layers.linear_op import force_generic, linear_op, use_backend


def build_mixer(name: str, cfg) -> Mixer:
    """The token mixer called ``name`` (one of ``fastweight.models.config.MIXERS``)."""
    if name in ("deltanet", "gdn", "kda", "comba", "longhorn"):
        return DeltaRuleMixer(cfg, name)
    if name in ("la", "retnet", "gla", "hgrn2"):
        return DecayMixer(cfg, name)
    if name == "mamba2":
        return Mamba2Mixer(cfg)
    if name == "attn":
        return Attention(cfg)
    if name == "swa":
        return Attention(cfg, window=cfg.window_size)
    if name in ("rwkv6", "rwkv7"):
        from fastweight.layers.rwkv import RWKV6TimeMix, RWKV7TimeMix
        return (RWKV6TimeMix if name == "rwkv6" else RWKV7TimeMix)(cfg)
    raise ValueError(f"unknown mixer {name!r}")


__all__ = ["Attention", "DecayMixer", "DeltaRuleMixer", "GatedDeltaNet", "GatedRMSNorm", "KimiDeltaAttention",
           "LowRank", "Mamba2Mixer", "Mixer", "RMSNorm", "ShortConv", "SwiGLU", "TokenShift", "build_mixer", "force_generic", "linear_op", "use_backend"]
