"""What the accountant counted against what ran: steps, sampling rate, noise multiplier, and the epsilon of that.

A privacy claim is only as good as its accounting: an accountant that counts half the steps, or another rate or
multiplier than the run used, reports too small an epsilon while the noise, the clipping and every canary audit
look correct (a one-run audit tests the mechanism against the claim the auditor gives it, not the accountant's).
:func:`check_accounting` compares a claim (a :class:`~opake_core.accounting.Ledger`, or the process the accountant
composed) with observations of the run that are independent of it:

* ``steps``: how many steps ran, counted where they happen (the step calls, the noise mechanism's counter
  ``dp_state.noise.step``, the trainer's step callbacks), never read back from the accountant;
* ``release``: the process of one step as it ran, built from the sampler that drew the batches and the multiplier
  the noise was drawn with (``sampler.process(z, 1)``);
* optionally ``sampler``: drawn again with an audit key, its empirical inclusion rate is tested against the rate of
  every claimed release (:func:`opake_core.testing.check_sampling_rate`, exact binomial test).

It flags a count that differs, a claimed release that is not the observed one, a rate test that fails, or a claimed
epsilon below the epsilon of ``steps`` observed releases (recomputed by dp-accounting through
:func:`opake_core.accounting.epsilon`). The first two and the last are deterministic; the rate test has the
false-alarm rate ``alpha``.

Scope: per-step releases (DP-SGD: Poisson, truncated Poisson, sampling without replacement). A whole-horizon claim
(DP-FTRL, k-out-of-t) is one release for its declared horizon and is refused here; the step that runs past its
horizon raises instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from opake_core import accounting, validate
from opake_core.accounting.processes import releases
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.random import Key
from opake_core.testing import SamplingReport, check_sampling_rate, process_rate

__all__ = ["AccountingReport", "check_accounting", "claimed_releases"]

EPSILON_RTOL = 1e-6
"""Relative slack of the epsilon comparison: the same composition accounted twice agrees far closer than this."""
_HORIZON = (accounting.RandomAllocation, accounting.BallsInBinsMF, accounting.BMinSepMF)
_INCLUSIONS = 10_000
"""Expected inclusions of the default rate test: a 10% rate error then gives a p-value far below 1e-3."""


@dataclass(frozen=True)
class AccountingReport:
    """The claim against the run.

    Attributes:
        steps: the steps that ran (observed).
        claimed_steps: the releases the claim composes.
        release: the observed process of one step.
        mismatched: the claimed per-step processes that are not ``release`` (each once).
        sampling: the rate tests of the sampler, one per distinct claimed rate (empty without a sampler).
        observed_epsilon: epsilon of ``steps`` observed releases at ``delta``.
        claimed_epsilon: the epsilon the run reported (or the claim's own, when none was given).
        delta: the delta of both.
    """

    steps: int
    claimed_steps: int
    release: Any
    mismatched: tuple[Any, ...]
    sampling: tuple[SamplingReport, ...]
    observed_epsilon: float
    claimed_epsilon: float
    delta: float

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the claim does not cover the run (empty when it does)."""
        out = []
        if self.claimed_steps != self.steps:
            out.append(f"the accountant counted {self.claimed_steps} releases, {self.steps} steps ran")
        if self.mismatched:
            out.append(f"claimed releases {list(self.mismatched)} differ from the run's {self.release}")
        for test in self.sampling:
            if not test.passed:
                out.append(
                    f"the sampler includes examples at rate {test.empirical_rate:.5g}, the accountant assumes "
                    f"{test.accounted_rate:.5g} (binomial p={test.p_value:.3g} < {test.alpha:.3g})"
                )
        if self.claimed_epsilon < self.observed_epsilon * (1 - EPSILON_RTOL):
            out.append(
                f"the claimed epsilon {self.claimed_epsilon:.6g} is below {self.observed_epsilon:.6g}, the epsilon "
                f"of the {self.steps} steps that ran"
            )
        return tuple(out)

    @property
    def flagged(self) -> bool:
        """Whether the claim misses something that ran (see :attr:`reasons`)."""
        return bool(self.reasons)


def claimed_releases(claim: accounting.Ledger | Any) -> list[tuple[Any, int]]:
    """``[(single release, count), ...]`` of a ledger or a process, in order (repeats and compositions expanded)."""
    if isinstance(claim, accounting.Ledger):
        return [(p, n * m) for process, n in claim.entries for p, m in claimed_releases(process)]
    if isinstance(claim, accounting.Repeat):
        return [(p, n * claim.count) for p, n in claimed_releases(claim.process)]
    if isinstance(claim, accounting.Compose):
        return [pair for part in claim.processes for pair in claimed_releases(part)]
    return [(claim, 1)]


def check_accounting(
    claim: accounting.Ledger | Any,
    *,
    steps: int,
    release: Any,
    delta: float,
    claimed_epsilon: float | None = None,
    sampler: Any = None,
    key: Key | None = None,
    sampler_steps: int | None = None,
    alpha: float = 1e-3,
) -> AccountingReport:
    """Compare a privacy claim with the steps that ran (module docstring).

    Args:
        claim: the accountant's history: a :class:`~opake_core.accounting.Ledger` or a process (``sampler.process(z,
            T)``, ``compose(...)``).
        steps: how many steps ran, counted independently of the accountant.
        release: the process of one step as it ran (``sampler.process(z, 1)`` with the sampler that drew the
            batches and the multiplier the noise used).
        delta: the delta of both epsilons.
        claimed_epsilon: the epsilon the run reported (default: the claim's own at ``delta``).
        sampler: the sampler that drew the batches; its rate is tested when given (with ``key``, an audit key: the
            sampler is a pure function of key and state, so any key tests its distribution).
        key: the key of the rate test's draws.
        sampler_steps: draws of the rate test (default: enough for 10,000 expected inclusions).
        alpha: the rate test's false-alarm rate (Bonferroni over the distinct claimed rates).

    Returns:
        An :class:`AccountingReport`.
    """
    steps = validate.integer("steps", steps, minimum=0)
    delta = validate.delta("delta", delta)
    if any(isinstance(part, _HORIZON) for part in releases(release)) or (
        isinstance(release, accounting.Repeat | accounting.Compose)
    ):
        raise ConfigurationError(
            f"check_accounting compares per-step releases; got {type(release).__name__} as the release of one step. "
            "A whole-horizon claim (DP-FTRL, k-out-of-t) is accounted once for its declared horizon: check that the "
            "steps ran stay within it."
        )
    pairs = claimed_releases(claim)
    claimed_steps = sum(n for _, n in pairs)
    mismatched = tuple(dict.fromkeys(p for p, _ in pairs if p != release))
    sampling = _rate_tests(pairs, sampler, key, sampler_steps, alpha)
    observed = _epsilon(accounting.repeat(release, steps), delta) if steps else 0.0
    if claimed_epsilon is None:
        whole = claim if isinstance(claim, accounting.Ledger) else accounting.Ledger(((claim, 1),))
        claimed_epsilon = whole.epsilon(delta=delta).value
    claimed_epsilon = float(claimed_epsilon)
    if math.isnan(claimed_epsilon):
        raise ConfigurationError("claimed_epsilon is NaN; pass the epsilon the run reported.")
    return AccountingReport(
        steps, claimed_steps, release, mismatched, sampling, float(observed), claimed_epsilon, delta
    )


@functools.lru_cache(maxsize=64)
def _epsilon(process: Any, delta: float) -> float:
    """Epsilon of ``process`` at ``delta``, computed once per process: a PLD composition takes about a second, and an
    audit over several seeds recomputes the same one."""
    return accounting.epsilon(process, delta=delta).value


def _rate_tests(
    pairs: list[tuple[Any, int]], sampler: Any, key: Key | None, sampler_steps: int | None, alpha: float
) -> tuple[SamplingReport, ...]:
    if sampler is None:
        return ()
    if not isinstance(key, Key):
        raise InputTypeError(f"the rate test needs key=opake_core.random.key(seed), got {type(key).__name__}.")
    rates = sorted({rate for rate in (process_rate(p) for p, _ in pairs) if rate is not None})
    if sampler_steps is None:
        expected = float(sampler.expected_batch_size)
        sampler_steps = max(1, math.ceil(_INCLUSIONS / expected)) if expected > 0 else 1
    return tuple(
        check_sampling_rate(sampler, key=key, steps=sampler_steps, accounted=rate, alpha=alpha / len(rates))
        for rate in rates
    )
