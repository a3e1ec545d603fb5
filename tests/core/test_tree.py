"""Typed pytrees and per-group assignment."""

from __future__ import annotations

import math

import optree
import pytest
import torch

from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup, leaf_paths, per_group

PARAMS = {
    "encoder": {"attn": {"weight": torch.ones(2)}, "mlp": {"weight": torch.ones(2)}},
    "head.weight": torch.ones(1),
}


def test_leaf_paths_are_dotted():
    assert leaf_paths(PARAMS) == ["encoder.attn.weight", "encoder.mlp.weight", "head.weight"]


def test_per_group_assigns_each_leaf_once():
    groups = per_group(PARAMS, {r"attn": 1.0, r"mlp": 2.0}, fallback=0.5)
    assert groups.group_of == {
        "encoder.attn.weight": "attn",
        "encoder.mlp.weight": "mlp",
        "head.weight": "fallback",
    }
    assert groups.value_of == {"attn": 1.0, "fallback": 0.5, "mlp": 2.0}
    assert groups.leaf_values() == [1.0, 2.0, 0.5]
    assert groups.effective == pytest.approx(math.sqrt(1 + 4 + 0.25))
    assert per_group(PARAMS, {"attn": 1.0, "fallback": 3.0}).value_of["fallback"] == 3.0
    assert groups.map(lambda v: v / 2).value_of["mlp"] == 1.0


@pytest.mark.parametrize(
    ("patterns", "kwargs", "match"),
    [
        ({}, {}, "at least one pattern"),
        ({"attn": 0.0}, {"fallback": 1.0}, "positive"),
        ({"attn": 1.0}, {"fallback": -1.0}, "positive"),
        ({"attn": math.nan}, {"fallback": 1.0}, "positive"),
        ({"encoder": 1.0, "attn": 1.0}, {"fallback": 1.0}, "multiple patterns"),
        ({"attn": 1.0}, {}, "did not match any pattern"),
        ({"attn": 1.0, "nothing": 1.0}, {"fallback": 1.0}, "did not match any parameter"),
        ({"[": 1.0}, {"fallback": 1.0}, "regular expression"),
        ({"attn": 1.0, "fallback": 1.0}, {"fallback": 1.0}, "not both"),
    ],
)
def test_per_group_errors(patterns, kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        per_group(PARAMS, patterns, **kwargs)


def test_per_group_other_inputs():
    assert per_group(PARAMS, {"attn": 1.0, "nothing": 1.0}, fallback=1.0, allow_unused_patterns=True).num_groups == 2
    with pytest.raises(InputTypeError, match="tree of tensors"):
        per_group({"a": 1.0}, fallback=1.0)
    with pytest.raises(ConfigurationError, match="at least one tensor"):
        per_group({}, fallback=1.0)
    with pytest.raises(InputTypeError, match="number"):
        per_group(PARAMS, {"attn": "1"}, fallback=1.0)


def test_wrappers_validate_and_flatten_in_namespace():
    clipped = Clipped({"w": torch.ones(2)}, 0.5)
    doubled = optree.tree_map(lambda x: x * 2, clipped, namespace=NAMESPACE)
    assert isinstance(doubled, Clipped) and doubled.sensitivity == 0.5 and doubled.value["w"][0] == 2
    noised = optree.tree_map(lambda x: x, Noised({"w": torch.ones(2)}, 0.5, 1.5), namespace=NAMESPACE)
    assert isinstance(noised, Noised) and noised.noise_std == 1.5
    with pytest.raises(ConfigurationError, match="non-negative"):
        Clipped({}, -1.0)
    with pytest.raises(ConfigurationError, match="non-negative"):
        Noised({}, 1.0, math.nan)
    with pytest.raises(InputTypeError, match="float or PerGroup"):
        Clipped({}, "1")
    with pytest.raises(ConfigurationError, match="without a value"):
        PerGroup((("a", "g"),), (("h", 1.0),))
