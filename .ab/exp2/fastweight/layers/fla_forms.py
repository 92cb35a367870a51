"""fla 0.6.0's forms of the Comba and HGRN2 mixers, in fastweight's mixer convention
(``forward(x, cache, shared)``, built from an ``LMConfig``).

``fla_layers.Comba`` and ``fla_layers.HGRN2Attention`` (their docstrings write the formulas) put
fla's arguments and call convention around these; ``LMConfig(fla_form=True)`` builds them for the
LM's ``comba`` and ``hgrn2`` layers, the blocks of fla's ``CombaForCausalLM`` and
``HGRN2ForCausalLM`` (``fastweight.models.convert``). The LM's own ``comba`` and ``hgrn2`` mixers
are other forms (``docs/models.md``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight.dispatch import l2norm
from fastweight.layers.base import split_heads
from fastweight.layers.common import GatedRMSNorm, RMSNorm, at_least_fp32
from fastweight.layers.delta import DeltaRuleMixer
from fastweight.layers.gated import DecayMixer


class CombaFlaMixer(DeltaRuleMixer):
    """Comba in fla's form: the read key p = sigmoid(decay) k and the output correction q - D p made
    from the raw key, then q, k and p L2-normalised (as fla's kernel does), a sigmoid output gate.
    fla's model builds its layers with the defaults here (its ``CombaBlock`` passes only
    ``use_output_gate`` on)."""

    def __init__(self, cfg, variant: str = "comba", layer_idx: int | None = None):
        super().__init__(cfg, variant)
        self.layer_idx = layer_idx
        del self.d_logit
        self.set_options(cfg.norm_eps)

    def set_options(self, norm_eps: float, use_output_gate: bool = True, use_output_correction: bool = True,
                    use_inner_decay: bool = True, correction_factor: float = 1.0) -> None:
        """fla's Comba options: the parameters ``decay`` (here ``inner_decay``) and ``D`` per key head,
        the output gate."""
        H = self.n_heads
        self.inner_decay = nn.Parameter(torch.ones(H)) if use_inner_decay else None
        self.D = nn.Parameter(torch.full((H,), float(correction_factor))) if use_output_correction else None
        if not use_output_gate:
            self.g_proj = None
        self.o_norm = GatedRMSNorm(self.head_v, norm_eps, "sigmoid" if use_output_gate else "identity")

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        H, HV = self.n_heads, self.n_v_heads
        q = split_heads(self.conv(self.q_conv, self.q_proj(x), cache, "conv_q", shared), H)
        k = split_heads(self.conv(self.k_conv, self.k_proj(x), cache, "conv_k", shared), H)
        v = split_heads(self.conv(self.v_conv, self.v_proj(x), cache, "conv_v", shared), HV)
        p = k if self.inner_decay is None else k * torch.sigmoid(self.inner_decay).to(k.dtype)[:, None]
        if self.D is not None:
            q = q - self.D.to(q.dtype)[:, None] * p
        extra = {n: t.to(v.dtype) if n == "beta" else t for n, t in self.gates(x).items()}
        q, k, p = l2norm(q), l2norm(k), l2norm(p)
        o = self.recur("comba", cache, shared, scale=self.head_k ** -0.5, q=q, k=k, v=v, p=p, **extra)
        gate = None if self.g_proj is None else split_heads(self.g_proj(x), HV)
        return self.o_proj(self.o_norm(o, gate).flatten(-2))


HGRN2_NORM_EPS = 1e-5


class HGRN2FlaMixer(DecayMixer):
    """HGRN2 in fla's form: q scaled by head_dim^-1/2 (fla's expand_ratio), one RMSNorm over all
    heads jointly (eps 1e-5), and HGRN's forget-gate lower bound ``shared["lower_bound"]`` ([d_model] in [0, 1),
    layers after the first): alpha = lb + (1 - lb) sigmoid(f)."""

    def __init__(self, cfg, variant: str = "hgrn2", layer_idx: int | None = None):
        super().__init__(cfg, variant)
        self.layer_idx = layer_idx
        # fla's layer applies its g_norm through rms_norm_linear at that function's default eps, 1e-5,
        # whatever its norm_eps (which only its unused g_norm.eps holds)
        self.o_norm = RMSNorm(cfg.n_heads * cfg.head_v_dim, HGRN2_NORM_EPS)

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        H = self.n_heads
        g = F.logsigmoid(at_least_fp32(self.k_proj(x)))
        lower_bound = None if shared is None else shared.get("lower_bound")
        if lower_bound is not None and self.layer_idx:
            # alpha = lb + (1 - lb) sigmoid(f), in log space
            g = torch.logaddexp(lower_bound.log(), torch.log1p(-lower_bound) + g)
        o = self.recur("hgrn2", cache, shared, scale=self.head_k ** -0.5, q=split_heads(F.silu(self.q_proj(x)), H),
                       v=split_heads(self.v_proj(x), H), g=split_heads(g, H))
        return self.o_proj(self.o_norm(o.flatten(-2)))


# the LM's mixers with an fla form (LMConfig.fla_form)
FLA_FORMS = {"comba": CombaFlaMixer, "hgrn2": HGRN2FlaMixer}
