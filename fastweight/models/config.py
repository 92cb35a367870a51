"""The language model's configuration: a frozen dataclass and a table of named presets.

``mixer`` is a comma-separated pattern of token mixers that repeats to ``n_layers``:
``"gdn"`` (all Gated DeltaNet), ``"gdn,swa"`` (Gated DeltaNet-H1: GDN and sliding-window
attention alternating), ``"mamba2,gdn,swa"`` (H2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastweight.mechanisms import MIXERS as MIXER_SPECS

# the linear mixers (each declared by its mechanism file), then softmax attention and its sliding window
MIXERS = (*MIXER_SPECS, "attn", "swa")


@dataclass(frozen=True)
class LMConfig:
    """Every field of the model. ``head_dim`` is the key dim per head of the linear mixers (and
    Mamba-2's state size); values have ``expand_v * head_dim`` per head; attention heads have
    ``d_model // n_heads``. ``n_v_heads``: the delta-rule mixers' value heads (grouped value
    attention, as Qwen3-Next's Gated DeltaNet: ``n_v_heads / n_heads`` value heads share each
    query/key head, each with its own state, beta, decay and output gate); None = ``n_heads``.

    ``rwkv7_official``: the official RWKV-7 (``RWKV_x070``, BlinkDL/RWKV-LM) architecture, with
    ``mixer="rwkv7"`` in every layer: LayerNorm (eps ``norm_eps``) in place of every RMSNorm, one
    more LayerNorm on the embeddings (the official ``ln0``), the official time mixing
    (``fastweight.layers.fla_layers.RWKV7Attention``'s computation: a GroupNorm ``ln_x`` per head
    with eps ``64 * norm_eps``, the official 64e-5 at 1e-5, and ``rwkv7_ranks`` = the LoRA ranks
    of w, a, v, g; None: the official suggestions from ``d_model``) and the channel mix of width
    ``intermediate_size`` (None: ``4 * d_model``). ``rwkv7_group_norm_eps``: that GroupNorm's eps
    (None: ``64 * norm_eps``; fla's RWKV-7 uses ``head_dim * norm_eps``, the same at head_dim 64).

    ``allow_neg_eigval`` (Grazzi et al. 2024): transitions with eigenvalues in [-1, 1], on the layers
    that have that form: the delta rules' beta in (0, 2) (all but Longhorn and fla-form Comba) and
    Mamba-2's a_t = 2 exp(dt A) - 1; a hybrid's other layers keep theirs; with no such layer, refused.

    ``kda_gate_rank``: the rank of the ``kda`` mixer's low-rank maps (its decay ``f_proj`` and output
    gate ``g_proj``); None: ``head_dim`` (fla's KDA: ``head_dim * expand_v``, the same at expand_v 1).
    ``kda_lower_bound``: fla's KDA ``lower_bound`` (< 0): the ``kda`` mixer's log decay becomes
    ``lower_bound * sigmoid(exp(A_log) (W_f x + dt_bias))``, in [lower_bound, 0], in place of
    ``-exp(A_log) softplus(W_f x + dt_bias)``; None: the latter.

    ``fla_form``: the ``comba`` and ``hgrn2`` layers compute fla 0.6.0's forms
    (``fastweight.layers.fla_forms``), the blocks of fla's ``CombaForCausalLM`` / ``HGRN2ForCausalLM``:
    Comba's read key and output correction from the raw key with a sigmoid output gate; HGRN2's
    q scale head_dim^-1/2 and one RMSNorm over all heads. ``hgrn2_lower_bounds`` (with ``fla_form``):
    fla's HGRN2 forget-gate lower bounds (its ``use_lower_bound``), a parameter ``lower_bounds``
    [n_layers, d_model]; layer l > 0 takes lb_l = cumsum_l(softmax over layers) - softmax_0.

    ``gla_short_conv``: the ``gla`` mixer's q, k, v each through a short convolution (width
    ``conv_size``, then SiLU), fla's GLA ``use_short_conv=True``; off by default, as in fla. Without
    it GLA has no local token mixing: on MQAR it stays near 11% where it reaches 99.98% with it
    (``docs/results/published.md``).

    ``attn_heads``: the heads of the attention layers (``attn``, ``swa``), None: ``n_heads`` (fla's
    hybrid models give their attention layers their own count).

    ``num_householder``: the ``gdp`` mixer's delta steps a token (Gated DeltaProduct's n_h, each with
    its own key, value and beta); None: its default, 2.

    ``use_mlp``: False leaves out every block's MLP (the SwiGLU, RWKV's channel mix), so a block is
    its mixer alone, as in Zoology's MQAR models (``state_mixer: Identity``); Mamba-2 blocks have
    none either way."""

    vocab_size: int = 32000
    d_model: int = 1024
    n_layers: int = 24
    n_heads: int = 8
    mixer: str = "gdn"
    head_dim: int | None = None
    expand_v: float = 1.0
    allow_neg_eigval: bool = False
    use_short_conv: bool = True
    conv_size: int = 4
    window_size: int = 2048
    n_kv_heads: int | None = None
    n_v_heads: int | None = None
    intermediate_size: int | None = None
    mamba_expand: int = 2
    mamba_head_dim: int = 64
    lora_rank: int = 32
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    initializer_range: float = 0.02
    recurrent_threshold: int = 64
    rwkv7_official: bool = False
    rwkv7_ranks: tuple | None = None
    kda_gate_rank: int | None = None
    kda_lower_bound: float | None = None
    fla_form: bool = False
    hgrn2_lower_bounds: bool = False
    attn_heads: int | None = None
    rwkv7_group_norm_eps: float | None = None
    num_householder: int | None = None
    use_mlp: bool = True
    gla_short_conv: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "conv_size", "window_size",
                     "mamba_expand", "mamba_head_dim", "lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {value!r}")
        for name in ("head_dim", "n_kv_heads", "n_v_heads", "intermediate_size", "kda_gate_rank", "attn_heads",
                     "num_householder"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"LMConfig.{name} must be None or a positive int, got {value!r}")
        if not isinstance(self.recurrent_threshold, int) or self.recurrent_threshold < 0:
            raise ValueError(f"LMConfig.recurrent_threshold must be an int >= 0, got {self.recurrent_threshold!r}")
        for name in ("expand_v", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LMConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.mixer, str) or not self.mixer.strip():
            raise ValueError(f"LMConfig.mixer must be a comma-separated pattern of {MIXERS}, got {self.mixer!r}")
        unknown = [m for m in self.pattern if m not in MIXERS]
        if unknown:
            raise ValueError(f"LMConfig.mixer: unknown mixer(s) {unknown}; known: {', '.join(MIXERS)}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"LMConfig.d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads}) "
                             "unless head_dim is given")
        if {"attn", "swa"} & set(self.pattern) and self.d_model % self.attention_heads:
            raise ValueError(f"LMConfig.d_model ({self.d_model}) must be a multiple of the attention heads "
                             f"({self.attention_heads}: attn_heads, else n_heads) for attention layers (head dim "
                             "d_model / heads)")
        if self.n_kv_heads is not None and self.attention_heads % self.n_kv_heads:
            raise ValueError(f"LMConfig.n_kv_heads ({self.n_kv_heads}) must divide the attention heads "
                             f"({self.attention_heads}: attn_heads, else n_heads)")
        if self.num_householder is not None and not any(
                MIXER_SPECS[m].options.get("num_householder", 1) > 1 for m in self.pattern if m in MIXER_SPECS):
            raise ValueError(f"LMConfig.num_householder is the Gated DeltaProduct mixer's (`gdp`) steps a token; "
                             f"no layer of mixer {self.mixer!r} takes it")
        if self.n_v_heads is not None and self.n_v_heads % self.n_heads:
            raise ValueError(f"LMConfig.n_v_heads ({self.n_v_heads}) must be a multiple of n_heads ({self.n_heads})")
        grouped = [m for m in self.pattern if m not in ("attn", "swa") and MIXER_SPECS[m].layer != "delta"]
        if self.v_heads != self.n_heads and grouped:
            raise ValueError(f"LMConfig.n_v_heads: grouped value heads are for the delta-rule mixers; "
                             f"{grouped} take n_heads value heads")
        if self.allow_neg_eigval:
            # the delta rules (beta in [0, 2]) and Mamba-2 (a_t = 2 exp(dt A) - 1) have the [-1, 1] form and
            # take the flag; the other layers of a hybrid keep theirs; with no such layer it would do nothing
            if not any(m == "mamba2" or (m in MIXER_SPECS and MIXER_SPECS[m].layer == "delta"
                                         and not MIXER_SPECS[m].options.get("implicit")
                                         and not (self.fla_form and m == "comba")) for m in self.pattern):
                raise ValueError(f"LMConfig.allow_neg_eigval: no layer of mixer {self.mixer!r} has a "
                                 "negative-eigenvalue form (the delta rules but Longhorn and fla-form Comba, and "
                                 "Mamba-2 have one)")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        self._check_rwkv7_official()
        self._check_fla_options()
        if self.head_dim < 1 or self.head_dim % 2:
            raise ValueError(f"LMConfig.head_dim must be a positive even int, got {self.head_dim}")
        if self.expand_v <= 0 or self.head_v_dim != self.head_dim * self.expand_v:
            raise ValueError(f"LMConfig.expand_v * head_dim must be a positive int, "
                             f"got {self.expand_v} * {self.head_dim}")

    def _check_rwkv7_official(self):
        if not isinstance(self.rwkv7_official, bool):
            raise ValueError(f"LMConfig.rwkv7_official must be a bool, got {self.rwkv7_official!r}")
        if self.rwkv7_ranks is not None:
            ranks = self.rwkv7_ranks
            if not isinstance(ranks, (tuple, list)) or len(ranks) != 4 or any(
                    not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in ranks):
                raise ValueError(f"LMConfig.rwkv7_ranks must be None or 4 positive ints (w, a, v, g), got {ranks!r}")
            object.__setattr__(self, "rwkv7_ranks", tuple(ranks))
            if not self.rwkv7_official:
                raise ValueError("LMConfig.rwkv7_ranks is for rwkv7_official=True (the rwkv7 mixer has lora_rank)")
        eps = self.rwkv7_group_norm_eps
        if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0
                                or not self.rwkv7_official):
            raise ValueError(f"LMConfig.rwkv7_group_norm_eps must be None or a number > 0, with rwkv7_official=True; "
                             f"got {eps!r}")
        if not self.rwkv7_official:
            return
        if self.pattern != ("rwkv7",):
            raise ValueError(f"LMConfig.rwkv7_official needs mixer='rwkv7' (every layer), got {self.mixer!r}")
        if self.n_heads * self.head_dim != self.d_model:
            raise ValueError(f"LMConfig.rwkv7_official: n_heads * head_dim ({self.n_heads} * {self.head_dim}) "
                             f"must be d_model ({self.d_model})")

    def _check_fla_options(self):
        bound = self.kda_lower_bound
        if bound is not None and (not isinstance(bound, (int, float)) or isinstance(bound, bool)
                                  or not -float("inf") < bound < 0):
            raise ValueError(f"LMConfig.kda_lower_bound must be None or a finite number < 0 (a log decay), "
                             f"got {bound!r}")
        if (self.kda_gate_rank is not None or bound is not None) and "kda" not in self.pattern:
            raise ValueError(f"LMConfig.kda_gate_rank / kda_lower_bound are options of the kda mixer; mixer is "
                             f"{self.mixer!r}")
        for name in ("fla_form", "hgrn2_lower_bounds"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LMConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.fla_form and not {"comba", "hgrn2"} & set(self.pattern):
            raise ValueError(f"LMConfig.fla_form is for the comba and hgrn2 mixers; mixer is {self.mixer!r}")
        if self.hgrn2_lower_bounds and not (self.fla_form and "hgrn2" in self.pattern):
            raise ValueError("LMConfig.hgrn2_lower_bounds needs fla_form=True and an hgrn2 layer")
        if self.hgrn2_lower_bounds and self.n_heads * (self.head_dim or self.d_model // self.n_heads) != self.d_model:
            raise ValueError(f"LMConfig.hgrn2_lower_bounds: the forget gates' width n_heads * head_dim "
                             f"({self.n_heads} * {self.head_dim}) must be d_model ({self.d_model}), as the bounds'")

    @property
    def rwkv7_ln_x_eps(self) -> float:
        """The eps of the official time mixing's GroupNorm: ``rwkv7_group_norm_eps``, else ``64 * norm_eps``."""
        return 64 * self.norm_eps if self.rwkv7_group_norm_eps is None else self.rwkv7_group_norm_eps

    @property
    def rwkv7_lora_ranks(self) -> tuple:
        """The LoRA ranks (w, a, v, g) of the official RWKV-7 time mixing: ``rwkv7_ranks``, else the
        official suggestions (1.8, 1.8, 1.3 sqrt(d_model) and 0.6 d_model^0.8, to a multiple of 32, >= 32)."""
        if self.rwkv7_ranks is not None:
            return self.rwkv7_ranks
        D = self.d_model
        return tuple(max(32, int(round(x / 32) * 32)) for x in (1.8 * D ** 0.5, 1.8 * D ** 0.5, 1.3 * D ** 0.5,
                                                                  0.6 * D ** 0.8))

    @property
    def pattern(self) -> tuple:
        """The mixer pattern as a tuple of names (before repeating to n_layers)."""
        return tuple(m.strip() for m in self.mixer.split(","))

    @property
    def mixers(self) -> tuple:
        """The mixer of every layer: the pattern repeated to ``n_layers``."""
        p = self.pattern
        return tuple(p[i % len(p)] for i in range(self.n_layers))

    @property
    def attention_heads(self) -> int:
        """The heads of the attn / swa layers: ``attn_heads``, else ``n_heads``."""
        return self.n_heads if self.attn_heads is None else self.attn_heads

    @property
    def v_heads(self) -> int:
        """The delta-rule mixers' value heads: ``n_v_heads``, else ``n_heads``."""
        return self.n_heads if self.n_v_heads is None else self.n_v_heads

    @property
    def head_v_dim(self) -> int:
        return int(self.head_dim * self.expand_v)

    @property
    def mlp_dim(self) -> int:
        """SwiGLU hidden size: ``intermediate_size``, else 8/3 d_model rounded up to a multiple of 64."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 64 * -(-int(8 * self.d_model / 3) // 64)

    def replace(self, **changes) -> "LMConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LMConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"LMConfig has no field(s) {unknown}")
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides) -> "LMConfig":
        """A named size (``tiny``, ``125M``, ``340M``, ``1.3B``) with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=2, window_size=16, mamba_head_dim=16,
                 lora_rank=8),
    "125M": dict(vocab_size=32000, d_model=768, n_layers=12, n_heads=6, window_size=2048),
    "340M": dict(vocab_size=32000, d_model=1024, n_layers=24, n_heads=8, window_size=2048),
    "1.3B": dict(vocab_size=32000, d_model=2048, n_layers=24, n_heads=16, window_size=2048),
}
