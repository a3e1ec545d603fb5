"""The mutable state of one ``DPTrainer.train()`` call, and the logs read from it.

A :class:`Run` holds its step function and what it threads through (parameters, optimizer, DP and sampler states),
the secrets of the segment (its keys), what was released (the ledger), and the running sums of the step metrics
between two log rows. The sums stay on the device and are read only when a row is logged, so a step never waits for
the host.

Examples whose gradient is not finite (NaN or inf) add nothing to the clipped sum, but their step still releases its
noise and is charged. A log row counts them (``nonfinite_examples``, over the run) and warns. When every example of
the log rows in a row was dropped, :data:`NOISE_ONLY_BATCHES` expected batches of them at least (and
:data:`NOISE_ONLY_MIN` examples), the run releases noise only: :meth:`Run.drain` marks it (``noise_only``) for the
trainer to stop. The minimum keeps a run with a few bad records from stopping on a small batch of them (with half the
records bad, 16 dropped in a row happen by chance with probability ``2^-16``).

Logged values other than the privacy parameters (epsilon, delta, noise multiplier, noise std, clipping bound) are
exact statistics of the private data and are **outside** the privacy guarantee. Every reported epsilon (the logs,
``accountant.json``, the model card) is :func:`ledger_result`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import speed_metrics

from opake_core import accounting
from opake_core.accounting.processes import contains_random_allocation
from opake_core.accounting.queries import MAX_PLD_STEPS
from opake_core.clipping import AdaptiveClipState
from opake_core.errors import StateError
from opake_core.step import DPState, StepMetrics
from opake_core.tree import PerGroup
from opake_torch.transformers.keys import RunKeys
from opake_torch.transformers.privacy import PrivacyPlan

__all__ = [
    "NOISE_ONLY_BATCHES",
    "NOISE_ONLY_MIN",
    "RESTORED_FIELDS",
    "DPTrainerState",
    "Run",
    "ledger_result",
    "privacy_logs",
]

NOISE_ONLY_BATCHES = 2
"""Expected batches of examples, all with a non-finite gradient and in a row, after which a run stops."""
NOISE_ONLY_MIN = 16
"""The fewest examples in a row, all with a non-finite gradient, after which a run stops."""
RESTORED_FIELDS = ("global_step", "epoch", "log_history", "best_metric", "best_global_step", "best_model_checkpoint")
"""The fields of a checkpoint's ``trainer_state.json`` that a resumed run continues from."""

logger = logging.getLogger(__name__)


@dataclass
class DPTrainerState(TrainerState):
    """Hugging Face's ``TrainerState`` plus the resolved privacy parameters of the run."""

    privacy_resolved_delta: float | None = None
    privacy_resolved_noise_multiplier: float | None = None
    privacy_calibration_source: str | None = None
    privacy_target_epsilon_reached: bool = False


@dataclass
class Run:
    """The state of one ``train()`` call (module docstring)."""

    plan: PrivacyPlan
    keys: RunKeys
    ledger: accounting.Ledger
    params: dict[str, torch.Tensor]
    opt_state: Any
    dp_state: DPState
    sampler_state: Any
    schedule: Any
    loss_sum: torch.Tensor
    clip_sum: torch.Tensor
    nonfinite: torch.Tensor
    dropped: torch.Tensor  # the examples with a non-finite gradient since the last row (int64, on the device)
    noise_std: float | PerGroup = 0.0  # of the last step, from its metrics
    example_metrics: Any = None  # sums of the loss's per-example log values (add(aux), drain(mean)), if it has any
    router_setup: Any = None  # the MoE router release's RouterSetup (router_aux_loss_coef > 0), else None
    router_release: Any = None  # the MoE router release's release_fn (router_aux_loss_coef > 0), else None
    router_state: Any = None  # its RouterState: the filtered, noised load estimate the next step uses
    dataset: Any = None  # the DatasetFingerprint of the training data (private: saved in dp_state.json only)
    step: Any = None  # the step function: (params, opt_state, dp_state, batches) -> (..., metrics)
    optimizer: Any = None  # the core optimizer (its eval_params give the published weights)
    released: Any = None  # the step's optimizer as a ReleasedNorm: the norm of the last noised gradient (grad_norm)
    restored: Any = None  # the checkpoint's TrainerState a resume continues (RESTORED_FIELDS), None for a fresh start
    checkpoint: Any = None  # the folder of that checkpoint (a Path), None for a fresh start
    count: int = 0
    examples: int = 0  # the examples of the steps since the last row (this rank's)
    total_loss: float = 0.0
    total_count: int = 0
    total_nonfinite: int = 0
    total_dropped: int = 0  # over the run and every rank: examples with a non-finite gradient
    total_examples: int = 0
    streak: tuple[int, int] = (0, 0)  # (examples, steps) of the last log rows in a row whose examples were all dropped
    noise_only: str = ""  # which examples were all dropped, when the last row found noise only (module docstring)

    @staticmethod
    def start(
        plan: PrivacyPlan,
        keys: RunKeys,
        ledger: accounting.Ledger,
        *,
        params: dict[str, torch.Tensor],
        opt_state: Any,
        dp_state: DPState,
        schedule: Any,
        device: torch.device,
        step: Any = None,
        optimizer: Any = None,
        released: Any = None,
        example_metrics: Any = None,
        router: tuple[Any, Any, Any] | None = None,
    ) -> Run:
        """A run before its first step; the sums are zeros on ``device``. ``router``: the MoE router release's
        ``(RouterSetup, release_fn, RouterState)``."""
        zero = torch.zeros((), device=device)
        return Run(
            plan=plan,
            keys=keys,
            ledger=ledger,
            params=dict(params),
            opt_state=opt_state,
            dp_state=dp_state,
            sampler_state=plan.sampler.init(),
            schedule=schedule,
            step=step,
            optimizer=optimizer,
            released=released,
            loss_sum=zero.clone(),
            clip_sum=zero.clone(),
            nonfinite=torch.zeros((), dtype=torch.int64, device=device),
            dropped=torch.zeros((), dtype=torch.int64, device=device),
            example_metrics=example_metrics,
            router_setup=None if router is None else router[0],
            router_release=None if router is None else router[1],
            router_state=None if router is None else router[2],
        )

    def trainer_state(self, args: Any) -> DPTrainerState:
        """The trainer state at the start of the run: its planned steps (``max_steps``, which sizes the progress bar:
        :attr:`.privacy.PrivacyPlan.planned_steps`), intervals and resolved privacy parameters, and for a resumed run
        the step, logs and best checkpoint it continues from."""
        plan, steps = self.plan, self.plan.planned_steps  # a target epsilon's predicted stop, else the whole run
        state = DPTrainerState(
            max_steps=steps,
            num_train_epochs=math.ceil(steps / plan.steps_per_epoch),
            logging_steps=_as_count(args.logging_steps, steps),
            eval_steps=_as_count(args.eval_steps or args.logging_steps, steps),
            save_steps=_as_count(args.save_steps, steps),
            train_batch_size=args.train_batch_size,
            is_local_process_zero=args.local_process_index == 0,
            is_world_process_zero=args.process_index == 0,
            privacy_resolved_delta=plan.delta,
            privacy_resolved_noise_multiplier=plan.noise_multiplier,
            privacy_calibration_source=plan.calibration_source,
        )
        for name in RESTORED_FIELDS if self.restored is not None else ():
            setattr(state, name, getattr(self.restored, name))
        return state

    def add(self, metrics: StepMetrics) -> None:
        """Add one step's metrics to the sums (no host sync: a non-finite loss is counted, not added)."""
        finite = torch.isfinite(metrics.loss)
        self.loss_sum += torch.where(finite, metrics.loss, 0.0)
        self.nonfinite += ~finite
        self.dropped += metrics.nonfinite
        self.examples += metrics.batch_size
        self.clip_sum += metrics.clip_rate
        self.noise_std = metrics.noise_std
        if self.example_metrics is not None:
            self.example_metrics.add(metrics.aux)
        self.count += 1

    def release_router(self, metrics: StepMetrics, *, reduce: Any) -> StepMetrics:
        """Release this step's router load statistic (``metrics.aux``) into :attr:`router_state` (``reduce``: the
        sum over DDP ranks); returns the metrics without it, so that the un-noised statistic goes no further."""
        self.router_state = self.router_setup.step(
            self.router_release,
            self.router_state,
            metrics.aux,
            expected_batch_size=self.plan.expected_batch_size,
            reduce=reduce,
        )
        return dataclasses.replace(metrics, aux=None)

    def clipping_bound(self, configured: float | dict[str, float]) -> float:
        """The clipping bound in effect: adaptive clipping's current one, else the configured (per-group: the norm
        of the group bounds)."""
        clip = self.dp_state.clip
        if isinstance(clip, AdaptiveClipState):
            return clip.clipping_norm
        if isinstance(configured, dict):
            return math.sqrt(sum(v * v for v in configured.values()))
        return float(configured)

    def drain(
        self,
        *,
        learning_rate: float,
        clipping_norm: float | dict[str, float],
        mean: Any,
        total: Any = lambda value: value,
    ) -> dict[str, float]:
        """The log row of the steps since the last one, and the sums reset. ``mean`` averages a logged value over
        ranks, ``total`` sums a count over ranks (both the identity in one process; ``total`` is a collective that
        every rank runs, so that all take the same ``noise_only`` decision)."""
        nonfinite = int(self.nonfinite.item())
        finite = self.count - nonfinite
        loss_sum, clip_sum = mean(self.loss_sum), mean(self.clip_sum)
        loss = (loss_sum / finite).item() if finite else math.nan
        dropped, examples = (
            round(v) for v in total(torch.stack([self.dropped, self.dropped.new_tensor(self.examples)])).tolist()
        )
        self.total_dropped += dropped
        self.total_examples += examples
        if nonfinite or dropped:
            logger.warning(
                "%d of the %d examples of the last %d steps had a non-finite gradient (NaN or inf) and were dropped "
                "(%d of these steps had a non-finite loss): they added nothing to the clipped sum, but the steps "
                "still released noise and are charged to epsilon. Check the learning rate, the data, the loss, and "
                "bf16 overflow.",
                dropped,
                examples,
                self.count,
                nonfinite,
            )
        if dropped < examples:
            self.streak = (0, 0)
        elif examples:
            self.streak = (self.streak[0] + examples, self.streak[1] + self.count)
        if self.streak[0] >= max(NOISE_ONLY_MIN, NOISE_ONLY_BATCHES * self.plan.expected_batch_size):
            self.noise_only = f"all {self.streak[0]} examples of the last {self.streak[1]} steps"
        self.total_nonfinite += nonfinite
        logs = {
            "loss": loss,
            "learning_rate": learning_rate,
            "privacy_clip_rate": (clip_sum / self.count).item(),
            "privacy_clipping_norm": self.clipping_bound(clipping_norm),
            **_noise_std_logs(self.noise_std),
            "nonfinite_loss_steps": self.total_nonfinite,
            "nonfinite_examples": self.total_dropped,
            **(self.example_metrics.drain(mean) if self.example_metrics is not None else {}),
            **_router_logs(self.router_state),
            **privacy_logs(self.plan, self.ledger),
        }
        if finite:
            self.total_loss += loss * finite
            self.total_count += finite
        for running in (self.loss_sum, self.clip_sum, self.nonfinite, self.dropped):
            running.zero_()
        self.count = self.examples = 0
        return logs

    def noise_only_error(self) -> StateError:
        """The error that stops a run that released noise only (:attr:`noise_only`)."""
        return StateError(
            f"{self.noise_only} had a non-finite gradient (NaN or inf) and were dropped: those steps released noise "
            "only, and each was charged to epsilon. Training stops here, before more budget is spent. Check the loss "
            "for NaN gradients (a sqrt or log at 0, a division by zero), the learning rate, the data and bf16 "
            "overflow; the steps already taken stay in the ledger."
        )

    def final_metrics(self, start_time: float, *, steps: int, trained: int, dataset_size: int) -> dict[str, float]:
        """``TrainOutput.metrics`` of a run at step ``steps`` that ran ``trained`` steps since ``start_time``
        (``time.time()``): Hugging Face's speed metrics (``train_samples_per_second`` counts the expected rows of
        those steps, as Hugging Face counts the nominal batch), ``train_samples`` (the rows of the training dataset),
        the loss and the privacy parameters. ``DPTrainer.log`` adds ``epoch``."""
        samples = trained * self.plan.expected_batch_size
        if trained and not self.total_count:
            logger.warning(
                "no step of this run had a finite loss: train_loss is NaN (the steps still released noise and are "
                "charged to epsilon)."
            )
        return {
            **speed_metrics("train", start_time, num_samples=samples, num_steps=trained),
            "train_steps": float(steps),
            "train_samples": dataset_size,
            "train_loss": self.total_loss / self.total_count if self.total_count else math.nan,
            "nonfinite_loss_steps": self.total_nonfinite,
            "nonfinite_examples": self.total_dropped,
            **privacy_logs(self.plan, self.ledger),
        }

    def agreement(self, args: Any, global_step: int) -> dict[str, Any]:
        """What every DDP rank must hold identically: keys, step counters, the privacy configuration and the training
        data's fingerprint (the keys and the fingerprint are secrets: a mismatch names them without their values)."""
        plan = self.plan
        return {
            "noise_key": self.keys.noise,
            "sampler_key": self.keys.sampler,
            "global_step": global_step,
            "dp_step": self.dp_state.step,
            "sampler_step": self.sampler_state.step,
            "noise_multiplier": plan.noise_multiplier,
            "expected_batch_size": plan.expected_batch_size,
            "sample_rate": plan.sample_rate,
            "ddp_shard": args.ddp_shard,
            "total_steps": plan.total_steps,
            "delta": plan.delta,
            "mechanism": args.privacy_noise_mechanism,
            "mechanism_kwargs": {k: str(v) for k, v in args.privacy_noise_mechanism_kwargs.items()},
            "clipping_norm": args.clipping_norm,
            "clipping_mode": args.clipping_mode,
            "optim": args.optim,
            "learning_rate": args.learning_rate,
            "parameters": sorted(self.params),
            "dataset": None if self.dataset is None else self.dataset.sha256,  # secret: never shown (topology)
        }


def privacy_logs(plan: PrivacyPlan, ledger: accounting.Ledger) -> dict[str, float]:
    """The public privacy parameters; epsilon is that of the whole ledger (earlier calls and resumes too)."""
    logs = {"privacy_noise_multiplier": plan.noise_multiplier}
    if plan.accounted:
        logs["privacy_epsilon"] = ledger_result(ledger, plan.delta).value
        logs["privacy_delta"] = plan.delta
    return logs


@functools.lru_cache(maxsize=64)
def ledger_result(ledger: accounting.Ledger, delta: float) -> accounting.Result:
    """Epsilon of ``ledger`` at ``delta`` and the accountant that answered, computed once per distinct history (the
    logs, ``accountant.json`` and the model card share it): the ledger's default query (PLD, RDP for sampling without
    replacement, Monte Carlo where dp-accounting has no event).

    Beyond :data:`~opake_core.accounting.queries.MAX_PLD_STEPS` releases, where a PLD composition takes minutes to
    hours and is refused, the RDP accountant answers instead (random allocation keeps its Monte Carlo query): a
    looser upper bound, so the reported epsilon is never too small, and the result names it.
    """
    if ledger.releases > MAX_PLD_STEPS and not contains_random_allocation(ledger.process()):
        return ledger.epsilon(delta=delta, accountant="rdp")
    return ledger.epsilon(delta=delta)


def _router_logs(state: Any) -> dict[str, float]:
    """The router release's public log values (post-processing of the noised releases): the estimated worst relative
    overload of an expert, ``router_aux_imbalance``, and the noise std of the filtered estimate,
    ``router_aux_noise_std``. The un-noised batch statistic is never logged."""
    if state is None:
        return {}
    return {"router_aux_imbalance": state.imbalance, "router_aux_noise_std": state.filtered_noise_std}


def _noise_std_logs(std: float | PerGroup) -> dict[str, float]:
    """``privacy_noise_std``: the per-coordinate standard deviation of the noise the last step added to the
    normalized update (per group: ``privacy_noise_std_<group>``)."""
    if isinstance(std, PerGroup):
        return {f"privacy_noise_std_{name}": float(value) for name, value in std.values}
    return {"privacy_noise_std": float(std)}


def _as_count(value: int | float, total: int) -> int:
    """A step interval: an int count, or a float fraction of the run (rounded up, at least 1)."""
    return max(1, math.ceil(value * total)) if isinstance(value, float) and value < 1 else max(1, int(value))
