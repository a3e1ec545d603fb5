"""One-run audits around a :class:`~opake_torch.transformers.DPTrainer` run: input-space canaries scored by their
loss on the trained model, and Dirac canaries on a canary block registered on the model and read between steps."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.func import vmap

from opake_core import random
from opake_core.auditing import coin_flips, fdp_audit, one_run_audit
from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.auditing.canaries import (
    CANARY_FIELD,
    CANARY_LEAF,
    CANARY_WEIGHT,
    REAL_ROW,
    DiracCanaries,
    dirac_canaries,
)
from opake_torch.auditing.scoring import AuditReport, CanaryAuditReport, _check_observe, _dirac_scores, _finish

__all__ = [
    "audit_trainer",
    "audit_trainer_dirac",
]


def audit_trainer(
    make_trainer: Callable[[list[Any]], Any],
    train_dataset: Sequence[Any],
    canaries: Sequence[Any],
    *,
    key: random.Key,
    delta: float | None = None,
    confidence: float = 0.95,
    k: int | Sequence[int] | None = None,
) -> AuditReport:
    """Run the one-run audit around a :class:`~opake_torch.transformers.DPTrainer` with input-space canaries.

    Args:
        make_trainer: ``dataset -> DPTrainer`` (build it with ``privacy_accounting=True`` so that the theoretical
            epsilon is reported; a non-private run reports inf).
        train_dataset: the examples always included (a sequence of dicts).
        canaries: candidate examples (dicts like the training rows); each is included with probability 1/2.
        key: drives the coins (:func:`opake_core.auditing.one_run.coin_flips`).
        delta: the audit's delta; defaults to the delta the trainer resolved.
        confidence: see :func:`opake_core.auditing.one_run.one_run_audit`.
        k: see :func:`opake_core.auditing.one_run.one_run_audit`.

    Scores are minus each canary's per-example loss under the trained model (``trainer.compute_per_example_loss``,
    so a custom objective is scored by its own loss): the black-box, final-model threat model.
    """
    from opake_torch.transformers.model_setup import with_training_patches  # the Hugging Face stack, when used

    canaries = list(canaries)
    if len(canaries) < 2:
        raise ConfigurationError(f"the audit needs at least 2 canaries, got {len(canaries)}; use hundreds.")
    included = coin_flips(key, len(canaries))
    dataset = list(train_dataset) + [c for c, inc in zip(canaries, included, strict=True) if inc]
    trainer = make_trainer(dataset)
    output = trainer.train()
    params = {name: p.detach() for name, p in trainer.model.named_parameters() if p.requires_grad}
    batch = trainer.fetch_batch(canaries, np.arange(len(canaries)))
    losses = with_training_patches(_per_example_losses)(trainer, params, batch)
    scores = -losses.detach().double().cpu().numpy()
    resolved_delta = trainer.state.privacy_resolved_delta if delta is None else delta
    theoretical = output.metrics.get("privacy_epsilon")
    if theoretical is None:
        theoretical = math.inf if trainer.state.privacy_resolved_noise_multiplier == 0 else math.nan
    result = one_run_audit(scores, included, delta=float(resolved_delta), confidence=confidence, k=k)
    fdp = fdp_audit(scores, included, delta=float(resolved_delta), confidence=confidence)
    return AuditReport(result, float(theoretical), scores, included, fdp)


def _per_example_losses(trainer: Any, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[m]``: ``trainer.compute_per_example_loss`` of every row of ``batch`` under ``vmap``, which needs the run's
    patches (Hugging Face models run under ``vmap`` only with them; ``train()`` undid them when it returned)."""
    with torch.no_grad():
        return vmap(trainer.compute_per_example_loss, in_dims=(None, 0))(params, batch)


class _CanaryRows(Sequence):
    """The trainer's data set for a Dirac audit: the real rows (marked
    :data:`~opake_torch.auditing.canaries.REAL_ROW`), then one slot per canary (a copy of real row 0, marked with its
    slot)."""

    def __init__(self, base: Sequence[Any], slots: np.ndarray) -> None:
        self.base, self.slots = base, slots

    def __len__(self) -> int:
        return len(self.base) + len(self.slots)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < len(self.base):
            return {**self.base[i], CANARY_FIELD: REAL_ROW}
        return {**self.base[0], CANARY_FIELD: int(self.slots[i - len(self.base)])}


def _canary_embedding(model: torch.nn.Module, num_canaries: int) -> None:
    """The zero canary block of a trainer audit, registered on ``model`` (dtype of its first parameter): an
    embedding, so that the layerwise engine serves it like any other layer."""
    first = next(model.parameters())
    block = torch.nn.Embedding(num_canaries + 1, 1, padding_idx=num_canaries, dtype=first.dtype)
    torch.nn.init.zeros_(block.weight)
    model.add_module(CANARY_LEAF, block)


def _recorder(trainer: Any, m: int) -> Any:
    """A callback that keeps the canary block of ``trainer``'s iterate before every step (``before[t]``, float64)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.before: list[np.ndarray] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.before.append(_canary_values(trainer.trainable_params[CANARY_WEIGHT], m))

    return Recorder()


def _canary_values(weight: torch.Tensor, m: int) -> np.ndarray:
    return weight[:m, 0].detach().double().cpu().numpy().copy()


def _dirac_trainer_class(base: type, canaries: DiracCanaries) -> type:
    """A subclass of ``base`` whose losses add the Dirac canaries' (``gradient_norm`` times the canary's entry of
    the block, looked up through the block's embedding so that both engines see a supported layer) and whose
    batches keep their column. The batched loss carries them, unless ``base`` overrides only the per-example loss
    (then that one does, and the run uses ``vmap(grad)`` as it would without the audit)."""
    from opake_torch.transformers import DPTrainer

    m, scale = len(canaries), canaries.gradient_norm

    def with_canaries(owner: Any, params: dict[str, torch.Tensor], real: torch.Tensor, slot: torch.Tensor) -> Any:
        block = owner.model.get_submodule(CANARY_LEAF)
        rows = torch.where(slot >= 0, slot, m)  # row m: the padding index, no gradient
        entry = torch.func.functional_call(block, {"weight": params[CANARY_WEIGHT]}, (rows,)).reshape(slot.shape)
        return torch.where(slot == REAL_ROW, real, torch.zeros_like(real)) + scale * entry.to(real.dtype)

    def compute_batch_losses(self: Any, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> Any:
        batch = dict(batch)
        slot = batch.pop(CANARY_FIELD)
        return with_canaries(self, params, super(trainer, self).compute_batch_losses(params, batch), slot)

    def compute_per_example_loss(self: Any, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> Any:
        example = dict(example)
        slot = example.pop(CANARY_FIELD)
        return with_canaries(self, params, super(trainer, self).compute_per_example_loss(params, example), slot)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        if self.dataset_columns is not None:  # remove_unused_columns keeps the model's inputs only
            self.dataset_columns = self.dataset_columns | {CANARY_FIELD}

    own_example_loss = base.compute_per_example_loss is not DPTrainer.compute_per_example_loss
    own_batch_loss = base.compute_batch_losses is not DPTrainer.compute_batch_losses
    methods: dict[str, Any] = {"__init__": __init__}
    if own_batch_loss or not own_example_loss:
        methods["compute_batch_losses"] = compute_batch_losses
    if own_example_loss:  # it does not reach the batched loss above
        methods["compute_per_example_loss"] = compute_per_example_loss
    trainer = type("DiracCanaryTrainer", (base,), methods)
    return trainer


def audit_trainer_dirac(
    model: torch.nn.Module,
    args: Any,
    train_dataset: Sequence[dict[str, Any]],
    *,
    key: random.Key,
    num_canaries: int = 1000,
    gradient_norm: float | None = None,
    observe: str = "all",
    score: str | None = None,
    trainer_class: type | None = None,
    confidence: float = 0.95,
    guess_sets: Sequence[tuple[int, int]] | None = None,
    guess_plan: str = "robust",
    claim_test: bool = False,
    **trainer_kwargs: Any,
) -> CanaryAuditReport:
    """Audit a :class:`~opake_torch.transformers.DPTrainer` run (DP-SGD, Poisson sampling) with Dirac canaries.

    The model gains the canary block (a zero ``nn.Embedding`` :data:`~opake_torch.auditing.canaries.CANARY_LEAF` of
    ``num_canaries + 1`` rows of width 1, trainable name :data:`~opake_torch.auditing.canaries.CANARY_WEIGHT`); the
    data set gains one row per canary slot (a copy of row 0 whose own loss is masked) and the column
    :data:`~opake_torch.auditing.canaries.CANARY_FIELD`; the trainer is a subclass of ``trainer_class`` whose batched
    loss adds the canaries' (its per-example loss where ``trainer_class`` defines only that), so that the run uses the
    per-example gradient engine it would use without the audit (the layerwise engine where the model allows it).
    With ``observe="all"`` the auditor reads the canary block before every step and after the last one and recovers
    each step's privatized gradient from ``theta_{t+1} - theta_t = -lr_t (g_t + weight_decay theta_t)``, which needs
    ``args.optim="sgd"``; ``observe="final"`` reads the final block only (any optimizer).

    Args:
        model: a model ``DPTrainer`` accepts (it is modified: the block is registered on it).
        args: :class:`~opake_torch.transformers.TrainingArguments` with a fixed ``clipping_norm`` and the Gaussian
            mechanism with Poisson sampling.
        train_dataset: the real rows (dicts).
        key: drives the coins and the simulations that choose the guess set.
        num_canaries: ``m``.
        gradient_norm: a canary's gradient norm before clipping (default: the clipping bound).
        observe: see :func:`~opake_torch.auditing.core_runs.audit_dirac_run`.
        score: see :func:`~opake_torch.auditing.core_runs.audit_dirac_run`.
        confidence: see :func:`~opake_torch.auditing.core_runs.audit_dirac_run`.
        guess_sets: see :func:`~opake_torch.auditing.core_runs.audit_dirac_run`.
        guess_plan: see :func:`~opake_torch.auditing.core_runs.audit_dirac_run`.
        claim_test: see :func:`~opake_torch.auditing.core_runs.audit_dirac_run`.
        trainer_class: ``DPTrainer`` (default) or a subclass of it.
        **trainer_kwargs: more arguments of the trainer (``data_collator`` must keep the
            :data:`~opake_torch.auditing.canaries.CANARY_FIELD` column).
    """
    from opake_torch.transformers import DPTrainer  # the audit imports the Hugging Face stack only when used
    from opake_torch.transformers.optimizer import build_schedule

    score = _check_observe(observe, score)
    trainer_class = DPTrainer if trainer_class is None else trainer_class
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, DPTrainer)):
        raise InputTypeError(f"trainer_class must be DPTrainer or a subclass, got {trainer_class!r}.")
    bound = args.clipping_norm
    if isinstance(bound, bool) or not isinstance(bound, int | float) or args.clipping_mode not in (None, "fixed"):
        raise ConfigurationError(
            f"a Dirac audit needs one fixed clipping bound, got clipping_norm={bound!r} with clipping_mode="
            f"{args.clipping_mode!r}; set a number and the default clipping mode."
        )
    if observe == "all" and args.optim != "sgd":
        raise ConfigurationError(
            f"observe='all' recovers each privatized gradient from consecutive iterates, which needs optim='sgd', "
            f"got optim={args.optim!r}; use optim='sgd', or observe='final'."
        )
    if args.ddp_shard == "global" and args.world_size > 1:
        raise ConfigurationError(  # its simulations model one Poisson draw per step, with a canary's signal 0 or 1
            "audit_trainer_dirac models one Poisson draw per step; under ddp_shard='global' each rank draws the whole "
            "dataset, so a canary may be in several ranks' draws of a step. Audit with ddp_shard='per_rank' (the "
            "default)."
        )
    gradient_norm = float(bound) if gradient_norm is None else gradient_norm
    canaries = dirac_canaries(key=key, num_canaries=num_canaries, gradient_norm=gradient_norm)
    if not canaries.gradient_norm >= bound:
        raise ConfigurationError(f"gradient_norm ({gradient_norm}) must be at least clipping_norm ({bound}).")
    if hasattr(model, CANARY_LEAF):
        raise ConfigurationError(f"the model already has {CANARY_LEAF!r}; audit a fresh model.")
    _canary_embedding(model, num_canaries)
    trainer_cls = _dirac_trainer_class(trainer_class, canaries)
    trainer = trainer_cls(model, args, train_dataset=_CanaryRows(list(train_dataset), canaries.slots), **trainer_kwargs)
    recorder = _recorder(trainer, num_canaries)
    trainer.add_callback(recorder)
    output = trainer.train()
    plan = trainer.privacy_plan
    if plan is None or plan.strategy is not None or dict(plan.sampler.config).get("sampler") != "poisson":
        raise ConfigurationError(
            "audit_trainer_dirac audits DP-SGD with Poisson sampling; for DP-FTRL use audit_dirac_run with the core "
            "step."
        )
    final = _canary_values(trainer.model.get_submodule(CANARY_LEAF).weight, num_canaries)
    theoretical = output.metrics.get("privacy_epsilon", math.nan)
    z, q, steps = plan.noise_multiplier, plan.sample_rate, len(recorder.before)
    if observe == "final":
        x = None
        scores = -(final - recorder.before[0]) if recorder.before else np.zeros(num_canaries)
    else:
        schedule = build_schedule(args, plan.total_steps)
        iterates = [*recorder.before, final]
        x = np.stack(
            [
                -(after - before) / float(schedule(t)) - args.weight_decay * before
                for t, (before, after) in enumerate(itertools.pairwise(iterates))
            ]
        ) / (bound / plan.expected_batch_size)
        scores = _dirac_scores(score, x, noise_multiplier=z, sample_rate=q)
    return _finish(
        scores,
        canaries,
        plan_key=random.fold_in(key, "opake.audit.plan"),
        score=score,
        claim=plan.sampler.process(z, steps),
        theoretical=theoretical,
        delta=plan.delta,
        confidence=confidence,
        guess_sets=guess_sets,
        guess_plan=guess_plan,
        simulation={"steps": steps, "sample_rate": q, "noise_multiplier": z},
        claim_test=claim_test,
        observations=x,
        observe=observe,
    )
