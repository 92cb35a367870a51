"""The delta-rule layers, one skeleton (the seed's Fig. 1, Gated DeltaNet) with flags:

    q, k: Linear -> ShortConv -> SiLU -> L2 norm        v: Linear -> ShortConv -> SiLU
    beta = sigmoid(W_b x)   (2 * sigmoid with allow_neg_eigval: eigenvalues in (-1, 1])
    decay (GDN: one per head; KDA: one per key channel), Mamba-2's parameterisation:
        g = -exp(A_log) * softplus(W_a x + dt_bias)  <= 0
    o = recurrence(q, k, v, g, beta);   y = W_o (RMSNorm(o) * act(W_g x))

q and k have ``n_heads`` heads; v, beta, the decay, the state and the output gate have
``cfg.v_heads`` (grouped value heads, ``LMConfig.n_v_heads``: value head j reads key head
j // (n_v_heads / n_heads), as fla and Qwen3-Next group them).

Each mixer of this layer (``Mixer.layer == "delta"`` in its mechanism file) sets the options:

| option    | values                                                                                 |
|-----------|----------------------------------------------------------------------------------------|
| decay     | None; ``"head"``: exp(g) (I - beta k k^T) S (GDN); ``"channel"``: (I - beta k k^T) Diag(exp g) S (KDA, low-rank g) |
| gate      | the output gate: None, ``"silu"``, ``"sigmoid"``                                          |
| read_key  | the prediction error read with its own key p = d_h k, d_h = sigmoid of a per-head parameter in (0, 1) (Comba) |
| implicit  | the implicit (proximal) step on the delta rule's loss, eps = beta / (1 + beta k^T k) (Longhorn) |
| diagonal_step | with ``implicit``: Diag(1 - eps k * k) S + eps k v^T, the diagonal of k k^T (released Longhorn code) |
| num_householder | n delta steps a token (Gated DeltaProduct): k, v, beta projected n times as wide, passed as fla's T*n rows (token t's n at t*n ...) |

KDA's low-rank maps have rank ``LMConfig.kda_gate_rank`` (None: head_dim); with
``LMConfig.kda_lower_bound`` its gate is fla's bounded one, formed here (never in the kernel).
An implicit step's key is not normalised: ``1 - eps k^T k = 1 / (1 + beta k^T k)`` keeps the
transition stable for any key (``allow_neg_eigval`` does not apply to it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastweight.dispatch import l2norm
from fastweight.layers.base import Mixer, split_heads
from fastweight.layers.common import GatedRMSNorm, LowRank, ShortConv, at_least_fp32, mamba_decay_init
from fastweight.layers.linear_op import generic_forced
from fastweight.mechanisms import MIXERS, OPS


class DeltaRuleMixer(Mixer):
    """Gated DeltaNet (Fig. 1) and its relatives, by ``variant`` (see the module docstring)."""

    def __init__(self, cfg, variant: str = "gdn"):
        super().__init__()
        mixer = MIXERS[variant]
        spec = {"decay": None, "gate": None, "read_key": False, "implicit": False, "diagonal_step": False,
                "num_householder": 1, **mixer.options}
        self.variant, self.op, self.decay = variant, mixer.op, spec["decay"]
        # Gated DeltaProduct's steps a token: the config's, for the mixer that takes several
        n = spec["num_householder"]
        self.num_householder = n = cfg.num_householder if cfg.num_householder is not None and n > 1 else n
        self.implicit, self.read_key = spec["implicit"], spec["read_key"]
        self.diagonal_step = spec["diagonal_step"]
        self.gate_in_kernel = OPS[mixer.op].gate_in_kernel
        self.recurrent_threshold = cfg.recurrent_threshold
        self.allow_neg_eigval = cfg.allow_neg_eigval and not self.implicit
        D, H, HV, K, V = cfg.d_model, cfg.n_heads, cfg.v_heads, cfg.head_dim, cfg.head_v_dim
        self.n_heads, self.n_v_heads, self.head_k, self.head_v = H, HV, K, V
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, n * H * K, bias=False)
        self.v_proj = nn.Linear(D, n * HV * V, bias=False)
        self.b_proj = nn.Linear(D, n * HV, bias=False)
        conv = cfg.conv_size if cfg.use_short_conv else 1
        self.q_conv = ShortConv(H * K, conv, "silu")
        self.k_conv = ShortConv(n * H * K, conv, "silu")
        self.v_conv = ShortConv(n * HV * V, conv, "silu")
        if self.decay == "head":
            self.a_proj = nn.Linear(D, HV, bias=False)
            self.A_log, self.dt_bias = mamba_decay_init(HV, a_range=(0, 16))   # Gated DeltaNet's (fla's) range
        elif self.decay == "channel":
            rank = cfg.kda_gate_rank or K
            self.f_proj = LowRank(D, rank, HV * K, activation=None)
            self.A_log, _ = mamba_decay_init(HV)
            _, self.dt_bias = mamba_decay_init(HV * K)
        self.lower_bound = cfg.kda_lower_bound if self.decay == "channel" else None
        if self.read_key:
            self.d_logit = nn.Parameter(torch.zeros(H))
        self.g_proj = None
        if spec["gate"] == "silu":
            self.g_proj = nn.Linear(D, HV * V, bias=False)
        elif spec["gate"] == "sigmoid":
            self.g_proj = LowRank(D, cfg.kda_gate_rank or K, HV * V, activation=None, bias=True)
        self.o_norm = GatedRMSNorm(V, cfg.norm_eps, spec["gate"] or "identity")
        self.o_proj = nn.Linear(HV * V, D, bias=False)

    def gates(self, x: torch.Tensor, in_kernel: bool = False) -> dict:
        """beta [B, T, HV] and the log decay g ([B, T, HV] per head, [B, T, HV, K] per channel).

        ``in_kernel``: g is the gate's pre-activation ``W_a x`` and the op forms the decay from it
        with ``A_log``, ``dt_bias`` (``use_gate_in_kernel``: no elementwise passes here, in either
        direction)."""
        beta = torch.sigmoid(self.b_proj(x))  # rounded to v's dtype for the op in any case
        if self.allow_neg_eigval:
            beta = 2 * beta
        out = dict(beta=beta)
        if self.op == "gated_delta_product":   # [B, T, n * HV] -> fla's [B, T*n, HV]
            out.update(beta=beta.reshape(beta.shape[0], -1, self.n_v_heads), num_householder=self.num_householder)
        if self.decay is not None and in_kernel:
            pre = self.a_proj(x) if self.decay == "head" else split_heads(self.f_proj(x), self.n_v_heads)
            out.update(g=pre, A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True)
        elif self.decay == "head":
            out["g"] = -at_least_fp32(self.A_log).exp() * F.softplus(at_least_fp32(self.a_proj(x)) + self.dt_bias)
        elif self.decay == "channel" and self.lower_bound is not None:
            # fla's KDA lower_bound: lower_bound * sigmoid(exp(A_log) (f + dt_bias)), in [lower_bound, 0]
            f = split_heads(at_least_fp32(self.f_proj(x)) + self.dt_bias, self.n_v_heads)
            out["g"] = self.lower_bound * torch.sigmoid(at_least_fp32(self.A_log).exp()[:, None] * f)
        elif self.decay == "channel":
            f = split_heads(at_least_fp32(self.f_proj(x)) + self.dt_bias, self.n_v_heads)
            out["g"] = -at_least_fp32(self.A_log).exp()[:, None] * F.softplus(f)
        return out

    def forward(self, x: torch.Tensor, cache: dict | None = None, shared: dict | None = None) -> torch.Tensor:
        H, HV = self.n_heads, self.n_v_heads
        q = split_heads(self.conv(self.q_conv, self.q_proj(x), cache, "conv_q", shared), H)
        # k, v: [B, T, n * H * K] -> [B, T*n, H, K] (n = num_householder rows a token; n = 1: heads)
        k = split_heads(self.conv(self.k_conv, self.k_proj(x), cache, "conv_k", shared), H * self.num_householder)
        v = split_heads(self.conv(self.v_conv, self.v_proj(x), cache, "conv_v", shared), HV * self.num_householder)
        k, v = k.reshape(k.shape[0], -1, H, k.shape[-1]), v.reshape(v.shape[0], -1, HV, v.shape[-1])
        # the chunk ops of GDN and KDA form the gate in the kernel (the decode ops take the decay)
        in_kernel = (self.gate_in_kernel and self.lower_bound is None and self.mode(x.shape[1]) == "chunk"
                     and not generic_forced())
        extra = {name: t.to(v.dtype) if name == "beta" else t for name, t in self.gates(x, in_kernel).items()}
        if self.implicit:
            q = l2norm(q)
        elif not self.read_key:   # the op normalises q and k (in its kernel where it can); p is made from k here
            extra["use_qk_l2norm_in_kernel"] = True
        else:
            q, k = l2norm(q), l2norm(k)
        if self.read_key:
            extra["p"] = k * torch.sigmoid(self.d_logit).to(k.dtype)[:, None]
        if self.allow_neg_eigval:
            extra["allow_neg_eigval"] = True
        if self.diagonal_step:
            extra["diagonal_step"] = True
        o = self.recur(self.op, cache, shared, scale=self.head_k ** -0.5, q=q, k=k, v=v, **extra)
        gate = None if self.g_proj is None else split_heads(self.g_proj(x), HV)
        return self.o_proj(self.o_norm(o, gate).flatten(-2))
