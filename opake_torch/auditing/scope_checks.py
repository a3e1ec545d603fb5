"""Checks that narrow what the one-run audits leave open: the noise on every real parameter, and the accounting.

The canary audits of :mod:`opake_torch.auditing` observe a parameter block of their own and test the mechanism
against the claim the auditor hands them, so two kinds of bugs pass them unseen: noise missing (or too small) on
the real parameters, and an accountant that composes other steps than the ones that ran. These checks run the
training side and hand the numbers to the core statistics:

* :func:`check_noise_scale` (the core step) and :func:`audit_trainer_noise` (``DPTrainer``) test that the privatized
  gradient of every parameter leaf carries noise of the claimed standard deviation
  (:mod:`opake_core.auditing.noise_scale`: a per-leaf chi-square test, Bonferroni over the leaves);
* :func:`audit_trainer_accounting` counts the steps a ``DPTrainer`` run takes and compares them, and the rate of
  the sampler that drew the batches, with the ledger the run reports (:mod:`opake_core.auditing.accounting_check`).

Both look at the gradient the step privatized, before the optimizer: what the optimizer does with a noised
gradient is post-processing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from opake_core import accounting, mf, random, validate
from opake_core.auditing.accounting_check import AccountingReport, check_accounting
from opake_core.auditing.noise_scale import (
    SCALE_ERROR,
    NoiseScaleReport,
    claimed_std,
    leaf_noise_test,
    min_coordinates,
    sum_squares,
    whiten,
)
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf.participation import SINGLE, Participation
from opake_core.step import dp_ftrl, dp_sgd
from opake_core.tree import Clipped, PerGroup

__all__ = ["audit_trainer_accounting", "audit_trainer_noise", "check_noise_scale"]

NOISE_STREAM = "opake.audit.noise_scale"


class _NoiseRecorder:
    """An optimizer that keeps every privatized gradient (float64, on the host) and leaves the parameters where
    they are, so that two runs with different noise keys compute the same clipped sums at every step."""

    def __init__(self) -> None:
        self.rows: list[dict[str, torch.Tensor]] = []

    def init(self, params: Any) -> tuple[()]:
        return ()

    def update(self, updates: Any, state: Any, *, params: Any = None) -> tuple[Any, Any]:
        if not isinstance(updates, Clipped) or not isinstance(updates.value, dict):
            raise InputTypeError(
                f"the noise check records one noised gradient, a Noised dict of tensors; got {type(updates).__name__}."
            )
        self.rows.append({k: v.detach().to(torch.float64).cpu().clone() for k, v in updates.value.items()})
        return {k: torch.zeros_like(p) for k, p in params.items()}, state


def _steps_for(sizes: Sequence[int], needed: int) -> int:
    """Steps for the smallest leaf to reach ``needed`` values."""
    return max(1, math.ceil(needed / max(1, min(sizes))))


def check_noise_scale(
    loss_fn: Callable[..., torch.Tensor],
    params: dict[str, torch.Tensor],
    batch: tuple[torch.Tensor, ...],
    *,
    key: random.Key,
    noise_multiplier: float,
    clipping_norm: float | PerGroup,
    expected_batch_size: float,
    strategy: Any = None,
    n_steps: int | None = None,
    participation: Participation = SINGLE,
    mechanism: Callable[..., tuple[Any, Any]] | None = None,
    steps: int | None = None,
    false_alarm: float = 1e-3,
    scale_error: float = SCALE_ERROR,
    power: float = 0.999,
) -> NoiseScaleReport:
    """Test that a core step adds noise of the claimed standard deviation to every parameter leaf.

    The step runs twice on ``batch`` with two noise keys folded from ``key``, ``steps`` times each, under an
    optimizer that records each privatized gradient and leaves the parameters unchanged; the clipped sums are then
    the same in both runs, and the difference of the two gradients divided by ``sqrt(2)`` is noise only. The claim:
    DP-SGD adds ``N(0, (z C / B)^2)`` to every coordinate at every step (per group with a per-group bound);
    DP-FTRL (``strategy``) adds ``z sens(C) C / B (C^-1 w)_t``, whitened with ``C`` before the test
    (:func:`opake_core.auditing.noise_scale.whiten`). Leaves are tested by
    :func:`opake_core.auditing.noise_scale.leaf_noise_test`.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one example.
        params: the parameters, a dict of tensors (the leaf names of the report).
        batch: a tuple of per-example tensors ``[b, ...]``, used at every step.
        key: the audit's key (the two runs' noise keys are folded from it).
        noise_multiplier: the claimed ``z > 0`` (the accountant's).
        clipping_norm: the claimed bound ``C``, a number or a :class:`~opake_core.tree.PerGroup` of the parameters.
        expected_batch_size: the claimed normalizer ``B``.
        strategy: a DP-FTRL strategy (None: DP-SGD); needs ``n_steps``.
        n_steps: the DP-FTRL horizon; the check observes at most that many steps.
        participation: the participation ``sens(C)`` is computed for (DP-FTRL).
        mechanism: ``mechanism(loss_fn, *, optimizer, expected_batch_size, key) -> (step_fn, dp_state)``, the step
            under test (default: the library's ``dp_sgd``, or ``dp_ftrl`` with ``strategy``, for the claim).
        steps: the steps observed per run (default: enough for every leaf to reach
            :func:`~opake_core.auditing.noise_scale.min_coordinates` values; at most ``n_steps``).
        false_alarm: the total false-alarm rate.
        scale_error: the detectable relative error of the standard deviation.
        power: the detection probability of that error on a leaf with enough values.

    Returns:
        A :class:`~opake_core.auditing.noise_scale.NoiseScaleReport` (``flagged``: some leaf's noise is off the claim).
    """
    if not isinstance(params, dict) or not params or not all(isinstance(v, torch.Tensor) for v in params.values()):
        raise InputTypeError(f"params must be a non-empty dict of tensors, got {type(params).__name__}.")
    if not isinstance(batch, tuple):
        raise InputTypeError(f"batch must be a tuple of per-example tensors, got {type(batch).__name__}.")
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    bound = clipping_norm
    if isinstance(bound, bool) or not isinstance(bound, int | float | PerGroup):
        raise ConfigurationError(
            f"the noise check needs a fixed clipping bound (a number or PerGroup), got {type(bound).__name__}: the "
            "noise of adaptive clipping and AUTO-S follows a bound that changes with the data."
        )
    batch_size = validate.positive("expected_batch_size", expected_batch_size)
    sensitivity = bound.map(lambda c: c / batch_size) if isinstance(bound, PerGroup) else float(bound) / batch_size
    names = list(params)
    needed = min_coordinates(len(names), false_alarm=false_alarm, scale_error=scale_error, power=power)
    steps = _steps_for([p.numel() for p in params.values()], needed) if steps is None else steps
    steps = validate.integer("steps", steps, minimum=1)
    concrete, scale = None, z
    if strategy is not None:
        if n_steps is None:
            raise ConfigurationError("a DP-FTRL noise check needs n_steps, the horizon the strategy is built for.")
        concrete = mf.optimize(strategy, n_steps, participation=participation)
        scale = z * mf.sensitivity(concrete, n_steps, participation=participation)
        steps = min(steps, n_steps)
    sigma = claimed_std(sensitivity, scale, names)
    if mechanism is None:
        mechanism = _library_step(bound, z, params, concrete, n_steps, participation)
    runs = []
    for i in range(2):
        recorder = _NoiseRecorder()
        step_fn, dp_state = mechanism(
            loss_fn, optimizer=recorder, expected_batch_size=batch_size, key=random.fold_in(key, NOISE_STREAM, i)
        )
        current, opt_state = dict(params), recorder.init(params)
        for _ in range(steps):
            current, opt_state, dp_state, _ = step_fn(current, opt_state, dp_state, batch)
        runs.append(recorder.rows)
    sums = {}
    for name in names:
        noise = np.stack([(a[name] - b[name]).numpy() for a, b in zip(*runs, strict=True)]) / math.sqrt(2)
        if concrete is not None:
            noise = whiten(noise, concrete, n_steps=n_steps, participation=participation)
        sums[name] = sum_squares(noise / sigma[name])
    return leaf_noise_test(sums, false_alarm=false_alarm, scale_error=scale_error, power=power, steps=steps)


def _library_step(
    bound: float | PerGroup, z: float, params: Any, concrete: Any, n_steps: int | None, participation: Participation
) -> Callable[..., tuple[Any, Any]]:
    def mechanism(loss_fn: Any, *, optimizer: Any, expected_batch_size: float, key: random.Key) -> tuple[Any, Any]:
        common = {"clipping_norm": bound, "noise_multiplier": z, "key": key, "optimizer": optimizer}
        if concrete is None:
            return dp_sgd(loss_fn, expected_batch_size=expected_batch_size, **common)
        return dp_ftrl(
            loss_fn,
            params=params,
            strategy=concrete,
            n_steps=n_steps,
            participation=participation,
            expected_batch_size=expected_batch_size,
            **common,
        )

    return mechanism


# -- DPTrainer ---------------------------------------------------------------------------------------------------------


def _zero_gradient_class(base: type) -> type:
    """A subclass of ``base`` whose losses are zero times its own, so that every per-example gradient is zero and
    every update is the noise alone. The batched loss carries it, unless ``base`` overrides only the per-example
    loss (then that one does, and the run uses ``vmap(grad)`` as it would without the check)."""
    from opake_torch.transformers import DPTrainer

    def compute_batch_losses(self: Any, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> Any:
        return 0.0 * super(trainer, self).compute_batch_losses(params, batch)

    def compute_per_example_loss(self: Any, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> Any:
        return 0.0 * super(trainer, self).compute_per_example_loss(params, example)

    own_example_loss = base.compute_per_example_loss is not DPTrainer.compute_per_example_loss
    own_batch_loss = base.compute_batch_losses is not DPTrainer.compute_batch_losses
    methods: dict[str, Any] = {}
    if own_batch_loss or not own_example_loss:
        methods["compute_batch_losses"] = compute_batch_losses
    if own_example_loss:
        methods["compute_per_example_loss"] = compute_per_example_loss
    trainer = type("ZeroGradientTrainer", (base,), methods)
    return trainer


def _update_recorder(trainer: Any) -> Any:
    """A callback that adds up, per leaf, the squares of every step's update ``theta_t - theta_{t+1}`` (float64)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.before: dict[str, torch.Tensor] = {}
            self.sums: dict[str, list[float]] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.before = {k: v.detach().to(torch.float64).clone() for k, v in trainer.trainable_params.items()}

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            for name, after in trainer.trainable_params.items():
                s, n = self.sums.setdefault(name, [0.0, 0])
                step = self.before[name] - after.detach().to(torch.float64)
                self.sums[name] = [s + float(step.square().sum()), n + step.numel()]

    return Recorder()


def _multiplier(ledger: accounting.Ledger) -> float:
    """The one noise multiplier of a ledger's Gaussian releases."""
    found = set()
    for process, _ in ledger.entries:
        inner = getattr(process, "inner", process)
        if not isinstance(inner, accounting.Gaussian):
            raise ConfigurationError(f"the noise check reads Gaussian releases, the ledger holds {process!r}.")
        found.add(inner.noise_multiplier)
    if len(found) != 1:
        raise ConfigurationError(f"the run's ledger holds {len(found)} noise multipliers {sorted(found)}; expected 1.")
    return found.pop()


def audit_trainer_noise(
    model: torch.nn.Module,
    args: Any,
    train_dataset: Sequence[Any],
    *,
    steps: int | None = None,
    trainer_class: type | None = None,
    false_alarm: float = 1e-3,
    scale_error: float = SCALE_ERROR,
    power: float = 0.999,
    **trainer_kwargs: Any,
) -> NoiseScaleReport:
    """Test that a :class:`~opake_torch.transformers.DPTrainer` run (DP-SGD) adds noise of the claimed standard
    deviation to every trainable parameter.

    The run is ``args`` with plain SGD at learning rate 1, no weight decay, a constant schedule, ``steps`` steps and
    no checkpoints, in a subclass of ``trainer_class`` whose losses are zero times its own: every per-example
    gradient is zero, so the update of step ``t`` is minus the noise the step added, read from the trainable
    parameters before and after it. The claim is ``z * C / B`` per coordinate with ``z`` the multiplier in the
    run's ledger (what the accountant charged), ``C`` the clipping bound (per group for a per-group bound) and ``B``
    the plan's expected batch; each leaf's squares over all steps are tested
    (:func:`opake_core.auditing.noise_scale.leaf_noise_test`). The noise does not depend on the optimizer, which only
    post-processes it; noise that depends on the data (on the gradients, on the batch's content) is not exercised.

    Args:
        model: a model the trainer accepts (it is trained: pass a copy to keep it).
        args: :class:`~opake_torch.transformers.TrainingArguments` of a DP-SGD run with a fixed clipping bound
            (a number, or per group) and without the MoE router release.
        train_dataset: rows the trainer samples batches from.
        steps: the steps of the run (default: enough for the smallest leaf to reach
            :func:`~opake_core.auditing.noise_scale.min_coordinates` values).
        trainer_class: ``DPTrainer`` (default) or a subclass without per-example metrics.
        false_alarm: the total false-alarm rate.
        scale_error: the detectable relative error of the standard deviation.
        power: the detection probability of that error on a leaf with enough values.
        **trainer_kwargs: more arguments of the trainer.

    Returns:
        A :class:`~opake_core.auditing.noise_scale.NoiseScaleReport`.
    """
    from opake_torch.transformers import DPTrainer
    from opake_torch.transformers.privacy import clipping_rule

    trainer_class = DPTrainer if trainer_class is None else trainer_class
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, DPTrainer)):
        raise InputTypeError(f"trainer_class must be DPTrainer or a subclass, got {trainer_class!r}.")
    if getattr(trainer_class, "example_metrics", None) is not None:
        raise ConfigurationError(
            f"{trainer_class.__name__} computes per-example metrics with its loss, which the zero-gradient run "
            "cannot zero; check the noise of its mechanism with a DPTrainer on the same model and arguments."
        )
    if args.privacy_noise_mechanism != "gaussian" or args.clipping_mode != "fixed" or args.router_release:
        raise ConfigurationError(
            f"audit_trainer_noise checks DP-SGD with a fixed clipping bound, got privacy_noise_mechanism="
            f"{args.privacy_noise_mechanism!r}, clipping_mode={args.clipping_mode!r}, router release "
            f"{'on' if args.router_release else 'off'}. For DP-FTRL use check_noise_scale with the core dp_ftrl "
            "step (its noise is whitened with the strategy matrix); adaptive clipping and AUTO-S noise a bound "
            "that moves with the data, and the router release adds a loss of its own."
        )
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if not dtypes <= {torch.float32, torch.float64}:
        raise ConfigurationError(
            f"audit_trainer_noise reads the noise back from the weights, which needs float32 or float64 trainable "
            f"parameters, got {sorted(str(d) for d in dtypes)}: bf16 or fp16 weights round the update. Check a "
            "float32 copy of the model (autocast with bf16=True is fine)."
        )
    if steps is None:
        sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        needed = min_coordinates(len(sizes), false_alarm=false_alarm, scale_error=scale_error, power=power)
        steps = _steps_for(sizes, needed)
    steps = validate.integer("steps", steps, minimum=1)
    run_args = dataclasses.replace(
        args,
        optim="sgd",
        optim_args={},
        learning_rate=1.0,
        weight_decay=0.0,
        lr_scheduler="constant",
        lr_scheduler_kwargs={},
        warmup_steps=0,
        max_steps=steps,
        save_strategy="no",
        eval_strategy="no",
        load_best_model_at_end=False,
        push_to_hub=False,
    )
    trainer = _zero_gradient_class(trainer_class)(model, run_args, train_dataset=train_dataset, **trainer_kwargs)
    recorder = _update_recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    plan, params = trainer.privacy_plan, trainer.trainable_params
    bound = clipping_rule(run_args, params)
    batch = plan.expected_batch_size
    sensitivity = bound.map(lambda c: c / batch) if isinstance(bound, PerGroup) else float(bound) / batch
    sigma = claimed_std(sensitivity, _multiplier(trainer.ledger), list(params))
    sums = {name: (s / sigma[name] ** 2, n) for name, (s, n) in recorder.sums.items()}
    return leaf_noise_test(
        sums, false_alarm=false_alarm, scale_error=scale_error, power=power, steps=trainer.state.global_step
    )


def _step_counter() -> Any:
    from transformers import TrainerCallback

    class Counter(TrainerCallback):
        def __init__(self) -> None:
            self.steps = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.steps += 1

    return Counter()


def audit_trainer_accounting(
    trainer: Any, *, key: random.Key, sampler_steps: int | None = None, alpha: float = 1e-3
) -> AccountingReport:
    """Train ``trainer`` (fresh, DP-SGD) and compare what its accountant reports with what ran.

    A callback counts the steps as they end; after the run, the ledger (:attr:`DPTrainer.ledger`) and the
    reported epsilon (``privacy_epsilon``) are compared with those steps, each the release of the plan's sampler at
    the multiplier the step was built with (:func:`opake_core.auditing.accounting_check.check_accounting`), and the
    sampler is drawn again with ``key`` to test its inclusion rate against the ledger's (exact binomial test at
    ``alpha``).
    Run :func:`audit_trainer_noise` to test that the noise has the ledger's multiplier.

    Args:
        trainer: a :class:`~opake_torch.transformers.DPTrainer` that has not trained yet, with accounting on, a
            per-step release (DP-SGD, not a whole-horizon mechanism or sampler), a fixed or per-group clipping
            bound and no MoE router release.
        key: the audit key of the rate test.
        sampler_steps: draws of the rate test (default: 10,000 expected inclusions).
        alpha: the rate test's false-alarm rate.

    Returns:
        An :class:`~opake_core.auditing.accounting_check.AccountingReport` (``flagged``, ``reasons``).
    """
    from opake_torch.transformers import DPTrainer
    from opake_torch.transformers.privacy import build_plan
    from opake_torch.transformers.users import users_of

    if not isinstance(trainer, DPTrainer):
        raise InputTypeError(f"audit_trainer_accounting needs a DPTrainer, got {type(trainer).__name__}.")
    if trainer.ledger.releases:
        raise ConfigurationError(
            f"the trainer already released {trainer.ledger.releases} steps that this check did not see; "
            "build a fresh trainer."
        )
    args = trainer.args
    dataset = trainer.train_dataset
    plan = build_plan(args, len(dataset), users=users_of(args.privacy, dataset))
    if plan.horizon or not plan.accounted or args.clipping_mode == "adaptive" or args.router_release:
        raise ConfigurationError(
            "audit_trainer_accounting compares per-step Gaussian releases with the ledger: it needs accounting on, "
            "DP-SGD with a per-step sampler, no adaptive clipping and no router release (a whole-horizon mechanism "
            "is accounted once for its declared horizon, and a step past it raises)."
        )
    counter = _step_counter()
    trainer.add_callback(counter)
    try:
        output = trainer.train()
    finally:
        trainer.remove_callback(counter)
    plan = trainer.privacy_plan
    step = plan.sampler.process(plan.noise_multiplier, 1)
    release = step.process if isinstance(step, accounting.Repeat) and step.count == 1 else step
    return check_accounting(
        trainer.ledger,
        steps=counter.steps,
        release=release,
        delta=plan.delta,
        claimed_epsilon=output.metrics["privacy_epsilon"],
        sampler=plan.sampler,
        key=key,
        sampler_steps=sampler_steps,
        alpha=alpha,
    )
