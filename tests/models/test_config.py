"""LMConfig's validation of options that only some layers have."""

import pytest

from fastweight.models import LMConfig


@pytest.mark.parametrize("mixer", ["deltanet", "gdn", "kda", "comba", "gdp", "mamba2", "gdn,swa", "mamba2,attn",
                                   "deltanet,rwkv7"])
def test_allow_neg_eigval_where_a_layer_has_it(mixer):
    """The delta rules and Mamba-2 take it; a hybrid's other layers keep their own transitions."""
    assert LMConfig.preset("tiny", mixer=mixer, allow_neg_eigval=True).allow_neg_eigval


@pytest.mark.parametrize("mixer,extra", [("gla", {}), ("rwkv7", {}), ("longhorn", {}), ("hgrn2", {}), ("la", {}),
                                         ("gla,attn", {}), ("comba", dict(fla_form=True))])
def test_allow_neg_eigval_is_refused_where_it_would_be_ignored(mixer, extra):
    """No layer has a [-1, 1] form: the flag would do nothing."""
    with pytest.raises(ValueError, match="allow_neg_eigval: no layer of mixer .* has a negative-eigenvalue form"):
        LMConfig.preset("tiny", mixer=mixer, allow_neg_eigval=True, **extra)
