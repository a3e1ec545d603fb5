"""The privacy plan of a trainer run: sampler, noise multiplier, accountant and horizon, chosen together.

``build_plan(args, dataset_size)`` turns :class:`TrainingArguments` and the (sensitive, so not configuration)
dataset size into a :class:`PrivacyPlan`. The sampler declares the accounting process that matches it
(``sampler.process(noise_multiplier, steps)``), so the epsilon is always computed for the sampler that ran.

Batch-size contract: ``per_device_train_batch_size`` is the expected Poisson batch of one rank; the cluster batch is
that times the world size, and ``q = cluster batch / N`` is the sampling rate the accountant sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from opake_core import accounting, sampling
from opake_core.errors import ConfigurationError, PrivacyBudgetError

__all__ = ["PrivacyPlan", "build_plan", "total_steps"]


@dataclass(frozen=True)
class PrivacyPlan:
    """Everything the trainer needs to run and account a DP run.

    Attributes:
        sampler: the batch sampler (``init``/``sample``/``process``).
        noise_multiplier: resolved multiplier (0 for a non-private run).
        calibration_source: ``"fixed"`` or ``"calibrated"``.
        delta: the delta every epsilon is reported at.
        total_steps: the declared number of steps.
        expected_batch_size: the public normalizer of the clipped sum (cluster-wide).
        sample_rate: the cluster-wide sampling rate.
        stop_step: for stop-at-epsilon, the first step at which epsilon reaches the target (None otherwise).
        accounted: whether epsilon is computed and reported.
        horizon: whether the run is accounted once for its whole declared horizon.
    """

    sampler: Any
    noise_multiplier: float
    calibration_source: str
    delta: float
    total_steps: int
    expected_batch_size: float
    sample_rate: float
    stop_step: int | None
    accounted: bool
    horizon: bool

    @property
    def steps_per_epoch(self) -> float:
        return 1 / self.sample_rate

    def process(self, steps: int) -> accounting.Process:
        """The accounting process after ``steps`` steps (the whole horizon for horizon runs)."""
        return self.sampler.process(self.noise_multiplier, self.total_steps if self.horizon else steps)

    def epsilon(self, steps: int) -> float:
        """Epsilon spent after ``steps`` steps at :attr:`delta` (inf for a non-private run)."""
        if self.noise_multiplier == 0:
            return math.inf
        if steps == 0 and not self.horizon:
            return 0.0
        return accounting.epsilon(self.process(steps), delta=self.delta).value


def total_steps(args: Any, dataset_size: int) -> int:
    """``max_steps`` when set, else ``ceil(num_train_epochs * N / cluster batch)``."""
    if args.max_steps > 0:
        return args.max_steps
    return max(1, math.ceil(args.num_train_epochs * dataset_size / args.train_batch_size))


def _sampler(args: Any, dataset_size: int, steps: int) -> Any:
    mode, kwargs = args.sampling_mode, args.sampling_kwargs
    rate = args.train_batch_size / dataset_size
    if mode == "poisson":
        if rate > 1:
            raise ConfigurationError(
                f"the expected batch {args.train_batch_size} exceeds the dataset size {dataset_size}: lower "
                "per_device_train_batch_size."
            )
        return sampling.poisson(
            dataset_size=dataset_size, sample_rate=rate, truncated_batch_size=kwargs.get("truncated_batch_size")
        )
    if mode == "k_out_of_t":
        return sampling.k_out_of_t(dataset_size=dataset_size, k=kwargs["k"], t=steps, allocation=kwargs["allocation"])
    if mode == "sequential":
        return sampling.sequential(dataset_size=dataset_size, batch_size=args.train_batch_size)
    raise ConfigurationError(
        f"sampling_mode={mode!r} with privacy_noise_mechanism={args.privacy_noise_mechanism!r} is not available in "
        "this trainer yet; use privacy_noise_mechanism='gaussian' with sampling_mode='poisson'."
    )


def build_plan(args: Any, dataset_size: int) -> PrivacyPlan:
    """Resolve the sampler, delta, horizon and noise multiplier (calibrating it when a target is given)."""
    if dataset_size < 1:
        raise ConfigurationError("the training dataset is empty.")
    steps = total_steps(args, dataset_size)
    sampler = _sampler(args, dataset_size, steps)
    delta = args.privacy_target_delta or 1 / dataset_size**1.1
    horizon = args.is_complete_horizon
    target, multiplier = args.privacy_target_epsilon, args.privacy_noise_multiplier
    stop = None
    if multiplier is None:
        bounds = args.noise_calibration_kwargs
        calibrated = accounting.calibrate_noise_multiplier(
            lambda m: sampler.process(m, steps),
            target_epsilon=target,
            delta=delta,
            min=bounds["min"],
            max=bounds["max"],
            tolerance=bounds["tolerance"],
        )
        multiplier, source = float(calibrated.value), "calibrated"
    else:
        source = "fixed"
        if target is not None:
            step_process = sampler.process(multiplier, 1)
            stop = accounting.stop_step(step_process, target_epsilon=target, delta=delta, max_steps=steps + 1)
            if stop == 1 and accounting.epsilon(step_process, delta=delta).value > target:
                raise PrivacyBudgetError(
                    f"a single step at privacy_noise_multiplier={multiplier} already exceeds "
                    f"privacy_target_epsilon={target}: raise the multiplier or the target."
                )
    expected = getattr(sampler, "expected_batch_size", args.train_batch_size)
    return PrivacyPlan(
        sampler=sampler,
        noise_multiplier=multiplier,
        calibration_source=source,
        delta=delta,
        total_steps=steps,
        expected_batch_size=float(expected),
        sample_rate=expected / dataset_size,
        stop_step=stop,
        accounted=bool(args.privacy_accounting) or multiplier == 0,
        horizon=horizon,
    )
