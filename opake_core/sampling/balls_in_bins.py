"""Balls-in-bins sampling with fixed bins (Choquette-Choo et al. 2024, arXiv 2410.06266, Definition 3.1).

Every example is thrown once into one of ``num_bins`` bins, uniformly and independently, and the bins are **fixed
for the whole run**: step ``t`` is bin ``t mod num_bins``, so an example takes part in every ``num_bins``-th step,
exactly ``n_steps / num_bins`` times over a horizon that is a multiple of ``num_bins``. Fixed bins give the b-min-sep
structure the matrix-mechanism analysis needs; bins re-drawn every epoch would be more private for DP-SGD but are not
what this sampler does. Batch sizes are random (Binomial(N, 1 / num_bins)); empty bins are empty batches.

Draws: the bins come from ``numpy_generator(fold_in(key, TAG, "bins")).integers(0, num_bins, N)``, recomputed at
every step (O(N), cache-free), so a batch depends on (key, step) alone. Accounting: exact random allocation for the
identity, Monte Carlo for other strategies (:func:`opake_core.accounting.mf_process`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["BallsInBins", "balls_in_bins"]

TAG = "opake.sampling.balls_in_bins"


@dataclass(frozen=True)
class BallsInBins:
    """Balls-in-bins sampler with fixed bins (build it with :func:`balls_in_bins`)."""

    dataset_size: int
    num_bins: int

    def __post_init__(self) -> None:
        validate.integer("dataset_size", self.dataset_size, minimum=1)
        validate.integer("num_bins", self.num_bins, minimum=2)

    @property
    def sample_rate(self) -> float:
        """The fraction of the dataset per step, ``1 / num_bins``."""
        return 1.0 / self.num_bins

    @property
    def expected_batch_size(self) -> float:
        return self.dataset_size / self.num_bins

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        return (("dataset_size", self.dataset_size), ("num_bins", self.num_bins), ("sampler", "balls_in_bins"))

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The sorted int64 indices of step ``state.step`` (bin ``step mod num_bins``) and the next state."""
        state = check_state(state, self.config)
        bins = numpy_generator(fold_in(key, TAG, "bins")).integers(0, self.num_bins, self.dataset_size)
        indices = np.flatnonzero(bins == state.step % self.num_bins).astype(np.int64)
        return indices, SamplerState(state.step + 1, state.config)

    def process(self, noise_multiplier: float, steps: int, *, strategy: Any, **options: Any) -> Any:
        """The whole-horizon process of ``strategy`` with this sampler (:func:`opake_core.accounting.mf_process`)."""
        return acc.mf_process(strategy, sampler=self, noise_multiplier=noise_multiplier, n_steps=steps, **options)


def balls_in_bins(*, dataset_size: int, num_bins: int) -> BallsInBins:
    """A balls-in-bins sampler whose bins stay fixed for the whole run.

    Example: the 5 bins partition the dataset, and epoch 2 repeats them in the same order.

        >>> import numpy as np
        >>> from opake_core import random, sampling
        >>> sampler = sampling.balls_in_bins(dataset_size=100, num_bins=5)
        >>> state, bins = sampler.init(), []
        >>> for _ in range(10):
        ...     batch, state = sampler.sample(random.key(0), state)
        ...     bins.append(batch)
        >>> sorted(np.concatenate(bins[:5]).tolist()) == list(range(100))
        True
        >>> all(np.array_equal(bins[i], bins[i + 5]) for i in range(5))
        True
    """
    return BallsInBins(dataset_size, num_bins)
