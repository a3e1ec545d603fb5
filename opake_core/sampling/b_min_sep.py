"""b-min-sep sampling (Dong and Ganesh 2026, arXiv 2602.09338): Poisson among the examples that did not take part
in the previous ``min_sep - 1`` steps.

Every example runs its own Markov chain on a cooldown ``d``: it is eligible when ``d = 0``, joins the step with
probability ``p`` when eligible, and then waits ``min_sep - 1`` steps (``d <- min_sep - 1``; otherwise ``d <- max(d -
1, 0)``). Two participations of one example are therefore at least ``min_sep`` steps apart. The chain starts from
its stationary distribution (warm start): ``d = 0`` with probability ``1 / (1 + (b - 1) p)``, else uniform in ``{1,
..., b - 1}``, so the expected batch is ``N * sample_rate`` from step 0, with ``sample_rate = p / (1 + (b - 1) p)``.

``sample_rate`` keeps the trainer's meaning (expected batch / N); the within-eligible probability is ``p =
sample_rate / (1 - (b - 1) * sample_rate)``, which needs ``sample_rate <= 1 / min_sep`` (``p <= 1``). ``min_sep = 1``
is Poisson; ``p = 1`` is balls-in-bins with ``min_sep`` bins.

Draws: the warm start comes from ``numpy_generator(fold_in(key, TAG, "warm_start"))`` and step ``t`` from
``numpy_generator(fold_in(key, TAG, t))``. The batch of step ``t`` depends on the whole history, so the state carries
the cooldown vector (``SamplerState.carry``, uint16 little-endian in base64, 2 bytes per example): every step costs
O(N) and a resumed run continues from its saved state. A state without a carry (built by hand at step ``t``) replays
from step 0, O(N * t). Accounting: Monte Carlo (:func:`opake_core.accounting.mf_process`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from opake_core import accounting as acc
from opake_core import validate
from opake_core.errors import ConfigurationError, StateError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.sampling.state import SamplerState, check_state

__all__ = ["BMinSep", "b_min_sep"]

TAG = "opake.sampling.b_min_sep"


@dataclass(frozen=True)
class BMinSep:
    """b-min-sep sampler (build it with :func:`b_min_sep`)."""

    dataset_size: int
    sample_rate: float
    min_sep: int

    def __post_init__(self) -> None:
        validate.integer("dataset_size", self.dataset_size, minimum=1)
        object.__setattr__(self, "sample_rate", validate.rate("sample_rate", self.sample_rate))
        if validate.integer("min_sep", self.min_sep, minimum=1) > 1 << 16:
            raise ConfigurationError(f"min_sep must be at most {1 << 16}, got {self.min_sep}.")
        if self.sample_rate * self.min_sep > 1.0 + 1e-12:
            raise ConfigurationError(
                f"b_min_sep with min_sep={self.min_sep} reaches at most sample_rate = 1 / min_sep = "
                f"{1 / self.min_sep:.6g} (every eligible example taken), got {self.sample_rate}; lower the sample "
                "rate or min_sep."
            )

    @property
    def sampling_prob(self) -> float:
        """``p``: the probability that an eligible example joins a step."""
        p = self.sample_rate / (1.0 - (self.min_sep - 1) * self.sample_rate)
        return min(p, 1.0)

    @property
    def expected_batch_size(self) -> float:
        """``N * sample_rate`` (constant from step 0 thanks to the warm start)."""
        return self.dataset_size * self.sample_rate

    @property
    def config(self) -> tuple[tuple[str, object], ...]:
        return (
            ("dataset_size", self.dataset_size),
            ("min_sep", self.min_sep),
            ("sample_rate", self.sample_rate),
            ("sampler", "b_min_sep"),
        )

    def init(self) -> SamplerState:
        return SamplerState(0, self.config)

    def _warm_start(self, key: Key) -> np.ndarray:
        b, p, n = self.min_sep, self.sampling_prob, self.dataset_size
        gen = numpy_generator(fold_in(key, TAG, "warm_start"))
        eligible = gen.random(n) < 1.0 / (1.0 + (b - 1) * p)
        waiting = gen.integers(1, b, n) if b > 1 else np.zeros(n, dtype=np.int64)
        return np.where(eligible, 0, waiting).astype(np.int64)

    def _step(self, key: Key, step: int, cooldown: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        chosen = (cooldown == 0) & (
            numpy_generator(fold_in(key, TAG, step)).random(self.dataset_size) < self.sampling_prob
        )
        return np.flatnonzero(chosen).astype(np.int64), np.where(chosen, self.min_sep - 1, np.maximum(cooldown - 1, 0))

    def _cooldown(self, key: Key, state: SamplerState) -> np.ndarray:
        if state.carry is not None:
            cooldown = np.frombuffer(base64.b64decode(state.carry), dtype="<u2").astype(np.int64)
            if cooldown.shape != (self.dataset_size,):
                raise StateError(
                    f"a b-min-sep state carries {cooldown.size} cooldowns for {self.dataset_size} examples."
                )
            return cooldown
        cooldown = self._warm_start(key)
        for t in range(state.step):
            cooldown = self._step(key, t, cooldown)[1]
        return cooldown

    def sample(self, key: Key, state: SamplerState) -> tuple[np.ndarray, SamplerState]:
        """The sorted int64 indices of step ``state.step`` and the state of the next step."""
        state = check_state(state, self.config)
        indices, cooldown = self._step(key, state.step, self._cooldown(key, state))
        carry = base64.b64encode(cooldown.astype("<u2").tobytes()).decode("ascii")
        return indices, SamplerState(state.step + 1, state.config, carry)

    def process(self, noise_multiplier: float, steps: int, *, strategy: Any, **options: Any) -> Any:
        """The whole-horizon process of ``strategy`` with this sampler (:func:`opake_core.accounting.mf_process`)."""
        return acc.mf_process(strategy, sampler=self, noise_multiplier=noise_multiplier, n_steps=steps, **options)


def b_min_sep(*, dataset_size: int, sample_rate: float, min_sep: int) -> BMinSep:
    """A b-min-sep sampler; ``sample_rate`` is the expected batch / N (at most ``1 / min_sep``).

    Example: an example takes part at most once in any ``min_sep`` consecutive steps.

        >>> from opake_core import random, sampling
        >>> sampler = sampling.b_min_sep(dataset_size=1_000, sample_rate=0.05, min_sep=4)
        >>> state, last, gaps = sampler.init(), {}, []
        >>> for step in range(40):
        ...     batch, state = sampler.sample(random.key(0), state)
        ...     gaps += [step - last[i] for i in batch.tolist() if i in last]
        ...     last.update(dict.fromkeys(batch.tolist(), step))
        >>> min(gaps)
        4
    """
    return BMinSep(dataset_size, sample_rate, min_sep)
