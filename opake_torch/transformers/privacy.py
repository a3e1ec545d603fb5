"""The privacy plan of a trainer run: sampler, mechanism, clipping rule, noise multiplier and accountant, chosen
together.

``build_plan(args, dataset_size)`` turns :class:`TrainingArguments` and the (sensitive, so not configuration)
dataset size into a :class:`PrivacyPlan`. The accounting process always comes from the sampler that runs
(``sampler.process``), so the epsilon is computed for exactly the sampling, noise and clipping of the run:

* DP-SGD (``gaussian``): Poisson (optionally truncated), k-out-of-t or sequential; adaptive clipping adds its noisy
  count release to every step (``accounting.adaptive_clipping``).
* DP-FTRL (``mf_*``): the strategy is optimized once for the horizon and the sampler's participation pattern, and
  the whole horizon is accounted as one process (``accounting.mf_process``); every reported epsilon is that
  full-horizon value.

Batch-size contract: ``per_device_train_batch_size`` is the expected batch of one rank; the cluster batch is that
times the world size, and ``q = cluster batch / N`` is the sampling rate the accountant sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opake_core import accounting, mf, sampling
from opake_core.clipping import adaptive, auto_s
from opake_core.errors import ConfigurationError, PrivacyBudgetError

__all__ = ["PrivacyPlan", "build_plan", "clipping_rule", "total_steps"]

ADAPTIVE_COUNT_NOISE = 0.05  # Andrew et al. 2021: count noise std = expected batch / 20
STRATEGIES: dict[str, Callable[..., Any]] = {
    "mf_band": mf.band_mf,
    "mf_blt": mf.blt,
    "mf_bisr": mf.bisr,
    "mf_bsr": mf.bsr,
    "mf_lambda_cgd": mf.lambda_cgd,
    "mf_identity": mf.identity,
}


@dataclass(frozen=True)
class PrivacyPlan:
    """Everything the trainer needs to run and account a DP run.

    Attributes:
        sampler: the batch sampler (``init``/``sample``/``process``).
        make_process: ``(noise_multiplier, steps) -> process``, the accounting of ``steps`` steps of this run.
        noise_multiplier: resolved multiplier (0 for a non-private run).
        calibration_source: ``"fixed"`` or ``"calibrated"``.
        delta: the delta every epsilon is reported at.
        total_steps: the declared number of steps.
        expected_batch_size: the public normalizer of the clipped sum (cluster-wide).
        sample_rate: the cluster-wide fraction of the dataset per step.
        stop_step: for stop-at-epsilon, the first step at which epsilon reaches the target (None otherwise).
        accounted: whether epsilon is computed and reported.
        horizon: whether the run is accounted once for its whole declared horizon.
        strategy: the optimized DP-FTRL strategy (None for DP-SGD).
    """

    sampler: Any
    make_process: Callable[[float, int], Any]
    noise_multiplier: float
    calibration_source: str
    delta: float
    total_steps: int
    expected_batch_size: float
    sample_rate: float
    stop_step: int | None
    accounted: bool
    horizon: bool
    strategy: Any = None
    _epsilons: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def steps_per_epoch(self) -> float:
        return 1 / self.sample_rate

    def process(self, steps: int) -> Any:
        """The accounting process after ``steps`` steps (the whole horizon for horizon runs)."""
        return self.make_process(self.noise_multiplier, self.total_steps if self.horizon else steps)

    def epsilon(self, steps: int) -> float:
        """Epsilon spent after ``steps`` steps at :attr:`delta` (inf for a non-private run)."""
        if self.noise_multiplier == 0:
            return math.inf
        if steps == 0 and not self.horizon:
            return 0.0
        steps = self.total_steps if self.horizon else steps  # a horizon run reports one full-horizon value
        if steps not in self._epsilons:  # a PLD or Monte Carlo query: computed once per step count
            self._epsilons[steps] = accounting.mf_epsilon(self.process(steps), delta=self.delta).value
        return self._epsilons[steps]


def total_steps(args: Any, dataset_size: int) -> int:
    """``max_steps`` when set, else ``ceil(num_train_epochs * N / cluster batch)``."""
    if args.max_steps > 0:
        return args.max_steps
    return max(1, math.ceil(args.num_train_epochs * dataset_size / args.train_batch_size))


def clipping_rule(args: Any) -> Any:
    """The core clipping rule for ``clipping_mode``: the bound, ``auto_s`` or ``adaptive`` (per-group: a dict)."""
    kwargs = args.clipping_kwargs
    if args.clipping_mode == "auto":
        return auto_s(args.clipping_norm, gamma=kwargs.get("gamma", 0.01))
    if args.clipping_mode == "adaptive":
        return adaptive(
            args.clipping_norm,
            target_quantile=kwargs.get("target_quantile", 0.5),
            clipping_norm_max=kwargs.get("clipping_norm_max", 1e3),
            count_noise_fraction=ADAPTIVE_COUNT_NOISE,
        )
    return args.clipping_norm


def _sampler(args: Any, dataset_size: int, steps: int) -> Any:
    mode, kwargs = args.sampling_mode, args.sampling_kwargs
    batch = args.train_batch_size
    rate = batch / dataset_size
    if rate > 1:
        raise ConfigurationError(
            f"the expected batch {batch} exceeds the dataset size {dataset_size}: lower per_device_train_batch_size."
        )
    if args.world_size > 1:
        return _rank_sampler(args, dataset_size, rate)
    if mode == "poisson":
        cap = kwargs.get("truncated_batch_size")
        return sampling.poisson(dataset_size=dataset_size, sample_rate=rate, truncated_batch_size=cap)
    if mode == "k_out_of_t":
        return sampling.k_out_of_t(dataset_size=dataset_size, k=kwargs["k"], t=steps, allocation=kwargs["allocation"])
    if mode == "sequential":
        return sampling.sequential(dataset_size=dataset_size, batch_size=batch)
    if mode == "cyclic_poisson":
        bands = args.privacy_noise_mechanism_kwargs["bands"]
        return sampling.cyclic_poisson(dataset_size=dataset_size, sample_rate=rate, bands=bands)
    if mode == "b_min_sep":
        bands = args.privacy_noise_mechanism_kwargs["bands"]
        return sampling.b_min_sep(dataset_size=dataset_size, sample_rate=rate, min_sep=bands)
    if mode == "balls_in_bins":
        bins = max(1, round(dataset_size / batch))
        if steps % bins:
            raise ConfigurationError(
                f"balls_in_bins needs a whole number of epochs: {steps} steps is not a multiple of {bins} bins "
                f"(dataset size / batch). Set max_steps to a multiple of {bins}."
            )
        return sampling.balls_in_bins(dataset_size=dataset_size, num_bins=bins)
    raise ConfigurationError(f"sampling_mode={mode!r} is not supported by the trainer.")


DDP_SAMPLING_MODES = ("poisson", "cyclic_poisson")


def _rank_sampler(args: Any, dataset_size: int, rate: float) -> Any:
    """Under DDP: this rank's sampler at the global rate (the accountant sees the cluster-wide rate)."""
    from opake_torch.distributed import rank_poisson

    mode, world, rank = args.sampling_mode, args.world_size, args.process_index
    if mode == "poisson":
        if args.sampling_kwargs.get("truncated_batch_size") is not None:
            raise ConfigurationError(
                "truncated Poisson sampling is not supported under DDP (world_size > 1): a per-rank cap is not the "
                "global cap the accountant analyses. Drop sampling_kwargs['truncated_batch_size']."
            )
        return rank_poisson(dataset_size=dataset_size, sample_rate=rate, world_size=world, rank=rank)
    if mode == "cyclic_poisson":
        bands = args.privacy_noise_mechanism_kwargs["bands"]
        return sampling.cyclic_poisson(
            dataset_size=dataset_size, sample_rate=rate, bands=bands, world_size=world, rank=rank
        )
    raise ConfigurationError(
        f"sampling_mode={mode!r} is not supported under DDP (world_size={world}); use one of {DDP_SAMPLING_MODES}, "
        "whose per-rank shards are sampled independently so the union is the sampler the accountant analyses."
    )


def _strategy(args: Any, sampler: Any, steps: int) -> Any:
    kwargs = {k: v for k, v in args.privacy_noise_mechanism_kwargs.items() if k != "compute_dtype"}
    spec = STRATEGIES[args.privacy_noise_mechanism](**kwargs)
    if args.privacy_noise_mechanism == "mf_band" and kwargs.get("bands", 1) > steps:
        raise ConfigurationError(
            f"mf_band needs bands <= total steps, got bands={kwargs['bands']} for {steps} steps; lower bands."
        )
    participation = (
        accounting.sampler_participation(sampler) if args.sampling_mode != "poisson" else mf.SingleParticipation()
    )
    return mf.optimize(spec, steps, participation=participation)


def _process_maker(args: Any, sampler: Any, strategy: Any) -> Callable[[float, int], Any]:
    if strategy is not None:
        return lambda z, steps: accounting.mf_process(strategy, sampler=sampler, noise_multiplier=z, n_steps=steps)
    if args.clipping_mode != "adaptive":
        return sampler.process
    if not isinstance(sampler, sampling.Poisson) or sampler.truncated_batch_size is not None:
        raise ConfigurationError(
            "clipping_mode='adaptive' is accounted for plain Poisson sampling only; use sampling_mode='poisson' "
            "without truncation, or clipping_mode='fixed'."
        )

    def make(z: float, steps: int) -> Any:
        step = accounting.adaptive_clipping(
            accounting.gaussian(z),
            count_noise_fraction=ADAPTIVE_COUNT_NOISE,
            expected_batch_size=sampler.expected_batch_size,
        )
        return accounting.repeat(accounting.poisson(step, sampler.sample_rate), steps)

    return make


def build_plan(args: Any, dataset_size: int) -> PrivacyPlan:
    """Resolve sampler, mechanism, delta, horizon and noise multiplier (calibrating it when a target is given)."""
    if dataset_size < 1:
        raise ConfigurationError("the training dataset is empty.")
    steps = total_steps(args, dataset_size)
    sampler = _sampler(args, dataset_size, steps)
    strategy = _strategy(args, sampler, steps) if args.privacy_noise_mechanism != "gaussian" else None
    make_process = _process_maker(args, sampler, strategy)
    delta = args.privacy_target_delta or 1 / dataset_size**1.1
    target, multiplier = args.privacy_target_epsilon, args.privacy_noise_multiplier
    stop = None
    if multiplier is None:
        bounds = args.noise_calibration_kwargs
        calibrated = accounting.calibrate_mf_noise_multiplier(
            lambda z: make_process(z, steps),
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
            step_process = make_process(multiplier, 1)
            stop = accounting.stop_step(step_process, target_epsilon=target, delta=delta, max_steps=steps + 1)
            if stop == 1 and accounting.epsilon(step_process, delta=delta).value > target:
                raise PrivacyBudgetError(
                    f"a single step at privacy_noise_multiplier={multiplier} already exceeds "
                    f"privacy_target_epsilon={target}: raise the multiplier or the target."
                )
    expected = float(getattr(sampler, "expected_batch_size", args.train_batch_size))
    return PrivacyPlan(
        sampler=sampler,
        make_process=make_process,
        noise_multiplier=multiplier,
        calibration_source=source,
        delta=delta,
        total_steps=steps,
        expected_batch_size=expected,
        sample_rate=expected / dataset_size,
        stop_step=stop,
        accounted=bool(args.privacy_accounting) or multiplier == 0,
        horizon=args.is_complete_horizon,
        strategy=strategy,
    )
