"""k-out-of-t sampling: every example takes part in exactly k of the t steps of a declared horizon.

* ``allocation="block"``: the t steps form k equal blocks (``t % k == 0``); each example is in one uniformly
  chosen step of every block. Block j draws ``numpy_generator(fold_in(key, TAG, "block", j)).integers(0, t //
  k, N)``. Cost: O(N) per step. Accounting: exactly k compositions of 1-out-of-(t/k) random allocation.
* ``allocation="total"``: each example's k steps are a uniform k-subset of the t steps, from the ranks of
  ``numpy_generator(fold_in(key, TAG, "total", chunk))`` draws. The whole-horizon assignment is recomputed per
  step (cache-free): O(N * t) time per step, O(chunk * t) memory; for large N * t use "block". Accounting: the
  conservative block bound (Feldman & Shenfeld 2025, arXiv 2502.08202).

The horizon is accounted once as a whole (no per-step accounting, no stop-at-epsilon).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.errors import ConfigurationError, StateError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["KOutOfT", "k_out_of_t"]

TAG = "opake.sampling.k_out_of_t"
_CHUNK = 4096


@dataclass(frozen=True)
class KOutOfT:
    """k-out-of-t sampler (build it with :func:`k_out_of_t`)."""

    dataset_size: int
    k: int
    t: int
    allocation: str

    def __post_init__(self) -> None:
        validate.integer("dataset_size", self.dataset_size, minimum=1)
        validate.integer("t", self.t, minimum=1)
        validate.integer("k", self.k, minimum=1)
        # The accounting factory validates k <= t, the allocation name and block divisibility.
        acc.k_out_of_t(acc.gaussian(1.0), k=self.k, t=self.t, allocation=self.allocation)

    @property
    def expected_batch_size(self) -> float:
        return self.dataset_size * self.k / self.t

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        return (
            ("allocation", self.allocation),
            ("dataset_size", self.dataset_size),
            ("k", self.k),
            ("sampler", "k_out_of_t"),
            ("t", self.t),
        )

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def _block(self, key: Key, step: int) -> np.ndarray:
        size = self.t // self.k
        block, offset = divmod(step, size)
        choice = numpy_generator(fold_in(key, TAG, "block", block)).integers(0, size, self.dataset_size)
        return np.flatnonzero(choice == offset)

    def _total(self, key: Key, step: int) -> np.ndarray:
        found = []
        for chunk, start in enumerate(range(0, self.dataset_size, _CHUNK)):
            rows = min(_CHUNK, self.dataset_size - start)
            draws = numpy_generator(fold_in(key, TAG, "total", chunk)).random((rows, self.t))
            # An example is at ``step`` when that step's draw is among its k smallest.
            kth = np.partition(draws, self.k - 1, axis=1)[:, self.k - 1]
            found.append(start + np.flatnonzero(draws[:, step] <= kth))
        return np.concatenate(found)

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The sorted int64 indices of step ``state.step`` and the next state; StateError past the horizon."""
        state = check_state(state, self.config)
        if state.step >= self.t:
            raise StateError(
                f"the k-out-of-t horizon has t={self.t} steps and all were drawn (step {state.step}); "
                "a longer run needs a new sampler with a larger t, accounted as a new horizon."
            )
        pick = self._block if self.allocation == "block" else self._total
        return pick(key, state.step).astype(np.int64), SamplerState(state.step + 1, state.config)

    def process(self, noise_multiplier: float, steps: int | None = None) -> acc.Process:
        """The whole-horizon accounting process; ``steps`` (if given) must equal ``t``."""
        if steps is not None and steps != self.t:
            raise ConfigurationError(
                f"a k-out-of-t horizon is accounted whole: steps must equal t={self.t}, got {steps}. "
                "Declare t as the number of steps of the run."
            )
        return acc.k_out_of_t(acc.gaussian(noise_multiplier), k=self.k, t=self.t, allocation=self.allocation)


def k_out_of_t(*, dataset_size: int, k: int, t: int, allocation: str) -> KOutOfT:
    """A k-out-of-t sampler; ``allocation`` ("block" or "total") must be given explicitly.

    Example: over the horizon of 10 steps every example takes part exactly twice.

        >>> import numpy as np
        >>> from opake_core import random, sampling
        >>> sampler = sampling.k_out_of_t(dataset_size=100, k=2, t=10, allocation="block")
        >>> state, counts = sampler.init(), np.zeros(100, dtype=int)
        >>> for _ in range(10):
        ...     batch, state = sampler.sample(random.key(0), state)
        ...     counts[batch] += 1
        >>> set(counts.tolist())
        {2}
    """
    return KOutOfT(dataset_size, k, t, allocation)
