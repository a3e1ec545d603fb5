"""Fixed-size batches: every step draws exactly ``batch_size`` distinct examples uniformly at random (sampling
without replacement), independently of the other steps.

Step ``s`` draws from ``numpy_generator(fold_in(key, "opake.sampling.fixed_size", s))`` only, so a batch depends
on (key, step) alone and replays exactly on resume. Every batch has the same size, so the training step sees one
shape (no padding, no chunking by draw size). Cost: O(batch_size) per step.

With ``world_size`` W > 1 (data-parallel training) every rank makes the same global draw from the shared key and
rank ``r`` keeps its sorted positions ``r, r + W, ...``: the ranks' parts are disjoint and their union is the global
batch the accountant analyses, of ``batch_size / W`` rows each (rounded down or up when W does not divide it). The
configuration records ``world_size`` but not ``rank``, so every rank resumes from rank 0's checkpoint.

Accounting: :func:`opake_core.accounting.without_replacement`, by RDP under **replace-one** adjacency (Wang, Balle
and Kasiviswanathan 2019, Theorem 27): the dataset size is public and a neighbouring dataset replaces one example.
That is a different guarantee from Poisson sampling's add-or-remove epsilon, and at the same noise multiplier a
larger number (replacing an example moves the clipped sum by up to twice the clipping bound). Adaptive clipping, the
matrix-factorization mechanisms and the MoE router release are not accounted with it and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["FixedSize", "fixed_size"]

TAG = "opake.sampling.fixed_size"


@dataclass(frozen=True)
class FixedSize:
    """Fixed-size sampler: ``batch_size`` distinct examples of ``dataset_size`` per step (build it with
    :func:`fixed_size`)."""

    dataset_size: int
    batch_size: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        n = validate.integer("dataset_size", self.dataset_size, minimum=1)
        b = validate.integer("batch_size", self.batch_size, minimum=1)
        if b > n:
            raise ConfigurationError(
                f"batch_size must be <= dataset_size, got batch_size={b} > dataset_size={n}: a batch holds distinct "
                "examples. Use a smaller batch."
            )
        world = validate.integer("world_size", self.world_size, minimum=1)
        rank = validate.integer("rank", self.rank, minimum=0)
        if rank >= world:
            raise ConfigurationError(f"rank must be in [0, world_size={world}), got rank={rank}.")
        for name, value in (("dataset_size", n), ("batch_size", b), ("world_size", world), ("rank", rank)):
            object.__setattr__(self, name, value)

    @property
    def expected_batch_size(self) -> float:
        """The batch size (every batch has it): the public normalizer of the clipped sum."""
        return float(self.batch_size)

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        """The configuration a state is checked against; ``world_size`` only when > 1, never ``rank``."""
        config = (("batch_size", self.batch_size), ("dataset_size", self.dataset_size), ("sampler", "fixed_size"))
        return config if self.world_size == 1 else (*config, ("world_size", self.world_size))

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The sorted int64 indices of step ``state.step`` (exactly ``batch_size``, distinct; this rank's part when
        ``world_size > 1``) and the next state."""
        state = check_state(state, self.config)
        gen = numpy_generator(fold_in(key, TAG, state.step))
        picked = np.sort(gen.choice(self.dataset_size, size=self.batch_size, replace=False)).astype(np.int64)
        return picked[self.rank :: self.world_size], SamplerState(state.step + 1, state.config)

    def process(self, noise_multiplier: float, steps: int) -> acc.Process:
        """The accounting process of ``steps`` steps of DP-SGD with this sampler (replace-one adjacency, RDP)."""
        step = acc.without_replacement(
            acc.gaussian(noise_multiplier), dataset_size=self.dataset_size, sample_size=self.batch_size
        )
        return acc.repeat(step, steps)


def fixed_size(*, dataset_size: int, batch_size: int, world_size: int = 1, rank: int = 0) -> FixedSize:
    """A fixed-size sampler: ``batch_size`` distinct examples drawn uniformly per step (module docstring); with
    ``world_size > 1``, rank ``rank``'s part of that global draw.

    Example:

        >>> from opake_core import random, sampling
        >>> sampler = sampling.fixed_size(dataset_size=100, batch_size=8)
        >>> batch, state = sampler.sample(random.key(0), sampler.init())
        >>> len(batch), len(set(batch.tolist())), state.step
        (8, 8, 1)
    """
    return FixedSize(dataset_size, batch_size, world_size, rank)
