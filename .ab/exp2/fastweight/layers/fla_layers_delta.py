"""More of fla's layer classes of the delta family (beside ``fla_layers.py``, which holds DeltaNet,
GatedDeltaNet, KDA and Comba): Gated DeltaProduct, with fla 0.6.0's constructor arguments (in its
order, with its defaults), call convention, return tuple and parameter names (``fla_layers``' module
docstring: padding masks, packed ``cu_seqlens``, this library's cache dict or fla's ``Cache``).
"""

from __future__ import annotations

from fastweight.layers.fla_cache import FlaLayout
from fastweight.layers.fla_layers import QKV_CONVS, _FlaDeltaLayer, _refuse


class GatedDeltaProduct(_FlaDeltaLayer):
    """fla's ``GatedDeltaProduct`` layer (Siems et al., 2025), as fla 0.6.0 computes it:

        q = L2(SiLU(conv(W_q x)));  k_{t,j} = L2(SiLU(conv(W_k x))_j), v_{t,j} = SiLU(conv(W_v x))_j
              for the n = ``num_householder`` steps j of token t (W_k, W_v, W_b n times as wide)
        beta_{t,j} = sigmoid(W_b x)_j (x2 with ``allow_neg_eigval``, fla's default here)
        g_t = -exp(A_log) softplus(W_a x + dt_bias)
        S <- exp(g_t) S;  then for j < n:  S <- (I - beta_{t,j} k_{t,j} k_{t,j}^T) S + beta_{t,j} k_{t,j} v_{t,j}^T
        o_t = S_t^T q_t / sqrt(head_dim);   y = W_o (RMSNorm(o) * SiLU(W_g x))

    (``chunk_gated_delta_product``; the LM's ``gdp`` mixer, the same parameters). ``num_v_heads``:
    grouped value heads. fla's cache keeps the state [N, H, K, V] and the three convolutions' last
    inputs. Refused by name: ``use_output_gate=False``, ``use_short_conv=False``, ``conv_bias``,
    ``use_forget_gate=False``."""

    FLA_CACHE = FlaLayout(v_first=False, conv=QKV_CONVS)

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: int = None, mode: str = "chunk", use_output_gate: bool = True,
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False, layer_idx: int = None,
                 norm_eps: float = 1e-5, use_forget_gate: bool = True, allow_neg_eigval: bool = True,
                 num_householder: int = 2, **kwargs):
        if num_v_heads is not None and (num_v_heads < num_heads or num_v_heads % num_heads):
            raise ValueError(f"GatedDeltaProduct: `num_v_heads` ({num_v_heads}) must be a multiple of `num_heads` "
                             f"({num_heads})")
        if head_dim * expand_v != int(head_dim * expand_v):
            raise ValueError(f"GatedDeltaProduct: `head_dim * expand_v` ({head_dim * expand_v}) must be an integer")
        if num_householder < 1:
            raise ValueError(f"GatedDeltaProduct: `num_householder` must be >= 1, got {num_householder}")
        _refuse("GatedDeltaProduct", use_output_gate=(use_output_gate, True), use_short_conv=(use_short_conv, True),
                conv_bias=(conv_bias, False), use_forget_gate=(use_forget_gate, True))
        from fastweight.models.config import LMConfig
        cfg = LMConfig(vocab_size=1, d_model=hidden_size, n_layers=1, n_heads=num_heads, n_v_heads=num_v_heads,
                       mixer="gdp", head_dim=head_dim, expand_v=expand_v, allow_neg_eigval=allow_neg_eigval,
                       use_short_conv=use_short_conv, conv_size=conv_size, norm_eps=norm_eps,
                       num_householder=num_householder)
        self._fla_setup(cfg, "gdp", mode, layer_idx, kwargs)
        self.expand_v, self.use_forget_gate, self.use_output_gate = expand_v, use_forget_gate, use_output_gate
        self.allow_neg_eigval = allow_neg_eigval
        self.key_dim, self.value_dim = num_heads * head_dim, self.num_v_heads * self.head_v_dim
