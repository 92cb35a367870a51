"""Our ops against fla 0.6.0's own reference code (``fla.ops.*.naive``), called as fla calls them: the same
tensors (float64 leaves, handed to fla's references in float32, their dtype), an initial state, the output,
the final state and every gradient. Runs where fla-core 0.6.0 is importable (``pip install -e ".[compat]"``;
its references run on the CPU); CI, which installs no fla, checks the signatures from recorded data
(tests/test_fla_compat.py). Not here yet: retention and gated_delta_product (fla ships references for both);
fla has none for RWKV-6, RWKV-7 or HGRN2 (checked against the RWKV-LM loops and fla's models elsewhere).
"""

import pytest
import torch

from fastweight import ops
from fastweight.testing import rel_err

pytest.importorskip("fla.ops")

B, T, H, K, V = 2, 37, 2, 16, 16
# fla's references run in float32, ours in float64: measured 6e-8 to 1.0e-6 (Comba's dp, through its chunk reference)
TOL = 1e-5


def _draw(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    return dict(q=r(B, T, H, K), k=k, v=r(B, T, H, V), g=-torch.rand(B, T, H, generator=g, dtype=torch.float64),
                gk=-torch.rand(B, T, H, K, generator=g, dtype=torch.float64) * 0.5,
                beta=torch.rand(B, T, H, generator=g, dtype=torch.float64),
                p=torch.nn.functional.normalize(k + 0.3 * r(B, T, H, K), dim=-1), h0=r(B, H, K, V))


def _head_first(*xs):
    return [x.transpose(1, 2) for x in xs]


def _fla_delta_rule(q, k, v, beta, h0):
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    o, S = delta_rule_recurrence(*_head_first(q, k, v, beta), initial_state=h0, output_final_state=True)
    return o.transpose(1, 2), S


def _fla_dplr(q, k, v, a, b, gk, h0):
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
    o, S = dplr_recurrence(*_head_first(q, k, v, a, b, gk), initial_state=h0, output_final_state=True)
    return o.transpose(1, 2), S


def _cases():
    from fla.ops.comba.naive import naive_chunk_comba
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.kda.naive import naive_recurrent_kda
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
    return {
        "gla": (("q", "k", "v", "gk"),
                lambda x, h0: ops.chunk_gla(*x, initial_state=h0, output_final_state=True, backend="torch"),
                lambda x, h0: naive_recurrent_gla(*x, initial_state=h0, output_final_state=True)),
        "simple_gla": (("q", "k", "v", "g"),
                       lambda x, h0: ops.chunk_simple_gla(*x, initial_state=h0, output_final_state=True, backend="torch"),
                       lambda x, h0: naive_recurrent_simple_gla(*x, initial_state=h0, output_final_state=True)),
        "linear_attn": (("q", "k", "v"),
                        lambda x, h0: ops.chunk_linear_attn(*x, initial_state=h0, output_final_state=True,
                                                            normalize=False, backend="torch"),
                        lambda x, h0: naive_recurrent_linear_attn(*x, initial_state=h0, output_final_state=True)),
        "delta_rule": (("q", "k", "v", "beta"),
                       lambda x, h0: ops.chunk_delta_rule(*x, initial_state=h0, output_final_state=True, backend="torch"),
                       lambda x, h0: _fla_delta_rule(*x, h0)),
        "gated_delta_rule": (("q", "k", "v", "g", "beta"),
                             lambda x, h0: ops.chunk_gated_delta_rule(*x, initial_state=h0, output_final_state=True,
                                                                      backend="torch"),
                             lambda x, h0: naive_recurrent_gated_delta_rule(x[0], x[1], x[2], x[4], x[3],
                                                                            initial_state=h0, output_final_state=True)),
        "kda": (("q", "k", "v", "gk", "beta"),
                lambda x, h0: ops.chunk_kda(*x, initial_state=h0, output_final_state=True, backend="torch"),
                lambda x, h0: naive_recurrent_kda(*x, initial_state=h0, output_final_state=True)),
        # fla's chunk reference and its kernels (chunk and fused recurrent: b_v -= h p before h *= exp(g)) read the
        # state with p before the decay, as the paper's alpha_t I - beta_t k_t p_t^T; naive_recurrent_comba
        # decays first (p reads alpha_t S_{t-1}) and differs from both (rel 0.08 on o here)
        "comba": (("q", "k", "v", "p", "g", "beta"),
                  lambda x, h0: ops.chunk_comba(*x, initial_state=h0, output_final_state=True, backend="torch"),
                  lambda x, h0: naive_chunk_comba(*x, initial_state=h0, output_final_state=True)),
        "dplr_delta_rule": (("q", "k", "v", "a", "b", "gk"),
                            lambda x, h0: ops.chunk_dplr_delta_rule(*x, initial_state=h0, output_final_state=True,
                                                                    backend="torch"),
                            lambda x, h0: _fla_dplr(*x, h0)),
    }


@pytest.mark.parametrize("op", ["gla", "simple_gla", "linear_attn", "delta_rule", "gated_delta_rule", "kda", "comba",
                                "dplr_delta_rule"])
def test_op_against_fla_reference(op):
    names, ours, theirs = _cases()[op]
    x = _draw()
    # DPLR with fla's meaning of (a, b): S <- (Diag(exp gk) + b a^T) S + k v^T, a = -k, b = beta k (DeltaNet-like)
    x["a"], x["b"] = -x["k"], x["k"] * x["beta"][..., None]
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    h0 = x["h0"].clone().requires_grad_()
    o, S = ours([leaves[n] for n in names], h0)
    o_f, S_f = theirs([leaves[n].float() for n in names], h0.float())
    assert rel_err(o, o_f) < TOL and rel_err(S, S_f) < TOL, op
    gen = torch.Generator().manual_seed(1)
    do, dS = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(S.shape, generator=gen,
                                                                                  dtype=torch.float64)
    wrt = [*leaves.values(), h0]
    mine = torch.autograd.grad((o * do).sum() + (S * dS).sum(), wrt)
    ref = torch.autograd.grad((o_f.double() * do).sum() + (S_f.double() * dS).sum(), wrt)
    for n, a, b in zip([*names, "initial_state"], mine, ref):
        assert rel_err(a, b) < TOL, f"{op}: d{n} {rel_err(a, b):.2e}"
