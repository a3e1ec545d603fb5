"""``DPTrainer``: Hugging Face-style training with a differential-privacy guarantee.

A training step is the core DP-SGD step, nothing more: sample a Poisson batch, per-example gradients, clip, noise,
optimizer update, then account. This class adds what users of ``transformers.Trainer`` expect at the edges:
arguments, callbacks, progress, logs, evaluation, checkpoints that resume exactly.

Logged values other than the privacy parameters (loss, clip rate, accuracy...) are exact statistics of the private
data and are **outside** the privacy guarantee; keep them private. The ``transformers.Trainer`` methods example
scripts call behave as Hugging Face's; ``save_model`` also writes a model card that states the guarantee.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers.trainer_callback import TrainerControl
from transformers.trainer_utils import PredictionOutput, TrainOutput, enable_full_determinism, set_seed

from opake_core import accounting
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.state_files import check_savable
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers import coupling, engines, preemption, preflight, resume, saving
from opake_torch.transformers.arguments import TrainingArguments, as_training_arguments
from opake_torch.transformers.compile import CudaGraphChunk, EagerAfterFailedCapture
from opake_torch.transformers.data import fetch, model_input_names
from opake_torch.transformers.dataset_check import packed_block, require_random_access
from opake_torch.transformers.engines import step_factory
from opake_torch.transformers.evaluation import prediction_loop
from opake_torch.transformers.hf_surface import (
    HFSurface,
    apply_log_level,
    build_model,
    callback_handler,
    refuse_overrides,
)
from opake_torch.transformers.keys import RunKeys, first_keys
from opake_torch.transformers.loaders import DataLoaders
from opake_torch.transformers.loss import (
    batch_losses,
    fused_causal_lm_losses,
    fused_head,
    hf_loss,
    infer_task,
    logits_losses,
)
from opake_torch.transformers.microbatch import ShrinkingStep
from opake_torch.transformers.model_card import write_trainer_card
from opake_torch.transformers.model_setup import check_inputs, prepare_model, with_training_patches
from opake_torch.transformers.optimizer import build_optimizer, build_schedule, check_optimizer_factory, probe_optimizer
from opake_torch.transformers.privacy import PrivacyPlan
from opake_torch.transformers.released_norm import ReleasedNorm
from opake_torch.transformers.routers import RouterSetup, router_logits_off, with_load
from opake_torch.transformers.run_state import DPTrainerState, Run, ledger_result
from opake_torch.transformers.step_losses import batched_loss, example_loss
from opake_torch.transformers.step_perf import StepPerf, TimedOptimizer
from opake_torch.transformers.topology import topology
from opake_torch.transformers.users import (
    Users,
    check_trainer,
    user_batch_losses,
    user_example_loss,
    users_of,
    without_column,
)

__all__ = ["DPTrainer", "DPTrainerState"]

logger = logging.getLogger(__name__)


class DPTrainer(HFSurface, DataLoaders):
    """Train a Hugging Face model (or any module whose output has ``.logits``) with DP-SGD.

    Args:
        model: the model; moved to ``args.device``. PEFT models train their adapters only (frozen weights are
            passed through).
        args: :class:`TrainingArguments`, which must name a privacy knob (a noise multiplier or a target epsilon);
            see :func:`.arguments.as_training_arguments` for a ``transformers.TrainingArguments``.
        data_collator: ``list of examples -> batch dict``; defaults to right-padding with ``processing_class``'s pad
            token.
        train_dataset: a map-style dataset of dicts (``len`` and ``[i]``).
        eval_dataset: the same, for :meth:`evaluate`.
        processing_class: the tokenizer (used for the pad token and saved with the model).
        model_init: ``() -> model`` (or ``(trial) -> model``), called once when ``model`` is None, after
            ``set_seed(args.seed)``, as Hugging Face's.
        compute_loss_func: replaces the loss inferred from the model class, applied to each example on its own:
            Hugging Face's ``(outputs, labels, num_items_in_batch) -> loss`` (a batch of one, ``num_items_in_batch``
            the example's own count of target labels: :class:`.loss.HFLoss`), or ``(logits, labels) -> scalar`` on
            one example's tensors without batch dimension.
        compute_metrics: ``EvalPrediction -> dict`` for evaluation.
        preprocess_logits_for_metrics: ``(logits, labels) -> tensor``, applied to each evaluation batch's logits
            before they are kept for ``compute_metrics`` (the loss reads the logits themselves), as Hugging Face's.
        callbacks: ``transformers.TrainerCallback`` instances or classes.
        optimizers: must be ``(None, None)``; choose the optimizer with ``args.optim``.
        optimizer_cls_and_kwargs: ``(factory, kwargs)``, Hugging Face's argument for a custom optimizer: the run's
            optimizer is ``factory(lr=schedule, **kwargs)`` (``schedule``: step -> learning rate, from
            ``learning_rate``, ``lr_scheduler`` and ``warmup_steps``), which must be an
            :class:`opake_core.optim.Optimizer`; ``args.optim`` and ``args.optim_args`` are then unused.

    A subclass that overrides ``compute_loss``, ``training_step`` or ``create_optimizer`` is refused (they would be
    ignored); override :meth:`compute_per_example_loss` and :meth:`compute_batch_losses` instead. The batches
    (:meth:`fetch_batch`) and data loaders (``get_train_dataloader``...) come from :class:`.loaders.DataLoaders`, the
    other methods scripts call (``log``, ``log_metrics``, ``add_callback``...) from :class:`.hf_surface.HFSurface`.

    Example: two DP-SGD steps on a tiny causal LM; the ledger holds exactly the two Poisson-sampled Gaussian
    releases (expected batch 8 of 40 rows), and its epsilon is the accountant's for them.

        >>> import tempfile
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from opake_core import accounting
        >>> from opake_torch import DPTrainer, TrainingArguments
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> rows = [{"input_ids": torch.arange(i % 8, i % 8 + 8)} for i in range(40)]
        >>> folder = tempfile.TemporaryDirectory()
        >>> args = TrainingArguments(folder.name, per_device_train_batch_size=8, max_steps=2, use_cpu=True,
        ...                          privacy_noise_multiplier=1.0, save_strategy="no", report_to="none",
        ...                          logging_strategy="no", disable_tqdm=True)
        >>> trainer = DPTrainer(model, args, train_dataset=rows)
        >>> _ = trainer.train()  # logs the loss, the noise and the epsilon spent
        {'loss': ..., 'privacy_epsilon': ...}
        {'train_runtime': ...}
        >>> trainer.ledger.entries
        ((Poisson(inner=Gaussian(noise_multiplier=1.0), sample_rate=0.2), 2),)
        >>> run = accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.2), 2)
        >>> trainer.ledger.epsilon(delta=1e-5) == accounting.epsilon(run, delta=1e-5)
        True
        >>> folder.cleanup()
    """

    privacy_unit: ClassVar[str | None] = None  # the card's unit; None: one sequence (causal LM) or one example

    def __init__(
        self,
        model: nn.Module | None,
        args: TrainingArguments,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> None:
        refuse_overrides(type(self))
        if args is not None:  # a transformers.TrainingArguments is converted (from_hf), or refused without a budget
            args = as_training_arguments(args)
            # as Hugging Face's Trainer: dropout and model_init draw from the seeded generators; full_determinism
            # also makes torch's kernels deterministic (never the DP noise or sampling: see privacy_noise_seed)
            enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        model = build_model(model, model_init)
        check_inputs(model, args, optimizers, TrainingArguments)
        self._optimizer_factory = check_optimizer_factory(optimizer_cls_and_kwargs)
        self.model_init = model_init
        self.packed_block: int | None = None  # the block length where the training rows look packed (the card's unit)
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        # the core optimizer (functional: its state lives in the run and its checkpoints) and the learning-rate
        # schedule (step -> rate) of the train() in progress, else of the last one; None before the first
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self._step_perf: StepPerf | None = None  # the phase clock of the run in progress (args.step_perf)
        self.args = args
        apply_log_level(args)
        self.topology = topology(args)  # one process, or DDP ranks under torchrun
        self.model, self.compat_patches, self.performance_patches = prepare_model(model, args, self.topology)
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None:  # refused now, not at train(): sampling needs the size and rows by index
                require_random_access(dataset, name)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.data_collator = data_collator
        self.compute_loss_func, self.compute_metrics = hf_loss(compute_loss_func, model), compute_metrics
        self.chunk_graphs: CudaGraphChunk | None = None  # the CUDA-graph captures of the chunk (cuda_graphs > 0)
        self.task = None if compute_loss_func is not None else infer_task(model)
        self.label_names = tuple(args.label_names or ["labels"])
        # the dataset columns a batch keeps (None: all of them); a subclass whose loss reads another column adds it
        self.dataset_columns = (
            (model_input_names(model) | set(self.label_names) | {"label"}) if args.remove_unused_columns else None
        )
        self._apply, self._params, self._frozen = functional_model(self.model)
        if not self._params:
            raise ConfigurationError("the model has no trainable parameter (requires_grad=True).")
        fused = "fused_linear_cross_entropy" in self.performance_patches and self.task == "causal_lm"
        fused = fused and not args.label_smoothing_factor
        # the causal-LM loss from the final hidden states, logits never materialized (frozen heads only)
        self._fused_head = fused_head(self.model, set(self._params)) if fused else None
        self._ce_kernel = "cross_entropy" in self.performance_patches  # the token losses through the Triton kernel
        self._keys = first_keys(args, share=self.topology.shared_key)  # secrets: never logged or published
        self._ledger = accounting.Ledger()  # what this trainer's train() calls released, in order
        self._trained = False  # a later fresh train() call is a new segment, with new keys
        self._plan: PrivacyPlan | None = None
        self._own_loss = type(self).compute_per_example_loss is DPTrainer.compute_per_example_loss
        # a loss with per-example log values (TRL's metrics): example_metrics() sums them, *_and_metrics compute them
        self._example_metrics = getattr(self, "example_metrics", None)
        # the private MoE router release (router_aux_loss_coef > 0): its loss returns each example's load statistic
        self._router = RouterSetup.of(self.model, args) if args.router_release else None
        if self._router is not None and self._example_metrics is not None:
            raise ConfigurationError(
                f"{type(self).__name__} logs per-example metrics (example_metrics), which take the loss's auxiliary "
                "output that the router release (router_aux_loss_coef > 0) needs too; the two are not combined. Set "
                "router_aux_loss_coef=0.0, or drop example_metrics."
            )
        self._router_state = None  # the last train()'s RouterState (the public, noised load estimate)
        self._users: Users | None = None  # privacy_unit="user": the users of the training dataset, read by train()
        if args.privacy.user_level:
            check_trainer(self)
            if self.topology.is_sharded:
                raise ConfigurationError(
                    "privacy_unit='user' is not combined with fsdp yet: the sharded step's idle passes and its "
                    "engine check run one row, not one user. Train user-level under DDP (torchrun without fsdp) or "
                    "on one process."
                )
        self._live: Run | None = None  # the run of the train() in progress
        unbatched = not self._own_loss and type(self).compute_batch_losses is DPTrainer.compute_batch_losses
        metrics = self._example_metrics is not None
        batched, reasons = batched_loss(self, self._router, with_metrics=metrics, unbatched=unbatched)
        if args.privacy.user_level and batched is not None:  # a user's rows as one example of the layerwise engine
            batched = user_batch_losses(batched, args.privacy_user_reduction)
        self._layerwise = engines.layerwise_engine(self.model, self._params, args, batched, reasons=reasons)
        if self.topology.is_sharded:  # FSDP2: sharded now, before the model reaches the device
            self._shard()
        self.callback_handler = callback_handler(args, self.model, processing_class, callbacks)
        self.state = DPTrainerState(
            is_local_process_zero=args.local_process_index == 0, is_world_process_zero=args.process_index == 0
        )
        self.control = self.callback_handler.on_init_end(args, self.state, TrainerControl())

    # -- losses ----------------------------------------------------------------------------------------------------

    def compute_per_example_loss(
        self, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The loss of **one** example (tensors without batch dimension) at trainable parameters ``params``.

        This is the seam for other objectives (SFT variants, DPO): override it, and use ``self.apply_model(params,
        **inputs)`` to run the model. It runs under ``vmap(grad)``: no in-place operations, no branching on tensor
        values, and nothing computed from other examples.
        """
        return self.compute_batch_losses(params, {k: v[None] for k, v in example.items()})[0]

    def compute_batch_losses(self, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every example's loss ``[m]`` from one batched forward: the batched form of
        :meth:`compute_per_example_loss` (whose default is this on a batch of one), which the layerwise engine runs
        (row ``i`` must equal the per-example loss of example ``i``; the engine checks this on two examples before
        training). A subclass that overrides :meth:`compute_per_example_loss` overrides this too, or gets vmap.
        """
        if self._fused_head is not None:
            return fused_causal_lm_losses(
                self._apply, params, self._frozen, batch, self._fused_head, label_names=self.label_names
            )
        return batch_losses(
            self._apply,
            params,
            self._frozen,
            batch,
            task=self.task,
            label_names=self.label_names,
            compute_loss_func=self.compute_loss_func,
            label_smoothing=self.args.label_smoothing_factor,
            kernel=self._ce_kernel,
        )

    def apply_model(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run the model with trainable parameters ``params`` (the frozen ones and buffers are filled in)."""
        return self._apply(params, self._frozen, *args, **kwargs)

    def _loss_fn(self, with_metrics: bool = False, router: bool = False) -> Any:
        """One example's loss under the run's autocast, with its log values or the router release's surrogate and
        statistic (:func:`.step_losses.example_loss`); with ``privacy_unit="user"``, one user's
        (:func:`.users.user_example_loss`)."""
        loss = example_loss(self, self._router if router else None, with_metrics=with_metrics)
        if self.args.privacy.user_level:
            return user_example_loss(loss, self.args.privacy_user_reduction)
        return loss

    # -- training --------------------------------------------------------------------------------------------------

    def _start(self, resume_from_checkpoint: str | bool | None) -> Run:
        """The run of a ``train()`` call at the step it continues from, once its data passed the checks: what the
        checkpoint or this trainer's history decide (:func:`.resume.resume`), with the step of :meth:`_start_run`."""
        args = self.args
        if self.train_dataset is None:
            raise ConfigurationError("train() needs a train_dataset.")
        self._check_data(self.train_dataset, "train_dataset", training=True)  # every row, before any step
        if self.eval_dataset is not None and (args.eval_strategy != "no" or args.eval_on_start):
            self._check_data(self.eval_dataset, "eval_dataset", training=False)
        run = resume.resume(
            resume_from_checkpoint, args=args, dataset=self.train_dataset, columns=self.dataset_columns,
            ledger=self._ledger, keys=self._keys, trained=self._trained, model=self.model, topology=self.topology,
            router_settings=None if self._router is None else self._router.settings(), start=self._start_run,
            users=self._users,
        )  # fmt: skip
        self._keys, self._live, self.state = run.keys, run, run.trainer_state(args)
        self.optimizer, self.lr_scheduler = run.optimizer, run.schedule
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = run.optimizer, run.schedule
        return run

    def _start_run(self, plan: PrivacyPlan, keys: RunKeys, ledger: accounting.Ledger) -> Run:
        """The run before its first step, from ``ledger``: the plan's step with the noise key of ``keys``, on the
        engine that passed the checks before any budget is spent (:mod:`.preflight`)."""
        args, router, metrics = self.args, self._router, self._example_metrics is not None
        geometry = None if router is None else router.geometry
        if self._layerwise is not None and len(self.train_dataset):  # checked once per train() on two examples
            check_loss = self._loss_fn()
            if router is not None:  # the loss with its surrogate, at the uniform load k / E
                with_router = self._loss_fn(router=True)
                check_loss = lambda params, example: with_router(params, example)[0]  # noqa: E731
            self._layerwise = preflight.verified_engine(self, self._layerwise, loss_fn=check_loss, geometry=geometry)
        # default chunk: the expected batch per device, the memory of one non-private step; a larger Poisson draw
        # runs as equal chunks
        microbatch = args.microbatch_size or max(1, math.ceil(plan.expected_batch_size / args.world_size))
        loss_fn = self._loss_fn(with_metrics=metrics, router=router is not None)
        self._layerwise = preflight.independent_engine(  # the neighbour test, before any budget is spent
            self, self._layerwise, loss_fn=loss_fn, has_aux=metrics or router is not None, geometry=geometry,
            microbatch=microbatch, own_loss=self._own_loss,
        )  # fmt: skip
        if self.topology.is_sharded and self._layerwise is None:  # a check failed under 'auto': vmap cannot shard
            self._shard()
        release = None if router is None else router.release(
            noise_multiplier=plan.noise_multiplier, expected_batch_size=plan.expected_batch_size, noise_key=keys.noise
        )  # fmt: skip
        # a target epsilon's predicted stop ends the schedule
        optimizer = build_optimizer(args, plan.planned_steps, self._optimizer_factory)
        opt_state = optimizer.init(self._params)
        if self._optimizer_factory is not None:  # refused now, not at the first save after budget was spent
            check_savable(opt_state, "the state of the optimizer from optimizer_cls_and_kwargs")
        released = ReleasedNorm(optimizer)  # what the step's optimizer receives, for grad_norm
        self._step_perf = perf = StepPerf(args.device) if args.step_perf else None  # off: no mark in the step
        transform = engines.chunk_transform(args, keep=lambda graphs: setattr(self, "chunk_graphs", graphs))
        factory = functools.partial(
            step_factory,
            plan,
            args,
            loss_fn,
            params=self._params,
            optimizer=released if perf is None else TimedOptimizer(released, perf),
            clipping=plan.clipping_for(self._params),
            key=keys.noise,
            topology=self.topology,
            has_aux=metrics or release is not None,
            perf=perf,
        )
        make_step = factory(engine=engines.engine(args, self._layerwise, transform, microbatch=microbatch))
        step_fn, dp_state = make_step(microbatch)
        if args.auto_find_microbatch_size:
            step_fn = ShrinkingStep(make_step, step_fn, microbatch)
        if args.cuda_graphs:  # a failed capture hands over to the step without captures and their dead rows
            eager = factory(engine=engines.engine(args, self._layerwise, None, microbatch=microbatch))
            step_fn = EagerAfterFailedCapture(step_fn, lambda: eager(microbatch)[0], lambda: self.chunk_graphs)
        idle = None
        if self.topology.is_sharded:  # every rank runs as many passes as the busiest one, idle ones on one row
            idle_batch = self.fetch_batch(self.train_dataset, np.arange(1))
            idle = lambda: self._layerwise(None, (self.topology.sum_like, idle_batch), (1,))  # noqa: E731
        if not args.auto_find_microbatch_size:  # (whose retries rebuild the step; one process only)
            step_fn = self.topology.model_step(step_fn, self.model, microbatch=microbatch, idle=idle)
        return Run.start(
            plan, keys, ledger, params=self._params, opt_state=opt_state, dp_state=dp_state,
            schedule=build_schedule(args, plan.planned_steps), device=args.device, step=step_fn, optimizer=optimizer,
            released=released,
            example_metrics=self._example_metrics() if metrics else None,
            router=None if release is None else (router, *release),
        )  # fmt: skip

    def _shard(self) -> None:
        """FSDP2: shard the model (once); the trainable parameters become this rank's rows and the model runs as a
        module (its FSDP hooks gather the weights), not from ``params``. Refuses what needs whole weights."""
        if self._layerwise is None:
            raise ConfigurationError(
                "fsdp needs the layerwise per-example gradients engine, which this run cannot use (see the log for the "
                "reason): vmap(grad) differentiates the whole model per example and cannot run on sharded weights. "
                "Drop fsdp and launch as DDP under torchrun, or make the model's trainable layers served by the "
                "layerwise engine (per_example_gradients='layerwise' says which are not)."
            )
        optimizer = probe_optimizer(self.args, self._optimizer_factory)  # what it does, however it was asked for
        if optimizer.needs_whole_leaves:
            raise ConfigurationError(
                f"the optimizer {optimizer.name} reads statistics over each whole weight (Adafactor's row and column "
                "factors, a per-tensor update RMS), which a rank sharding the rows does not see whole; under fsdp use "
                "an elementwise optimizer (adamw, adam, sgd, lion...), alone or inside schedule_free."
            )
        self._params = self.topology.shard(self.model, self._params)
        self._apply = lambda params, frozen, *args, **kwargs: self.model(*args, **kwargs)
        self._fused_head = None  # reads the head weight from the parameters, which are rows here

    def _check_data(self, dataset: Any, name: str, *, training: bool) -> None:
        """Refuse a row the loss cannot take and a model output it cannot read (:func:`.preflight.check_data`);
        ``training``: labels are required."""
        privacy = self.args.privacy
        if training and privacy.user_level:  # the user column names the unit: no model input, never in a batch
            self.dataset_columns = without_column(self.dataset_columns, dataset, privacy.privacy_user_column)
        summary = preflight.check_data(self, dataset, name, training=training, own_loss=self._own_loss)
        if training and privacy.user_level:
            self._users = users_of(privacy, dataset)
            logger.info(
                "privacy unit: a user (all its rows): %d users in column %r over %d rows, at most %d rows of a user "
                "a step, the %s of their gradients clipped to %s.",
                self._users.count, privacy.privacy_user_column, len(dataset), privacy.privacy_max_rows_per_user,
                privacy.privacy_user_reduction, privacy.clipping_norm,
            )  # fmt: skip
        if training:  # packed blocks are a row-level unit; under privacy_unit="user" the column names the unit
            self.packed_block = None if privacy.user_level else packed_block(summary, self.task)
        if training and self.packed_block is not None:
            logger.warning(
                "%s looks packed: its %d rows all hold exactly %d tokens, without padding, labelled by their own "
                "input_ids, as run_clm.py's group_texts makes by concatenating documents and cutting blocks. The "
                "privacy unit is one row, here one block of %d tokens: a document spanning k blocks is protected only "
                "at group level (group privacy: k times epsilon). The model card says so. To protect documents, give "
                "each document its own row (truncated or padded, not concatenated).",
                name, summary.rows, self.packed_block, self.packed_block,
            )  # fmt: skip
        if training and self.data_collator is not None:  # the trainer's own collation masks padding
            read = functools.partial(fetch, dataset, keep=self.dataset_columns)
            coupling.check_padding_mask(dataset, read, self._collate)

    @with_training_patches  # the process-level patches of the run, undone when train() returns or raises
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run DP training; returns Hugging Face's ``TrainOutput(global_step, training_loss, metrics)``.

        ``resume_from_checkpoint`` is a checkpoint folder, or True for the latest one under ``output_dir``: the
        weights, optimizer, sampler, keys, step and accountant are restored and the run continues the identical
        trajectory.
        """
        args, begin = self.args, time.time()
        run = self._start(resume_from_checkpoint)
        plan, first, stop = run.plan, self.state.global_step, run.plan.stop_step
        if plan.planned_steps < plan.total_steps:
            logger.info(
                "privacy_target_epsilon=%g is reached at step %d of the %d that max_steps or num_train_epochs ask for "
                "(noise multiplier %g): the run stops there, and its learning-rate schedule and progress bar are "
                "planned for %d steps.",
                args.privacy_target_epsilon, plan.planned_steps, plan.total_steps, plan.noise_multiplier,
                plan.planned_steps,
            )  # fmt: skip
        jit = preemption.Preemption(args.enable_jit_checkpoint)  # SIGTERM/SIGUSR1: checkpoint at the step's end
        try:
            jit.install()
            self.model.train()
            self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
            if args.eval_on_start and self.state.global_step == 0:
                self.evaluate(_run=run)
            while self.state.global_step < plan.total_steps and not self.control.should_training_stop:
                if stop is not None and self.state.global_step >= stop:
                    self._target_reached(run)
                    break
                epoch_before = int(self.state.epoch)
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                if self._step_perf is not None:
                    self._step_perf.begin()
                indices, run.sampler_state = plan.sampler.sample(run.keys.sampler, run.sampler_state)
                batch = self.fetch_batch(self.train_dataset, indices)
                if run.router_state is not None:  # the estimate released up to the previous step
                    batch = with_load(batch, run.router_state.load)
                if self._step_perf is not None:
                    self._step_perf.mark("sample")
                inputs = (run.params, run.opt_state, run.dp_state, (batch,))
                with router_logits_off(self.model) if self._router is not None else contextlib.nullcontext():
                    if args.auto_find_microbatch_size and len(indices):
                        outputs, shrunk = run.step(inputs, len(indices))
                        if shrunk:
                            self.log({"converged_microbatch_size": float(shrunk)})
                    else:
                        outputs = run.step(*inputs)
                run.params, run.opt_state, run.dp_state, metrics = outputs
                if self._step_perf is not None:
                    self._step_perf.end()
                if run.router_state is not None:  # released: the un-noised statistic goes no further
                    metrics = run.release_router(metrics, reduce=self.topology.reduce)
                if not plan.horizon:  # a horizon run recorded its whole release at the start
                    run.ledger = run.ledger.record(plan.release)
                run.add(metrics)
                self.state.global_step += 1
                self.state.epoch = self.state.global_step / plan.steps_per_epoch
                self._step_boundary(run)
                if stop is not None and self.state.global_step >= stop:
                    self._target_reached(run)
                    self.control.should_training_stop = True
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                if int(self.state.epoch) > epoch_before:
                    self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                signum = jit.requested()  # after the step and its ledger record: the checkpoint holds both
                self.control.should_save |= bool(signum)
                self._log_save_evaluate(run)
                if signum:
                    folder = Path(args.output_dir) / f"{ckpt.PREFIX}-{self.state.global_step}"
                    raise preemption.TrainingPreempted(signum, self.state.global_step, folder)
            if run.count:
                self._log_steps(run)
        finally:  # whatever ends the run, its releases stay charged and a later train() is a new segment
            jit.restore()
            self._plan, self._ledger, self._trained, self._live = plan, run.ledger, True, None
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            best = Path(self.state.best_model_checkpoint)
            run.params = resume.restore_weights(self.model, best, args.device, set(self._params))
        self._params = run.optimizer.eval_params(run.opt_state, run.params)  # schedule-free: the average x
        self._router_state = run.router_state
        saving.copy_into(self.model, self._params)
        self.topology.check_params(run.params)
        steps = self.state.global_step
        metrics = run.final_metrics(begin, steps=steps, trained=steps - first, dataset_size=len(self.train_dataset))
        self.log(metrics)  # adds epoch, as Hugging Face's
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if args.push_to_hub and self.is_world_process_zero():
            self.push_to_hub()
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _target_reached(self, run: Run) -> None:
        """Mark the state (``privacy_target_epsilon_reached``) and log the stop, once per run: the step, and the
        epsilon spent."""
        if self.state.privacy_target_epsilon_reached:
            return
        self.state.privacy_target_epsilon_reached = True
        spent = f" (epsilon {ledger_result(run.ledger, run.plan.delta).value:.4g} at delta {run.plan.delta:.3g})"
        logger.warning(
            "target epsilon %g reached at step %d%s: training stops.",
            self.args.privacy_target_epsilon, self.state.global_step, spent if run.plan.accounted else "",
        )  # fmt: skip

    def _log_steps(self, run: Run) -> None:
        """Log the steps since the last row (under DDP with ``average_tokens_across_devices``: means over ranks);
        StateError when they released noise only (:meth:`.run_state.Run.drain`)."""
        average = self.args.average_tokens_across_devices
        ranks = self.args.world_size if self.topology.is_distributed else 1
        total = lambda value: self.topology.mean(value) * ranks  # noqa: E731
        logs = run.drain(
            learning_rate=float(run.schedule(max(self.state.global_step - 1, 0))),
            clipping_norm=self.args.clipping_norm,
            mean=self.topology.mean if average else lambda value: value,
            total=total,
        )
        squared = run.released.squared
        if squared is not None:  # the last step's noised gradient; FSDP2: each rank holds its rows of it
            squared = total(squared) if self.topology.is_sharded else squared
            logs = {"loss": logs["loss"], "grad_norm": float(squared.sqrt()), **logs}
        if self._step_perf is not None:
            logs.update(self._step_perf.drain())
        self.log(logs)
        if run.noise_only:  # the steps that ran were released and charged: train() keeps them in the ledger
            raise run.noise_only_error()

    def _log_save_evaluate(self, run: Run) -> None:
        if self.control.should_log:
            self._log_steps(run)
        metrics = self.evaluate(_run=run) if self.control.should_evaluate else None
        if self.control.should_save:
            saving.save(
                run,
                args=self.args,
                state=self.state,
                model=self.model,
                processing_class=self.processing_class,
                topology=self.topology,
                metrics=metrics,
                files=self._checkpoint_files(),
            )
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _step_boundary(self, run: Run) -> None:
        """A subclass's own state that follows the released weights ``run.params``, updated at the end of each step:
        after the optimizer update and ``global_step``'s increment, before the callbacks, checkpoint and evaluation
        of that step (:class:`~.trl.DPOTrainer`'s synced reference)."""

    def _checkpoint_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """A subclass's own training state as safetensors files ``{file name: {name: tensor}}``, sealed into every
        resumable checkpoint; its ``_start`` reads them back from ``run.checkpoint``."""
        return {}

    # -- saving ----------------------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None) -> Path:
        """Save the trained weights, the tokenizer, ``accountant.json`` and the model card (``README.md``, which
        states the guarantee; for a PEFT adapter it replaces peft's generic card) to ``output_dir``.

        Nothing secret is written: no keys, noise, optimizer or sampler state.
        """
        folder = Path(output_dir or self.args.output_dir)
        saving.copy_into(self.model, self._params)
        whole = self.topology.full_state(self.model)  # FSDP2: gathered from the shards on every rank
        if not self.args.should_save:  # DDP: one writer (per node with save_on_each_node)
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        saving.save_weights(
            self.model, self.processing_class, folder, safe=self.args.save_safetensors, state_dict=whole
        )
        plan = self.privacy_plan
        if plan is not None and plan.accounted:
            saving.write_accountant(folder, self.args, plan, self.ledger)
        write_trainer_card(self, folder)
        return folder

    # -- evaluation ------------------------------------------------------------------------------------------------

    @with_training_patches
    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval", *, _run: Run | None = None) -> dict:
        """Mean per-example loss (and ``compute_metrics``) on ``eval_dataset``; fires ``on_evaluate``."""
        params = self._params
        if _run is not None:  # during training: the model shows the run's current weights (schedule-free: x)
            params = _run.optimizer.eval_params(_run.opt_state, _run.params)
            if params is not _run.params:  # the model's tensors, which the run holds, are about to show others
                _run.params = {name: value.clone() for name, value in _run.params.items()}
            saving.copy_into(self.model, params)
        output = self._prediction_loop(eval_dataset or self.eval_dataset, metric_key_prefix, params)
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=output.metrics)
        if self.args.save_strategy == "best" and _run is not None:
            best = self.state.best_metric
            folder = Path(self.args.output_dir) / f"{ckpt.PREFIX}-{self.state.global_step}"
            saving.update_best(self.args, self.state, folder, output.metrics)
            if self.state.best_metric != best:
                self.control.should_save = True
        return output.metrics

    @with_training_patches
    def predict(self, test_dataset: Any, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions, labels and metrics on ``test_dataset``; fires ``on_predict``."""
        output = self._prediction_loop(test_dataset, metric_key_prefix, self._params)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return output

    def _prediction_loop(self, dataset: Any, prefix: str, params: dict[str, torch.Tensor]) -> PredictionOutput:
        custom = not self._own_loss
        if dataset is not None:
            self._check_data(dataset, f"{prefix} dataset", training=False)
        return prediction_loop(
            self.model,
            self.get_test_dataloader(dataset),
            args=self.args,
            label_names=self.label_names,
            logits_loss=lambda logits, labels: logits_losses(
                logits, labels, task=self.task, compute_loss_func=self.compute_loss_func
            ),
            per_example_loss=(lambda example: self.compute_per_example_loss(params, example)) if custom else None,
            compute_metrics=self.compute_metrics,
            prefix=prefix,
            preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
        )

    # -- state -------------------------------------------------------------------------------------------------------

    @property
    def router_state(self) -> Any:
        """The MoE router release's :class:`~opake_core.router_release.RouterState` after the last ``train()`` (its
        ``load`` is the filtered, noised load estimate; ``imbalance`` and ``filtered_noise_std`` are logged); None
        without the release."""
        return self._router_state

    @property
    def trainable_params(self) -> dict[str, torch.Tensor]:
        """The trainable parameters ``{name: tensor}``: during ``train()``, those the next step starts from (what a
        callback's ``on_step_begin`` reads is the iterate before that step: the model's own tensors, which each step
        writes); otherwise the trained ones. Read them, do not modify them."""
        return self._live.params if self._live is not None else self._params

    @property
    def privacy_plan(self) -> PrivacyPlan | None:
        """The privacy plan (sampler, noise multiplier, steps, release) of the ``train()`` in progress, else of the
        last one; None before the first."""
        return self._live.plan if self._live is not None else self._plan

    @property
    def ledger(self) -> accounting.Ledger:
        """What this trainer's ``train()`` calls released, in order (every reported epsilon is this ledger's, by
        :func:`.run_state.ledger_result`): of the ``train()`` in progress, else of the last one; empty before the
        first."""
        return self._live.ledger if self._live is not None else self._ledger

    @property
    def privacy_ledger(self) -> accounting.Ledger:
        """:attr:`ledger`, by its earlier name."""
        return self.ledger

    @property
    def per_example_gradients_engine(self) -> str:
        """The engine that forms the per-example gradients: ``"layerwise"`` or ``"vmap"`` (what
        ``per_example_gradients="auto"`` chose; after ``train()``, what its check against ``grad`` left)."""
        return "vmap" if self._layerwise is None else "layerwise"
