"""Cyclic Poisson sampling for amplified BandMF (Choquette-Choo et al. 2023, arXiv 2306.08153, Algorithm 2).

The dataset is split once into ``bands`` disjoint groups of equal, public size; step ``t`` uses group ``t mod bands``
only, and takes each of its examples independently with the *conditional* rate ``q``. With ``world_size`` ranks,
rank ``r`` owns the examples ``[r * s, (r + 1) * s)`` with ``s = N // world_size`` and splits them into groups of
``m = floor(s / bands)``; the active global group is the union of the ranks' groups, of size ``world_size * m``.
Examples left over by the floors never participate.

``sample_rate`` keeps the trainer's meaning: the expected global batch divided by N. The conditional rate is
``q = sample_rate * N / (world_size * m)`` (``sample_rate * bands`` when everything divides); ``q > 1`` is refused.

Draws: the partition of rank ``r`` is ``numpy_generator(fold_in(key, TAG, "partition", r)).permutation(s)``, the
Bernoulli draws of step ``t`` come from ``numpy_generator(fold_in(key, TAG, r, t))``, so a batch depends on (key,
rank, step) alone and replays exactly on resume. Cost: O(N / world_size) per step (the partition is recomputed,
not cached). Accounting: :func:`opake_core.accounting.mf_process` (ceil(n / bands) Poisson-sampled Gaussians at
rate ``q``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["CyclicPoisson", "cyclic_poisson"]

TAG = "opake.sampling.cyclic_poisson"


@dataclass(frozen=True)
class CyclicPoisson:
    """Cyclic Poisson sampler (build it with :func:`cyclic_poisson`)."""

    dataset_size: int
    sample_rate: float
    bands: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        validate.integer("dataset_size", self.dataset_size, minimum=1)
        object.__setattr__(self, "sample_rate", validate.rate("sample_rate", self.sample_rate))
        validate.integer("bands", self.bands, minimum=1)
        validate.integer("world_size", self.world_size, minimum=1)
        validate.integer("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ConfigurationError(f"rank must be in [0, world_size={self.world_size}), got rank={self.rank}.")
        if self.group_size < 1:
            raise ConfigurationError(
                f"cyclic_poisson needs at least one example per group and rank: floor((dataset_size // world_size) "
                f"/ bands) = floor(({self.dataset_size} // {self.world_size}) / {self.bands}) = 0; use fewer bands "
                "or ranks."
            )
        q = self.conditional_rate
        if q > 1.0:
            most = self.world_size * self.group_size / self.dataset_size
            raise ConfigurationError(
                f"the conditional rate within a group is sample_rate * N / (world_size * group_size) = "
                f"{self.sample_rate} * {self.dataset_size} / ({self.world_size} * {self.group_size}) = {q:.6g} > 1; "
                f"use sample_rate <= {most:.6g} (groups of floor(N / bands)) or fewer bands."
            )

    @property
    def shard_size(self) -> int:
        """Examples owned by one rank: ``N // world_size``."""
        return self.dataset_size // self.world_size

    @property
    def group_size(self) -> int:
        """Examples of one group on one rank: ``floor((N // world_size) / bands)``."""
        return self.shard_size // self.bands

    @property
    def conditional_rate(self) -> float:
        """``q``: the rate within the active group, the sampling rate the accountant uses."""
        q = self.sample_rate * self.dataset_size / (self.world_size * self.group_size)
        return 1.0 if 1.0 < q <= 1.0 + 1e-12 else q  # forgive float rounding of an exact rate 1

    @property
    def expected_batch_size(self) -> float:
        """The expected global batch ``sample_rate * N``: the public normalizer of the clipped sum."""
        return self.dataset_size * self.sample_rate

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        return (
            ("bands", self.bands),
            ("dataset_size", self.dataset_size),
            ("rank", self.rank),
            ("sample_rate", self.sample_rate),
            ("sampler", "cyclic_poisson"),
            ("world_size", self.world_size),
        )

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def group(self, key: Key, index: int) -> np.ndarray:
        """The sorted dataset indices of this rank's group ``index`` (public sizes, private membership)."""
        m, start = self.group_size, self.rank * self.shard_size
        order = numpy_generator(fold_in(key, TAG, "partition", self.rank)).permutation(self.shard_size)
        return np.sort(start + order[index * m : (index + 1) * m]).astype(np.int64)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """This rank's sorted int64 indices of step ``state.step`` and the state of the next step."""
        state = check_state(state, self.config)
        members = self.group(key, state.step % self.bands)
        gen = numpy_generator(fold_in(key, TAG, self.rank, state.step))
        keep = gen.random(len(members)) < self.conditional_rate
        return members[keep], SamplerState(state.step + 1, state.config)

    def process(self, noise_multiplier: float, steps: int, *, strategy: Any, **options: Any) -> Any:
        """The whole-horizon process of ``strategy`` with this sampler (:func:`opake_core.accounting.mf_process`)."""
        return acc.mf_process(strategy, sampler=self, noise_multiplier=noise_multiplier, n_steps=steps, **options)


def cyclic_poisson(
    *, dataset_size: int, sample_rate: float, bands: int, world_size: int = 1, rank: int = 0
) -> CyclicPoisson:
    """A cyclic Poisson sampler over ``bands`` groups; ``sample_rate`` is the expected global batch / N.

    Example: step 0 draws from group 0 only, at the rate that keeps the expected batch at ``sample_rate * N``.

        >>> from opake_core import random, sampling
        >>> sampler, key = sampling.cyclic_poisson(dataset_size=1_000, sample_rate=0.05, bands=4), random.key(0)
        >>> batch, state = sampler.sample(key, sampler.init())
        >>> set(batch.tolist()) <= set(sampler.group(key, 0).tolist()), sampler.group_size, sampler.conditional_rate
        (True, 250, 0.2)
    """
    return CyclicPoisson(dataset_size, sample_rate, bands, world_size, rank)
