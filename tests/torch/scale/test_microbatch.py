"""OOM retry: the retried step equals the plain step for the same batch, key and step (privacy-neutral)."""

from __future__ import annotations

import pytest
import torch

from opake_core import random
from opake_core.errors import ConfigurationError
from opake_core.optim import sgd
from opake_core.step import dp_sgd
from opake_torch.transformers.microbatch import (
    is_out_of_memory,
    retry_eval_batch,
    run_with_oom_retry,
)


def loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ params["w"]) - y).square().sum()


def setup() -> tuple[dict, tuple, random.Key]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 3, generator=gen)}
    batch = (torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen))
    return params, batch, random.key(7)


def make_step(chunk: int, fail_above: int | None, attempts: list[int]):
    params, batch, key = setup()
    optimizer = sgd(0.1)
    step_fn, dp_state = dp_sgd(
        loss,
        optimizer=optimizer,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=16.0,
        microbatch_size=chunk,
        key=key,
    )
    attempts.append(chunk)
    if fail_above is not None and chunk > fail_above:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return step_fn(params, optimizer.init(params), dp_state, batch)


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory."), RuntimeError("CUDA error: out of memory")],
)
def test_is_out_of_memory(error: Exception) -> None:
    assert is_out_of_memory(error)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_retry_equals_plain_step_bitwise() -> None:
    attempts: list[int] = []
    shrinks: list[tuple[int, int]] = []
    (params, _, state, metrics), chunk = run_with_oom_retry(
        lambda m: make_step(m, 2, attempts),
        microbatch_size=16,
        batch_size=16,
        on_shrink=lambda a, b: shrinks.append((a, b)),
    )
    assert chunk == 2 and attempts == [16, 8, 4, 2] and shrinks == [(16, 8), (8, 4), (4, 2)]
    plain_params, _, plain_state, plain_metrics = make_step(2, None, [])
    assert torch.equal(params["w"], plain_params["w"])  # same chunk, same key and step: bitwise
    assert state.step == plain_state.step == 1
    assert torch.equal(metrics.loss, plain_metrics.loss)
    other, _, _, _ = make_step(16, None, [])
    torch.testing.assert_close(params["w"], other["w"], rtol=1e-6, atol=1e-6)  # chunk size only reorders sums


def test_no_retry_without_oom_and_other_errors_propagate() -> None:
    attempts: list[int] = []
    _, chunk = run_with_oom_retry(lambda m: make_step(m, None, attempts), microbatch_size=32, batch_size=16)
    assert chunk == 16 and attempts == [16]

    def bad(m: int) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        run_with_oom_retry(bad, microbatch_size=4, batch_size=4)


def test_oom_at_one_example_is_a_configuration_error() -> None:
    def always(m: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(ConfigurationError, match=r"microbatch_size=1.*gradient_checkpointing") as info:
        run_with_oom_retry(always, microbatch_size=3, batch_size=8)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    with pytest.raises(ConfigurationError, match="microbatch_size must be an int >= 1, got 0"):
        run_with_oom_retry(always, microbatch_size=0, batch_size=8)


def test_empty_batch_runs_once() -> None:
    assert run_with_oom_retry(lambda m: m, microbatch_size=8, batch_size=0) == (1, 1)


def test_eval_retry_covers_every_example_once() -> None:
    seen: list[tuple[int, int]] = []

    def evaluate(lo: int, hi: int) -> list[int]:
        if hi - lo > 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        seen.append((lo, hi))
        return list(range(lo, hi))

    pieces, size = retry_eval_batch(evaluate, start=0, stop=10, batch_size=8)
    assert size == 2 and [i for p in pieces for i in p] == list(range(10))
    assert seen == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
