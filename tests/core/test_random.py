"""Keys: derivation, replay, serialization, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from opake_core import random
from opake_core.errors import ConfigurationError, InputTypeError


def test_derivation_is_deterministic_and_domain_separated():
    k = random.key(42)
    assert k == random.key(42) and k != random.key(43)
    assert random.split(k, 3) == tuple(random.fold_in(k, i) for i in range(3))
    assert random.fold_in(k, 1, "a") == random.fold_in(random.fold_in(k, 1), "a")
    assert random.fold_in(k, 1) != random.fold_in(k, "1")
    assert random.fold_in(k, "ab", "c") != random.fold_in(k, "a", "bc")
    assert random.key(-1) != random.key(2**64 - 1)
    assert len(set(random.split(k, 1000))) == 1000


def test_json_round_trip():
    k = random.fold_in(random.key(2**100), "stream")
    text = json.dumps(random.key_to_json(k))
    assert random.key_from_json(json.loads(text)) == k


def test_normal_replays_and_depends_on_shape_and_dtype():
    k = random.key(5)
    a = random.normal(k, (3, 4))
    assert torch.equal(a, random.normal(k, (3, 4)))
    assert random.normal(k, (3,), dtype=torch.float64).dtype == torch.float64
    assert not torch.equal(a, random.normal(random.key(6), (3, 4)))
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    random.normal(k, (10,))
    assert torch.equal(torch.rand(1), before)  # the global generator is untouched


def test_numpy_generator_replays():
    k = random.key(9)
    assert np.array_equal(random.numpy_generator(k).random(5), random.numpy_generator(k).random(5))
    assert not np.array_equal(random.numpy_generator(k).random(5), random.numpy_generator(random.key(8)).random(5))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: random.key(1.5), InputTypeError),
        (lambda: random.key(True), InputTypeError),
        (lambda: random.fold_in(random.key(0)), ConfigurationError),
        (lambda: random.fold_in(random.key(0), True), InputTypeError),
        (lambda: random.fold_in(random.key(0), 1.0), InputTypeError),
        (lambda: random.fold_in(0, 1), InputTypeError),
        (lambda: random.split(random.key(0), 0), ConfigurationError),
        (lambda: random.key_from_json({"opake_key": "zz"}), ConfigurationError),
        (lambda: random.key_from_json({"opake_key": "g" * 32}), ConfigurationError),
        (lambda: random.key_from_json([1]), InputTypeError),
        (lambda: random.Key(-1, 0), InputTypeError),
    ],
)
def test_refusals(call, error):
    with pytest.raises(error):
        call()


@pytest.mark.cuda
def test_cuda_normal_replays_and_ignores_device_index():
    k = random.key(1)
    a = random.normal(k, (1 << 16,), device="cuda")
    assert torch.equal(a, random.normal(k, (1 << 16,), device="cuda"))
    assert a.device.type == "cuda"
