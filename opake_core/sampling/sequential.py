"""Sequential (optionally shuffled) fixed-size batches: no privacy amplification.

Epoch e uses the permutation ``numpy_generator(fold_in(key, TAG, e)).permutation(N)`` (or the identity without
shuffling) cut into ``N // batch_size`` batches (the last partial batch is dropped). Such an order gives no
amplification by sampling, so :meth:`Sequential.process` refuses a private run unless the caller asks for the
unamplified accounting, stated as such: every example takes part in at most ``ceil(steps / steps_per_epoch)``
steps, each a Gaussian release with sensitivity 1 under zero-out adjacency (the example's gradient replaced by
zero), so the run is that many Gaussian compositions. Cost: O(N) per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["Sequential", "sequential"]

TAG = "opake.sampling.sequential"


@dataclass(frozen=True)
class Sequential:
    """Sequential batches (build it with :func:`sequential`)."""

    dataset_size: int
    batch_size: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        validate.integer("dataset_size", self.dataset_size, minimum=1)
        validate.integer("batch_size", self.batch_size, minimum=1)
        if self.batch_size > self.dataset_size:
            raise ConfigurationError(
                f"batch_size={self.batch_size} exceeds dataset_size={self.dataset_size}; use a smaller batch."
            )
        if not isinstance(self.shuffle, bool):
            raise ConfigurationError(f"shuffle must be True or False, got {self.shuffle!r}.")

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.batch_size

    @property
    def expected_batch_size(self) -> float:
        """The batch size: every batch holds exactly this many examples."""
        return float(self.batch_size)

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        return (
            ("batch_size", self.batch_size),
            ("dataset_size", self.dataset_size),
            ("sampler", "sequential"),
            ("shuffle", self.shuffle),
        )

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The sorted int64 indices of step ``state.step`` and the next state."""
        state = check_state(state, self.config)
        epoch, position = divmod(state.step, self.steps_per_epoch)
        if self.shuffle:
            order = numpy_generator(fold_in(key, TAG, epoch)).permutation(self.dataset_size)
        else:
            order = np.arange(self.dataset_size)
        batch = order[position * self.batch_size : (position + 1) * self.batch_size]
        return np.sort(batch).astype(np.int64), SamplerState(state.step + 1, state.config)

    def process(self, noise_multiplier: float, steps: int, *, unamplified: bool = False) -> acc.Process:
        """Unamplified accounting (module docstring); a private run needs ``unamplified=True``."""
        steps = validate.integer("steps", steps, minimum=1)
        participations = math.ceil(steps / self.steps_per_epoch)
        if noise_multiplier != 0 and not unamplified:
            raise ConfigurationError(
                f"a sequential order gives no amplification (noise_multiplier={noise_multiplier}); use a "
                "Poisson or k-out-of-t sampler, or pass unamplified=True to account each participation as a "
                "full Gaussian."
            )
        return acc.repeat(acc.gaussian(noise_multiplier), participations)


def sequential(*, dataset_size: int, batch_size: int, shuffle: bool = True) -> Sequential:
    """Sequential batches of ``batch_size`` (shuffled each epoch by default).

    It gives no privacy amplification: a run with it must be non-private (noise multiplier 0).

    Example: one epoch visits every example once.

        >>> import numpy as np
        >>> from opake_core import random, sampling
        >>> sampler = sampling.sequential(dataset_size=10, batch_size=5)
        >>> state, epoch = sampler.init(), []
        >>> for _ in range(sampler.steps_per_epoch):
        ...     batch, state = sampler.sample(random.key(0), state)
        ...     epoch.append(batch)
        >>> sorted(np.concatenate(epoch).tolist())
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    return Sequential(dataset_size, batch_size, shuffle)
