"""Poisson sampling, optionally truncated, optionally sharded over data-parallel ranks: each example is in a step's
batch independently with rate q.

Step ``s`` draws from ``numpy_generator(fold_in(key, "opake.sampling.poisson", s))`` only, so a batch depends
on (key, step) alone and replays exactly on resume. Empty batches are returned (and count as steps), never
skipped. With ``truncated_batch_size`` B, a draw larger than B keeps a uniform subset of exactly B; it is
accounted with dp-accounting's truncated analysis (Ganesh 2025, arXiv 2508.15089), never as plain Poisson.
Cost: O(N) per step.

With ``world_size`` W > 1 (data-parallel training), rank ``r`` owns the strided shard ``r, r + W, r + 2W, ...`` and
samples it at the same global rate q from the key ``fold_in(key, RANK_TAG, r)`` (then per step as above, over the
shard). The shards are disjoint and cover the dataset and the ranks' keys differ, so the union over ranks is exactly
Poisson(q) over the whole dataset: ``dataset_size``, ``sample_rate``, :attr:`Poisson.expected_batch_size` and
:meth:`Poisson.process` are the global ones, and the accountant sees the cluster-wide rate. Cost: O(N / W) per step
and rank. The configuration records ``world_size`` but not ``rank``, so every rank resumes from rank 0's checkpoint.
Truncation is refused there: a per-rank cap is not the global cap the truncated analysis assumes.

With ``sharding="global"`` (parallel Poisson sampling) rank ``r`` instead draws from the whole dataset, at its own
rate ``q_r = sample_rate``, from the same rank key. The ranks draw independently, so a record can be in several
ranks' batches: it is drawn by ``J ~ Binomial(W, q_r)`` of them, and the sum of the ranks' clipped sums moves by up to
``J C`` when it is removed. That is a group of ``W`` records under Poisson sampling at ``q_r``, and
:meth:`Poisson.process` is :func:`opake_core.accounting.poisson_group` with ``group_size=W``
(:mod:`opake_core.accounting.group`). The expected union batch, counting a record once per rank that drew it, is
``W N q_r``: the public normalizer. Cost: O(N) per step and rank. Per rank the sharded mode is cheaper and, at the same
expected union batch, more private (``Poisson(W q_r)`` against a group of ``W`` at ``q_r``); the global mode exists
for parity with libraries whose ranks sample independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["Poisson", "poisson"]

TAG = "opake.sampling.poisson"
RANK_TAG = "rank"
"""Rank ``r`` of ``world_size > 1`` draws from ``fold_in(key, RANK_TAG, r)``."""
SHARDINGS = ("per_rank", "global")
"""How ranks split a step's sample: disjoint strided shards at the global rate, or each the whole dataset."""


@dataclass(frozen=True)
class Poisson:
    """Poisson sampler over ``dataset_size`` examples at ``sample_rate`` (build it with :func:`poisson`).

    With ``world_size > 1`` it is rank ``rank``'s sampler of its strided shard (see the module docstring);
    ``dataset_size``, ``sample_rate``, :attr:`expected_batch_size` and :meth:`process` stay the global ones. With
    ``sharding="global"``, ``sample_rate`` is each rank's rate over the whole dataset and :meth:`process` is that of a
    group of ``world_size`` records.
    """

    dataset_size: int
    sample_rate: float
    truncated_batch_size: int | None = None
    world_size: int = 1
    rank: int = 0
    sharding: str = "per_rank"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset_size", validate.integer("dataset_size", self.dataset_size, minimum=1))
        object.__setattr__(self, "sample_rate", validate.rate("sample_rate", self.sample_rate))
        if self.truncated_batch_size is not None:
            cap = validate.integer("truncated_batch_size", self.truncated_batch_size, minimum=1)
            object.__setattr__(self, "truncated_batch_size", cap)
        world = validate.integer("world_size", self.world_size, minimum=1)
        rank = validate.integer("rank", self.rank, minimum=0)
        object.__setattr__(self, "world_size", world)
        object.__setattr__(self, "rank", rank)
        if rank >= world:
            raise ConfigurationError(f"rank must be in [0, world_size={world}), got rank={rank}.")
        if self.sharding not in SHARDINGS:
            raise ConfigurationError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}.")
        if world == 1:
            if self.sharding == "global":
                raise ConfigurationError(
                    "sharding='global' is parallel Poisson sampling over data-parallel ranks, got world_size=1: "
                    "with one rank it is the plain sampler. Drop sharding, or pass world_size and rank."
                )
            return
        if self.truncated_batch_size is not None:
            raise ConfigurationError(
                f"truncated Poisson sampling is not supported with world_size={world} > 1 (DDP): a per-rank cap is "
                "not the global cap the accountant analyses. Drop truncated_batch_size (the trainer's "
                "sampling_kwargs['truncated_batch_size'])."
            )
        if self.sharding == "per_rank" and self.dataset_size < world:
            raise ConfigurationError(
                f"dataset_size={self.dataset_size} is smaller than world_size={world}: some rank would own no "
                "example. Use fewer ranks."
            )

    @property
    def expected_batch_size(self) -> float:
        """N * q before truncation (the global N under ``world_size > 1``; ``W N q_r`` with ``sharding="global"``,
        a record counted once per rank that drew it): the public normalizer of the clipped sum."""
        ranks = self.world_size if self.sharding == "global" else 1
        return ranks * self.dataset_size * self.sample_rate

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        """The configuration a state is checked against; ``world_size`` only when > 1, ``sharding`` only when global,
        never ``rank``."""
        config = (
            ("dataset_size", self.dataset_size),
            ("sample_rate", self.sample_rate),
            ("sampler", "poisson"),
            ("truncated_batch_size", self.truncated_batch_size),
        )
        if self.world_size > 1:
            config = (*config, ("world_size", self.world_size))
        return config if self.sharding == "per_rank" else (*config, ("sharding", self.sharding))

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def shard(self, rank: int | None = None) -> np.ndarray:
        """The int64 dataset indices owned by ``rank`` (default: this sampler's rank): ``rank, rank + W, ...``; every
        index with ``sharding="global"``."""
        r = self._rank(rank)
        if self.sharding == "global":
            return np.arange(self.dataset_size, dtype=np.int64)
        return np.arange(r, self.dataset_size, self.world_size, dtype=np.int64)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The sorted int64 indices of step ``state.step`` (this rank's when ``world_size > 1``) and the next state."""
        return self.sample_rank(key, state, self.rank)

    def sample_rank(self, key: Key, state: SamplerState, rank: int) -> tuple[np.ndarray, SamplerState]:
        """Rank ``rank``'s draw of step ``state.step`` (any rank can be replayed, e.g. to rebuild the union batch)."""
        state = check_state(state, self.config)
        r = self._rank(rank)
        if self.world_size > 1:
            key = fold_in(key, RANK_TAG, r)
        shard = self.shard(r)
        gen = numpy_generator(fold_in(key, TAG, state.step))
        picked = np.flatnonzero(gen.random(len(shard)) < self.sample_rate)
        cap = self.truncated_batch_size
        if cap is not None and len(picked) > cap:
            picked = np.sort(gen.choice(picked, size=cap, replace=False))
        return shard[picked], SamplerState(state.step + 1, state.config)

    def process(self, noise_multiplier: float, steps: int) -> acc.Process:
        """The accounting process of ``steps`` steps of DP-SGD with this sampler (the union over ranks)."""
        mechanism = acc.gaussian(noise_multiplier)
        if self.sharding == "global":
            return acc.repeat(acc.poisson_group(mechanism, self.sample_rate, group_size=self.world_size), steps)
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

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            return self.rank
        rank = validate.integer("rank", rank, minimum=0)
        if rank >= self.world_size:
            raise ConfigurationError(f"rank must be in [0, world_size={self.world_size}), got rank={rank}.")
        return rank


def poisson(
    *,
    dataset_size: int,
    sample_rate: float,
    truncated_batch_size: int | None = None,
    world_size: int = 1,
    rank: int = 0,
    sharding: str = "per_rank",
) -> Poisson:
    """A Poisson sampler (truncated at ``truncated_batch_size`` when given).

    With ``world_size > 1``: rank ``rank``'s sampler of the strided shard ``rank, rank + world_size, ...`` at the
    global rate; the union over ranks is Poisson(``sample_rate``) over all ``dataset_size`` examples. With
    ``sharding="global"`` as well: rank ``rank``'s draw of the whole dataset at its own rate ``sample_rate``,
    accounted as a group of ``world_size`` records (module docstring).

    Example: the batch size varies around ``N q``; a state replays its draw, and two ranks' draws are disjoint.

        >>> import numpy as np
        >>> from opake_core import random, sampling
        >>> sampler, key = sampling.poisson(dataset_size=1_000, sample_rate=0.05), random.key(0)
        >>> state, sizes = sampler.init(), []
        >>> for _ in range(200):
        ...     batch, state = sampler.sample(key, state)
        ...     sizes.append(len(batch))
        >>> sampler.expected_batch_size, bool(abs(np.mean(sizes) - 50) < 2)
        (50.0, True)
        >>> np.array_equal(sampler.sample(key, sampler.init())[0], sampler.sample(key, sampler.init())[0])
        True
        >>> ranks = [sampling.poisson(dataset_size=1_000, sample_rate=0.05, world_size=2, rank=r) for r in (0, 1)]
        >>> a, b = (r.sample(key, r.init())[0] for r in ranks)
        >>> len(np.intersect1d(a, b)), int(a[0] % 2), int(b[0] % 2)
        (0, 0, 1)

    With ``sharding="global"`` each rank draws from all 1,000 at its own rate; the union is accounted as a group.

        >>> ranks = [sampling.poisson(dataset_size=1_000, sample_rate=0.05, world_size=2, rank=r, sharding="global")
        ...          for r in (0, 1)]
        >>> ranks[0].expected_batch_size, ranks[0].process(1.0, 1).process.group_size
        (100.0, 2)
    """
    return Poisson(dataset_size, sample_rate, truncated_batch_size, world_size, rank, sharding)
