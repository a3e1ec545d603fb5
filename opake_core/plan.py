"""The privacy plan: sampler, mechanism, clipping, budget and horizon, chosen and validated together.

A DP run is private only for a matching triple of sampler, noise mechanism and accountant, so the combination is
validated in one place, :func:`plan`, which researchers composing core steps and the trainer call alike:

* the mechanism (``"gaussian"``, DP-SGD, or an :mod:`opake_core.mf` strategy, DP-FTRL) must have an accountant for
  the sampler (:data:`SAMPLERS`); a pair without one is refused with the samplers that work;
* adaptive clipping releases a noisy count, accounted with plain Poisson sampling only (Andrew et al. 2021);
* a sequential order gives no amplification: it is allowed for a non-private run (multiplier 0) only;
* a **horizon** run (DP-FTRL, k-out-of-t) is accounted once for its declared ``steps``, so it has no stop-at-epsilon
  and its strategy is optimized here for the horizon and the sampler's participation pattern;
* a **per-step** run (DP-SGD with Poisson sampling) is accounted step by step in a
  :class:`~opake_core.accounting.Ledger`: a target epsilon is the total over that history, the remaining steps are
  calibrated against what is left, and a fixed multiplier stops at the last step within the target.

:func:`plan` returns a frozen :class:`Plan`: the optimized strategy, the release (what one step, or the whole
horizon, releases at the resolved multiplier), the multiplier and how it was obtained, the stop step, and the public
normalizer of the clipped sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opake_core import accounting, mf, validate
from opake_core.accounting.processes import Repeat
from opake_core.clipping import AdaptiveRule
from opake_core.errors import CalibrationError, ConfigurationError, PrivacyBudgetError

__all__ = ["SAMPLERS", "Plan", "check_combination", "is_horizon", "plan"]

SAMPLERS: dict[str, tuple[str, ...]] = {
    "gaussian": ("poisson", "k_out_of_t", "fixed_size", "sequential"),
    **accounting.COMPATIBLE_SAMPLERS,
}
"""Mechanism name -> the samplers it has an accountant with (the first is the usual one)."""
HORIZON_SAMPLERS = ("k_out_of_t",)


def is_horizon(mechanism: str, sampler: str) -> bool:
    """Whether ``mechanism`` with ``sampler`` is accounted once for its whole horizon (DP-FTRL, k-out-of-t).

    Example:

        >>> from opake_core import plan
        >>> plan.is_horizon("gaussian", "poisson"), plan.is_horizon("gaussian", "k_out_of_t"), plan.is_horizon(
        ...     "mf_band", "cyclic_poisson")
        (False, True, True)
    """
    return mechanism != "gaussian" or sampler in HORIZON_SAMPLERS


def check_combination(
    *, mechanism: str, sampler: str, adaptive_clipping: bool, noise_multiplier: float | None, target: float | None
) -> None:
    """Refuse, by name, a mechanism / sampler / clipping / budget combination that has no correct accountant.

    ``mechanism`` is ``"gaussian"`` or an ``mf_*`` name, ``sampler`` a sampler name (``"poisson"``, ...),
    ``noise_multiplier`` the fixed multiplier (None: calibrated to ``target``).

    Example:

        >>> from opake_core import ConfigurationError, plan
        >>> plan.check_combination(mechanism="mf_band", sampler="cyclic_poisson", adaptive_clipping=False,
        ...                        noise_multiplier=1.0, target=None)
        >>> try:
        ...     plan.check_combination(mechanism="gaussian", sampler="sequential", adaptive_clipping=False,
        ...                            noise_multiplier=1.0, target=None)
        ... except ConfigurationError as error:
        ...     print(str(error)[:70])
        a sequential order gives no privacy amplification and is allowed only
    """
    if mechanism not in SAMPLERS:
        raise ConfigurationError(f"unknown mechanism {mechanism!r}; known: {sorted(SAMPLERS)}.")
    if sampler not in SAMPLERS[mechanism]:
        users = sorted(m for m, names in SAMPLERS.items() if sampler in names)
        hint = f"; the {sampler!r} sampler goes with {users}" if users else ""
        raise ConfigurationError(
            f"mechanism {mechanism!r} has no accountant with the {sampler!r} sampler; use one of "
            f"{list(SAMPLERS[mechanism])}{hint}."
        )
    if adaptive_clipping and (mechanism != "gaussian" or sampler != "poisson"):
        raise ConfigurationError(
            f"adaptive clipping is accounted for DP-SGD with plain Poisson sampling only, got mechanism={mechanism!r} "
            f"with the {sampler!r} sampler (matrix-factorization noise needs a constant per-step sensitivity). Use a "
            "fixed clipping bound."
        )
    if sampler == "sequential" and noise_multiplier != 0.0:
        raise ConfigurationError(
            "a sequential order gives no privacy amplification and is allowed only for a non-private run "
            f"(noise multiplier 0, got {noise_multiplier!r}); use Poisson sampling for a private run."
        )
    if noise_multiplier == 0.0 and target is not None:
        raise PrivacyBudgetError(
            f"noise multiplier 0 is the non-private path; a target epsilon ({target!r}) is meaningless there."
        )
    if is_horizon(mechanism, sampler) and noise_multiplier and target is not None:
        raise PrivacyBudgetError(
            f"a target epsilon with a fixed noise multiplier (stop at epsilon) needs a per-step run, but "
            f"{mechanism!r} with the {sampler!r} sampler is a whole-horizon configuration, accounted once for all its "
            "steps: give only the target (to calibrate the noise) or only the multiplier."
        )


@dataclass(frozen=True)
class Plan:
    """A validated privacy plan (see :func:`plan`).

    Attributes:
        sampler: the batch sampler.
        strategy: the DP-FTRL strategy optimized for the horizon (None for DP-SGD).
        second_moment_strategy: the second-moment stream's strategy, optimized the same way (None: none given).
        release: what the run releases at ``noise_multiplier``: one step's process (per-step runs, recorded in the
            ledger at every step) or the whole horizon's (recorded once).
        noise_multiplier: the resolved multiplier (0 for a non-private run).
        calibration_source: ``"fixed"`` or ``"calibrated"``.
        delta: the delta every epsilon is reported at.
        total_steps: the declared number of steps.
        expected_batch_size: the public normalizer of the clipped sum (``N * sample_rate``, cluster-wide).
        sample_rate: the cluster-wide expected fraction of the dataset per step.
        stop_step: with a target and a fixed multiplier, the last step whose epsilon (history included) is within
            the target; None otherwise.
        horizon: whether the run is accounted once for its whole horizon.
    """

    sampler: Any
    strategy: Any
    release: Any
    noise_multiplier: float
    calibration_source: str
    delta: float
    total_steps: int
    expected_batch_size: float
    sample_rate: float
    stop_step: int | None
    horizon: bool
    second_moment_strategy: Any = None

    @property
    def steps_per_epoch(self) -> float:
        return 1 / self.sample_rate


def _sampler_name(sampler: Any) -> str:
    name = dict(getattr(sampler, "config", ())).get("sampler")
    if not isinstance(name, str):
        raise ConfigurationError(f"sampler must be an opake_core.sampling sampler, got {type(sampler).__name__}.")
    return name


def _optimized(strategy: Any, sampler: Any, steps: int) -> Any:
    """The strategy optimized once for the horizon and the participation pattern the sampler guarantees."""
    name = accounting.mf.mechanism_name(strategy)
    bands = getattr(strategy, "bands", None)
    if name == "mf_band" and isinstance(bands, int) and bands > steps:
        raise ConfigurationError(f"mf_band needs bands <= the steps, got bands={bands} for {steps} steps.")
    pattern = (
        mf.SingleParticipation() if _sampler_name(sampler) == "poisson" else accounting.sampler_participation(sampler)
    )
    return mf.optimize(strategy, steps, participation=pattern)


def _release(sampler: Any, strategy: Any, clipping: Any, steps: int, *, second: Any = None) -> Any:
    """``z -> process``: one step of a per-step run, or the whole horizon of a horizon run (``second``: the
    second-moment strategy of a DP-FTRL run, validated here once)."""
    if strategy is not None:
        options = {"sampler": sampler, "n_steps": steps, "second_moment_strategy": second}
        accounting.mf_process(strategy, noise_multiplier=1.0, **options)  # refuses what it does not cover, now
        return lambda z: accounting.mf_process(strategy, noise_multiplier=z, **options)
    if _sampler_name(sampler) in HORIZON_SAMPLERS:
        return lambda z: sampler.process(z, steps)
    if not isinstance(clipping, AdaptiveRule):
        return lambda z: _single(sampler.process(z, 1))
    if getattr(sampler, "truncated_batch_size", None) is not None:
        raise ConfigurationError("adaptive clipping is accounted for plain (untruncated) Poisson sampling only.")
    if getattr(sampler, "sharding", "per_rank") != "per_rank":
        raise ConfigurationError(
            f"adaptive clipping's count release is accounted for a record counted at most once per step, but "
            f"sharding={sampler.sharding!r} lets {sampler.world_size} ranks draw the same record. Use fixed "
            "clipping, or sharding='per_rank'."
        )

    def step(z: float) -> Any:
        count = accounting.adaptive_clipping(
            accounting.gaussian(z),
            count_noise_fraction=clipping.count_noise_fraction,
            expected_batch_size=sampler.expected_batch_size,
        )
        return accounting.poisson(count, sampler.sample_rate)

    return step


def _with_router_release(release: Any, ratio: float, *, mechanism: str, clipping: Any) -> Any:
    """``z -> moe_aux(release(z), ratio)``: each step also releases the router statistic (see :func:`plan`)."""
    rho = validate.positive("router_ratio", ratio)
    if mechanism != "gaussian":
        raise ConfigurationError(
            f"the MoE router release is a DP-SGD release (Gaussian noise on each step's batch), got mechanism "
            f"{mechanism!r}: there is no accountant for it next to matrix-factorization noise. Use the gaussian "
            "mechanism with the router release, or drop the router release."
        )
    if isinstance(clipping, AdaptiveRule):
        raise ConfigurationError(
            "the MoE router release is accounted next to a fixed clipping bound; adaptive clipping releases a count "
            "too, which moe_aux does not cover. Use a fixed clipping bound with the router release."
        )
    return lambda z: accounting.moe_aux(release(z), ratio=rho)


def _single(process: Any) -> Any:
    """The step inside ``repeat(step, 1)``."""
    return process.process if isinstance(process, Repeat) and process.count == 1 else process


def plan(
    *,
    sampler: Any,
    steps: int,
    delta: float,
    strategy: Any = None,
    clipping: Any = None,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    calibration: tuple[float, float, float] = (0.11, 10.0, 1e-3),
    spent: accounting.Ledger | None = None,
    done: int = 0,
    resumed_multiplier: float | None = None,
    router_ratio: float | None = None,
    second_moment_strategy: Any = None,
) -> Plan:
    """Validate the combination and resolve the noise multiplier, the release and the stop step.

    Args:
        sampler: an :mod:`opake_core.sampling` sampler (its ``expected_batch_size`` is the public normalizer).
        steps: the declared number of steps (the horizon of a horizon run).
        delta: the delta epsilon is reported and calibrated at (check it with ``accounting.check_delta``).
        strategy: an :mod:`opake_core.mf` strategy for DP-FTRL (optimized here), or None for DP-SGD.
        clipping: the clipping bound or rule (an :func:`opake_core.clipping.adaptive` rule adds its count release).
        noise_multiplier: a fixed multiplier (0 = non-private), or None to calibrate to ``target_epsilon``.
        target_epsilon: the total epsilon of the run: calibrates the multiplier, or stops a fixed one in time.
        calibration: ``(min, max, tolerance)`` of the multiplier search.
        spent: what the run already released (a resumed checkpoint, earlier ``train()`` calls).
        done: the steps of this run already taken (a resume).
        resumed_multiplier: the multiplier an unchanged resumed run calibrated before: kept while the whole history
            stays within the target, so that the resume replays exactly.
        router_ratio: ``rho > 0`` when every step also releases the MoE router load statistic
            (:func:`opake_core.router_release.router_release`, multiplier ``z / sqrt(rho)``): each step's Gaussian is
            then accounted at ``z / sqrt(1 + rho)`` (:func:`opake_core.accounting.moe_aux`), in the calibration, the
            stop step and the release recorded in the ledger. DP-SGD with fixed clipping only.
        second_moment_strategy: DP-FTRL with private second moments
            (:func:`opake_core.noise.paired_mf_gaussian_noise`): the second stream's strategy, optimized here like
            ``strategy``; one that the sampler's accountant does not cover is refused
            (:func:`opake_core.accounting.mf_process`). DP-SGD's paired streams share its Gaussian and take none.

    Raises:
        ConfigurationError: a combination without a correct accountant, with the fix.
        PrivacyBudgetError: no multiplier or target, a spent budget, a target that one more step exceeds.

    Example: DP-SGD with Poisson sampling and a fixed multiplier; the run's epsilon is that of its release repeated
    over the steps. (With ``target_epsilon`` instead of ``noise_multiplier`` the multiplier is calibrated.)

        >>> from opake_core import accounting, plan, sampling
        >>> sampler = sampling.poisson(dataset_size=1_000, sample_rate=0.05)
        >>> run = plan.plan(sampler=sampler, steps=20, delta=1e-5, clipping=1.0, noise_multiplier=2.0)
        >>> run.release, run.expected_batch_size, run.horizon
        (Poisson(inner=Gaussian(noise_multiplier=2.0), sample_rate=0.05), 50.0, False)
        >>> accounting.epsilon(accounting.repeat(run.release, run.total_steps), delta=run.delta, accountant="rdp")
        Result(value=0.599..., accountant='rdp')
    """
    steps = validate.integer("steps", steps, minimum=1)
    if noise_multiplier is None and target_epsilon is None:
        raise PrivacyBudgetError("give a noise multiplier (0 for a non-private run) or a target epsilon.")
    if noise_multiplier is not None:
        noise_multiplier = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    if target_epsilon is not None:
        target_epsilon = validate.positive("target_epsilon", target_epsilon)
    sampler_name = _sampler_name(sampler)
    mechanism = "gaussian" if strategy is None else accounting.mf.mechanism_name(strategy)
    check_combination(
        mechanism=mechanism,
        sampler=sampler_name,
        adaptive_clipping=isinstance(clipping, AdaptiveRule),
        noise_multiplier=noise_multiplier,
        target=target_epsilon,
    )
    horizon = is_horizon(mechanism, sampler_name)
    if second_moment_strategy is not None and strategy is None:
        raise ConfigurationError(
            "second_moment_strategy is the strategy of DP-FTRL's second-moment stream; DP-SGD's private second "
            "moments share its Gaussian noise and take none. Drop second_moment_strategy, or pass strategy= too."
        )
    strategy = None if strategy is None else _optimized(strategy, sampler, steps)
    second = None if second_moment_strategy is None else _optimized(second_moment_strategy, sampler, steps)
    release = _release(sampler, strategy, clipping, steps, second=second)
    if router_ratio is not None:
        release = _with_router_release(release, router_ratio, mechanism=mechanism, clipping=clipping)
    spent = spent or accounting.Ledger()
    remaining = max(steps - done, 1)
    prefix = None if horizon else spent.process()

    def history(z: float) -> Any:
        if horizon:
            return release(z)
        rest = accounting.repeat(release(z), remaining)
        return rest if prefix is None else accounting.compose(prefix, rest)

    if target_epsilon is not None and prefix is not None:
        already = spent.epsilon(delta=delta).value
        if already >= target_epsilon:
            raise PrivacyBudgetError(_spent_message(spent, already, target_epsilon))
    source = "fixed"
    if noise_multiplier is None and resumed_multiplier is not None and not horizon:
        if accounting.epsilon(history(resumed_multiplier), delta=delta).value <= target_epsilon:
            noise_multiplier, source = resumed_multiplier, "calibrated"
    stop = None
    if noise_multiplier is None:
        low, high, tolerance = calibration
        try:
            found = accounting.calibrate_noise_multiplier(
                history, target_epsilon=target_epsilon, delta=delta, min=low, max=high, tolerance=tolerance
            )
        except CalibrationError as exc:
            if prefix is None:
                raise
            already = spent.epsilon(delta=delta).value
            raise PrivacyBudgetError(
                f"{_spent_message(spent, already, target_epsilon)[:-1]}, and what is left cannot pay for {remaining} "
                f"more steps even at noise multiplier {high} ({exc})"
            ) from exc
        noise_multiplier, source = float(found.value), "calibrated"
    elif source == "fixed" and target_epsilon is not None:
        stop = done + _steps_within(release(noise_multiplier), prefix, target_epsilon, delta, remaining)
    expected = float(sampler.expected_batch_size)
    return Plan(
        sampler=sampler,
        strategy=strategy,
        release=release(noise_multiplier),
        noise_multiplier=noise_multiplier,
        calibration_source=source,
        delta=delta,
        total_steps=steps,
        expected_batch_size=expected,
        sample_rate=expected / sampler.dataset_size,
        stop_step=stop,
        horizon=horizon,
        second_moment_strategy=second,
    )


def _spent_message(spent: accounting.Ledger, already: float, target: float) -> str:
    return (
        f"the privacy budget is spent: the {spent.releases} steps already taken cost epsilon {already:.4g} of the "
        f"target epsilon {target} (the target is the total for the run, resumes and earlier train() calls "
        "included). Stop here, or raise the target if a larger total is acceptable."
    )


def _steps_within(step: Any, prefix: Any, target: float, delta: float, remaining: int) -> int:
    """How many more steps of ``step`` (after ``prefix``) keep epsilon within ``target``; refuses zero at once."""
    first = step if prefix is None else accounting.compose(prefix, step)
    if accounting.epsilon(first, delta=delta).value > target:
        raise PrivacyBudgetError(
            f"one more step already exceeds the target epsilon {target}"
            f"{'' if prefix is None else ' (with the steps already taken)'}: raise the noise multiplier or the target."
        )
    found = accounting.calibrate_steps(step, target_epsilon=target, delta=delta, prefix=prefix, max_steps=remaining)
    return int(found.value)
