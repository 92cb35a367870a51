"""fla's argument meaning in the reference ops: their DPLR ``a`` is read against the state."""

import torch

from fastweight.mechanisms import get
from fastweight.reference import dplr_recurrent, ops
from fastweight.testing import generator, rel_err


def test_fla_a_is_read_b_is_written():
    x = get("dplr").sample(1, 7, 2, 4, 3, dtype=torch.float64, device="cpu", generator=generator())
    o, _ = dplr_recurrent(**x, scale=1.0)
    fla = dict(q=x["q"], k=x["k"], v=x["v"], a=x["b"], b=x["a"], gk=x["gk"])
    assert rel_err(ops.dplr_delta_rule(**fla, scale=1.0)[0], o) == 0.0
    assert rel_err(ops.rwkv7(r=x["q"], w=x["gk"], k=x["k"], v=x["v"], a=x["b"], b=x["a"], scale=1.0)[0], o) == 0.0
    swapped, _ = ops.dplr_delta_rule(**{**fla, "a": x["a"], "b": x["b"]}, scale=1.0)
    assert rel_err(swapped, o) > 1e-3


def test_every_op_has_a_reference():
    from fastweight.ops import OPS
    assert all(callable(getattr(ops, op)) for op in OPS)
