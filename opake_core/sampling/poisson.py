"""Poisson sampling, optionally truncated: each example is in a step's batch independently with rate q.

Step ``s`` draws from ``numpy_generator(fold_in(key, "opake.sampling.poisson", s))`` only, so a batch depends
on (key, step) alone and replays exactly on resume. Empty batches are returned (and count as steps), never
skipped. With ``truncated_batch_size`` B, a draw larger than B keeps a uniform subset of exactly B; it is
accounted with dp-accounting's truncated analysis (Ganesh 2025, arXiv 2508.15089), never as plain Poisson.
Cost: O(N) per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["Poisson", "poisson"]

TAG = "opake.sampling.poisson"


@dataclass(frozen=True)
class Poisson:
    """Poisson sampler over ``dataset_size`` examples at ``sample_rate`` (build it with :func:`poisson`)."""

    dataset_size: int
    sample_rate: float
    truncated_batch_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset_size", validate.integer("dataset_size", self.dataset_size, minimum=1))
        object.__setattr__(self, "sample_rate", validate.rate("sample_rate", self.sample_rate))
        if self.truncated_batch_size is not None:
            cap = validate.integer("truncated_batch_size", self.truncated_batch_size, minimum=1)
            object.__setattr__(self, "truncated_batch_size", cap)

    @property
    def expected_batch_size(self) -> float:
        """N * q before truncation: the public normalizer of the clipped sum."""
        return self.dataset_size * self.sample_rate

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        return (
            ("dataset_size", self.dataset_size),
            ("sample_rate", self.sample_rate),
            ("sampler", "poisson"),
            ("truncated_batch_size", self.truncated_batch_size),
        )

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The sorted int64 indices of step ``state.step`` and the state of the next step."""
        state = check_state(state, self.config)
        gen = numpy_generator(fold_in(key, TAG, state.step))
        indices = np.flatnonzero(gen.random(self.dataset_size) < self.sample_rate).astype(np.int64)
        cap = self.truncated_batch_size
        if cap is not None and len(indices) > cap:
            indices = np.sort(gen.choice(indices, size=cap, replace=False))
        return indices, SamplerState(state.step + 1, state.config)

    def process(self, noise_multiplier: float, steps: int) -> acc.Process:
        """The accounting process of ``steps`` steps of DP-SGD with this sampler."""
        mechanism = acc.gaussian(noise_multiplier)
        if self.truncated_batch_size is None:
            step = acc.poisson(mechanism, self.sample_rate)
        else:
            step = acc.truncated_poisson(
                mechanism,
                self.sample_rate,
                dataset_size=self.dataset_size,
                truncated_batch_size=self.truncated_batch_size,
            )
        return acc.repeat(step, steps)


def poisson(*, dataset_size: int, sample_rate: float, truncated_batch_size: int | None = None) -> Poisson:
    """A Poisson sampler (truncated at ``truncated_batch_size`` when given)."""
    return Poisson(dataset_size, sample_rate, truncated_batch_size)
