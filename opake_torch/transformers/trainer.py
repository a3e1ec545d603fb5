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
import dataclasses
import functools
import logging
import math
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers import trainer_pt_utils
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
)
from transformers.trainer_utils import PredictionOutput, TrainOutput, speed_metrics
from transformers.utils import logging as hf_logging

from opake_core import accounting, optim
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.transformers import checkpoint as ckpt
from opake_torch.transformers import checkpointing, coupling, engines
from opake_torch.transformers.arguments import LOG_LEVELS, TrainingArguments, as_training_arguments
from opake_torch.transformers.compile import CudaGraphChunk, EagerAfterFailedCapture
from opake_torch.transformers.data import collate, fetch, language_modeling_labels, model_input_names, on_device
from opake_torch.transformers.dataset_check import check_dataset, dataset_schema
from opake_torch.transformers.engines import step_factory
from opake_torch.transformers.evaluation import DataLoaders, prediction_loop
from opake_torch.transformers.fingerprint import dataset_fingerprint
from opake_torch.transformers.keys import first_keys, next_keys
from opake_torch.transformers.loss import batch_losses, fused_causal_lm_losses, fused_head, infer_task, loss_from_logits
from opake_torch.transformers.microbatch import ShrinkingStep
from opake_torch.transformers.model_card import write_trainer_card
from opake_torch.transformers.model_setup import check_inputs, prepare_model, probe_outputs
from opake_torch.transformers.moe import (
    RouterSetup,
    batched_router_loss,
    router_logits_off,
    router_loss,
    with_load,
)
from opake_torch.transformers.optimizer import build_optimizer, build_schedule
from opake_torch.transformers.privacy import PrivacyPlan, build_plan, check_next_segment, clipping_rule
from opake_torch.transformers.reporting import RunLogCallback, integration_callbacks
from opake_torch.transformers.run import DPTrainerState, Run
from opake_torch.transformers.topology import topology

__all__ = ["DPTrainer", "DPTrainerState"]

logger = logging.getLogger(__name__)

_LOSS_SEAM = "compute_per_example_loss(params, example) and compute_batch_losses(params, batch) (layerwise engine)"
SEAMS = {  # transformers.Trainer methods that DPTrainer never calls -> why, and what to use instead
    "compute_loss": f"a DP step needs every example's loss on its own, not the batch's. Override {_LOSS_SEAM}",
    "training_step": f"a step is the core's sample, clip, noise and update. Change the objective with {_LOSS_SEAM}",
    "create_optimizer": "the optimizer must take only noised gradients. Choose it with args.optim and args.optim_args",
}


def refuse_overrides(cls: type) -> None:
    """ConfigurationError when ``cls`` defines a :data:`SEAMS` method, which would be silently ignored."""
    for name, fix in SEAMS.items():
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        if owner is not None:
            raise ConfigurationError(f"{owner.__name__} overrides {name}(), which DPTrainer never calls: {fix}.")


def apply_log_level(args: TrainingArguments) -> None:
    """As ``transformers.Trainer`` does when it is built: this process's level (``args.get_process_log_level()``:
    ``log_level`` on the processes that log, ``log_level_replica`` on the others) on the ``transformers`` logger, and
    on the ``opake_torch`` logger; ``"passive"`` leaves both as they are."""
    if LOG_LEVELS[args.log_level if args.should_log else args.log_level_replica] == -1:
        return
    level = args.get_process_log_level()
    hf_logging.set_verbosity(level)
    logging.getLogger("opake_torch").setLevel(level)


class DPTrainer(DataLoaders):
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
        compute_loss_func: ``(logits, labels) -> scalar`` for **one** example (no batch dimension), replacing
            the loss inferred from the model class.
        compute_metrics: ``EvalPrediction -> dict`` for evaluation.
        callbacks: ``transformers.TrainerCallback`` instances or classes.
        optimizers: must be ``(None, None)``; choose the optimizer with ``args.optim``.

    A subclass that overrides ``compute_loss``, ``training_step`` or ``create_optimizer`` is refused (they would be
    ignored); override :meth:`compute_per_example_loss` and :meth:`compute_batch_losses` instead. The data loaders
    (``get_train_dataloader``...) come from :class:`.evaluation.DataLoaders`.
    """

    privacy_unit: ClassVar[str | None] = None  # the card's unit; None: one sequence (causal LM) or one example
    log_metrics = trainer_pt_utils.log_metrics
    save_metrics = trainer_pt_utils.save_metrics
    save_state = trainer_pt_utils.save_state
    metrics_format = staticmethod(trainer_pt_utils.metrics_format)

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Any = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
    ) -> None:
        refuse_overrides(type(self))
        if args is not None:  # a transformers.TrainingArguments is converted (from_hf), or refused without a budget
            args = as_training_arguments(args)
        check_inputs(model, args, optimizers, TrainingArguments)
        self.args = args
        apply_log_level(args)
        self.topology = topology(args)  # one process, or DDP ranks under torchrun
        self.model, self.compat_patches, self.performance_patches = prepare_model(model, args, self.topology)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.data_collator = data_collator
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
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
        self._optimizer: optim.Optimizer | None = None  # the last train()'s: eval_params gives the published weights
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
        self._live: Run | None = None  # the run of the train() in progress
        overrides = type(self).compute_per_example_loss is not DPTrainer.compute_per_example_loss
        unbatched = overrides and type(self).compute_batch_losses is DPTrainer.compute_batch_losses
        reasons = [f"{type(self).__name__} overrides compute_per_example_loss but not compute_batch_losses"]
        batched = self.compute_batch_losses
        if self._example_metrics is not None:
            batched = getattr(self, "compute_batch_losses_and_metrics", None)
            unbatched = unbatched or batched is None
        reasons = reasons if unbatched else []
        if self._router is not None:  # each example's loss with its surrogate, and its load statistic
            setup = self._router
            batched = batched_router_loss(self.model, batched, setup.geometry, coefficient=setup.coefficient)
        self._layerwise = engines.layerwise_engine(self.model, self._params, args, batched, reasons=reasons)
        reporting = [*integration_callbacks(args), RunLogCallback]  # report_to: Hugging Face's integrations
        printer = PrinterCallback if args.disable_tqdm else ProgressCallback
        self.callback_handler = CallbackHandler(
            [DefaultFlowCallback, *reporting, *(callbacks or []), printer], self.model, processing_class, None, None
        )
        self.state = DPTrainerState(
            is_local_process_zero=args.local_process_index == 0, is_world_process_zero=args.process_index == 0
        )
        self.control = TrainerControl()
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    # -- batches ---------------------------------------------------------------------------------------------------

    def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.data_collator is not None:
            batch = dict(self.data_collator(examples))
        else:
            pad = getattr(self.processing_class, "pad_token_id", None) or 0
            args = self.args
            batch = collate(
                examples, pad_token_id=pad, max_length=args.max_length, pad_to_multiple_of=args.pad_to_multiple_of
            )
        if self.task == "causal_lm":
            batch = language_modeling_labels(batch)
        return batch

    def _host_batch(self, dataset: Any, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows ``indices`` of ``dataset`` collated on the host (in a loader's worker process, for evaluation)."""
        if len(indices):
            return self._collate(fetch(dataset, indices, self.dataset_columns))
        template = self._collate(fetch(dataset, [0], self.dataset_columns))  # an empty Poisson draw is still a step
        return {k: v[:0] for k, v in template.items() if isinstance(v, torch.Tensor)}

    def _to_device(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return on_device(batch, self.args.device, pin=self.args.dataloader_pin_memory)

    def _batch(self, dataset: Any, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows ``indices`` of ``dataset`` collated onto the device, in this process."""
        return self._to_device(self._host_batch(dataset, indices))

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
        """One example's loss under the run's autocast; ``with_metrics``: ``(loss, log values)``; ``router``: ``(loss
        + router_aux_loss_coef * surrogate, load statistic s(x))`` of the router release."""
        args = self.args
        fn = self.compute_per_example_loss_and_metrics if with_metrics else self.compute_per_example_loss
        if router:
            setup = self._router

            def one(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
                return self.compute_per_example_loss(params, {k: v[0] for k, v in batch.items()})[None]

            fn = router_loss(self.model, one, setup.geometry, coefficient=setup.coefficient)

        def loss(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> Any:
            with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16):
                return fn(params, example)

        return loss

    # -- training --------------------------------------------------------------------------------------------------

    def _start(self, saved: dict[str, Any] | None, folder: Path | None) -> tuple[Run, Any]:
        """The plan, the step function and the initial run state of a ``train()`` call.

        A resume (``saved``, the checkpoint's ``dp_state.json``) continues the checkpoint's ledger and, when the
        configuration and the training data are unchanged, its keys; otherwise the call continues this trainer's own
        ledger. A changed configuration or data, or a second call, starts a new segment with new keys (see
        :mod:`.keys`).
        """
        args = self.args
        if self.train_dataset is None:
            raise ConfigurationError("train() needs a train_dataset.")
        self._check_data(self.train_dataset, "train_dataset", training=True)  # every row, before any step
        if self.eval_dataset is not None and (args.eval_strategy != "no" or args.eval_on_start):
            self._check_data(self.eval_dataset, "eval_dataset", training=False)
        if saved is None and self._trained:
            check_next_segment(args)
        self._check_router_resume(saved, folder)
        ledger = checkpointing.saved_ledger(saved, folder) if saved else self._ledger
        unchanged = saved is not None and saved["configuration"] == ckpt.configuration(args)
        data = dataset_fingerprint(self.train_dataset, self.dataset_columns)  # one pass: what a resume compares
        same_data = checkpointing.resumed_data(args, saved, folder, data)
        plan = build_plan(
            args,
            len(self.train_dataset),
            spent=ledger,
            done=saved["global_step"] if saved else 0,
            resumed_multiplier=saved["noise_multiplier"] if unchanged and same_data else None,
            delta=checkpointing.resumed_delta(args, saved, folder, len(self.train_dataset)),
        )
        fresh = lambda: next_keys(args, released=ledger.releases, share=self.topology.shared_key)  # noqa: E731
        if saved is None:  # this trainer's keys, or new ones for its next segment
            keys = fresh() if self._trained else self._keys
        else:
            keys = checkpointing.resumed_keys(
                args, saved, folder, plan, unchanged=unchanged, same_data=same_data, fresh=fresh
            )
        optimizer = self._optimizer = build_optimizer(args, plan.total_steps)
        if self._layerwise is not None and len(self.train_dataset):  # checked once per train() on two examples
            self._layerwise = self._verified_layerwise()
        transform = engines.chunk_transform(args, keep=lambda graphs: setattr(self, "chunk_graphs", graphs))
        # default chunk: the expected batch per device, the memory of one non-private step; a larger Poisson draw
        # runs as equal chunks
        microbatch = args.microbatch_size or max(1, math.ceil(plan.expected_batch_size / args.world_size))
        self._layerwise = self._independent_records(microbatch)  # the neighbour test, before any budget is spent
        router = None
        if self._router is not None:
            router = self._router.release(
                noise_multiplier=plan.noise_multiplier,
                expected_batch_size=plan.expected_batch_size,
                noise_key=keys.noise,
            )
        factory = functools.partial(
            step_factory,
            plan,
            args,
            self._loss_fn(with_metrics=self._example_metrics is not None, router=router is not None),
            params=self._params,
            optimizer=optimizer,
            clipping=clipping_rule(args, self._params),
            key=keys.noise,
            topology=self.topology,
            has_aux=self._example_metrics is not None or router is not None,
        )
        make_step = factory(engine=engines.engine(args, self._layerwise, transform, microbatch=microbatch))
        step_fn, dp_state = make_step(microbatch)
        if args.auto_find_microbatch_size:
            step_fn = ShrinkingStep(make_step, step_fn, microbatch)
        if args.cuda_graphs:  # a failed capture hands over to the step without captures and their dead rows
            eager = factory(engine=engines.engine(args, self._layerwise, None, microbatch=microbatch))
            step_fn = EagerAfterFailedCapture(step_fn, lambda: eager(microbatch)[0], lambda: self.chunk_graphs)
        run = Run.start(
            plan,
            keys,
            ledger if saved or not plan.horizon else ledger.record(plan.release),
            params=self._params,
            opt_state=optimizer.init(self._params),
            dp_state=dp_state,
            schedule=build_schedule(args, plan.total_steps),
            device=args.device,
            example_metrics=self._example_metrics() if self._example_metrics is not None else None,
            router=None if router is None else (self._router, *router),
        )
        run.dataset = data
        self._keys = keys
        return run, step_fn

    def _check_data(self, dataset: Any, name: str, *, training: bool) -> None:
        """Refuse a row the loss cannot take (:mod:`.dataset_check`: one pass over every row) and a model output it
        cannot read (one forward of the longest row); ``training``: labels are required."""
        own = type(self).compute_per_example_loss is DPTrainer.compute_per_example_loss
        schema = dataset_schema(
            self.model, task=self.task, label_names=self.label_names, own_loss=own, require_labels=training
        )
        row = check_dataset(dataset, schema, keep=self.dataset_columns, name=name).probe_row
        if own and row is not None:
            classes = schema.label_bound if self.task is not None else None
            forward = functools.partial(self.apply_model, self._params)
            batch = self._batch(dataset, np.array([row]))
            where = f"{name} row {row}"
            probe_outputs(
                self.model, forward, batch, label_names=self.label_names, task=self.task, classes=classes, where=where
            )

    def _verified_layerwise(self) -> Any:
        """The layerwise engine after its check on the first two training examples (None: ``'auto'`` fell back).
        With the router release, the check compares the loss with its surrogate at the uniform load ``k / E``."""
        batch = self._batch(self.train_dataset, np.arange(min(2, len(self.train_dataset))))
        loss_fn = self._loss_fn()
        if self._router is not None:
            geometry = self._router.geometry
            batch = with_load(batch, torch.full((geometry.num_experts,), geometry.uniform, dtype=torch.float64))
            with_router = self._loss_fn(router=True)
            loss_fn = lambda params, example: with_router(params, example)[0]  # noqa: E731
        with router_logits_off(self.model) if self._router is not None else contextlib.nullcontext():
            return engines.verified(
                self._layerwise, args=self.args, model=self.model, params=self._params, loss_fn=loss_fn, batch=batch
            )

    def _independent_records(self, microbatch: int) -> Any:
        """The engine in use after the neighbour test on a few training rows, in the step's chunks of ``microbatch``
        rows (:func:`.engines.independent`: adding one record leaves the others' per-example gradients unchanged;
        None: ``'auto'`` fell back to vmap)."""
        router, metrics = self._router is not None, self._example_metrics is not None
        geometry = self._router.geometry if router else None

        def batch_of(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            batch = self._to_device(self._collate(rows))
            if geometry is None:
                return batch
            return with_load(batch, torch.full((geometry.num_experts,), geometry.uniform, dtype=torch.float64))

        own = self.data_collator is None and type(self).compute_per_example_loss is DPTrainer.compute_per_example_loss
        read = functools.partial(fetch, self.train_dataset, keep=self.dataset_columns)
        sample = coupling.neighbour_rows(self.train_dataset, read, empty=own)
        with router_logits_off(self.model) if router else contextlib.nullcontext():
            return engines.independent(
                self._layerwise, args=self.args, model=self.model, params=self._params, batch_of=batch_of,
                loss_fn=self._loss_fn(with_metrics=metrics, router=router), has_aux=metrics or router, sample=sample,
                microbatch=microbatch,
            )  # fmt: skip

    def _check_router_resume(self, saved: dict[str, Any] | None, folder: Path | None) -> None:
        """Refuse a resume that switches the router release on or off, or changes its settings."""
        if saved is None:
            return
        now = None if self._router is None else self._router.settings()
        before = saved.get("router_release")
        if before != now:
            raise ConfigurationError(
                f"{folder} was written with the router release {'off' if before is None else before}, this run has "
                f"it {'off' if now is None else now}: a resume may not switch the MoE router release "
                "(router_aux_loss_coef, router_aux_kwargs) on or off or change its settings, since its filtered "
                "state and accounting continue across the resume. Resume with the checkpoint's settings, or start a "
                "new run."
            )

    def _router_step(self, run: Run, metrics: Any) -> Any:
        """Release this step's router load statistic (``metrics.aux``) into ``run.router_state``; returns the
        metrics without it, so that the un-noised statistic goes no further."""
        run.router_state = run.router_setup.step(
            run.router_release,
            run.router_state,
            metrics.aux,
            expected_batch_size=run.plan.expected_batch_size,
            reduce=self.topology.reduce,
        )
        return dataclasses.replace(metrics, aux=None)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run DP training; returns Hugging Face's ``TrainOutput(global_step, training_loss, metrics)``.

        ``resume_from_checkpoint`` is a checkpoint folder, or True for the latest one under ``output_dir``: the
        weights, optimizer, sampler, keys, step and accountant are restored and the run continues the identical
        trajectory.
        """
        args, begin = self.args, time.time()
        folder, saved = checkpointing.resume_point(resume_from_checkpoint, args.output_dir)
        run, step_fn = self._start(saved, folder)
        plan = run.plan
        self._live = run
        self.state = run.trainer_state(args)
        if saved is not None:
            checkpointing.restore(
                folder, saved, run, args=args, state=self.state, model=self.model, topology=self.topology
            )
        first = self.state.global_step
        self.topology.check_agree(**run.agreement(args, self.state.global_step))
        self.model.train()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and self.state.global_step == 0:
            self.evaluate(_run=run)
        stop = plan.stop_step
        while self.state.global_step < plan.total_steps and not self.control.should_training_stop:
            if stop is not None and self.state.global_step >= stop:
                self.state.privacy_target_epsilon_reached = True
                break
            epoch_before = int(self.state.epoch)
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            indices, run.sampler_state = plan.sampler.sample(run.keys.sampler, run.sampler_state)
            batch = self._batch(self.train_dataset, indices)
            if run.router_state is not None:  # the estimate released up to the previous step
                batch = with_load(batch, run.router_state.load)
            inputs = (run.params, run.opt_state, run.dp_state, (batch,))
            with router_logits_off(self.model) if self._router is not None else contextlib.nullcontext():
                if args.auto_find_microbatch_size and len(indices):
                    outputs, shrunk = step_fn(inputs, len(indices))
                    if shrunk:
                        self.log({"converged_microbatch_size": float(shrunk)})
                else:
                    outputs = step_fn(*inputs)
            run.params, run.opt_state, run.dp_state, metrics = outputs
            if run.router_state is not None:
                metrics = self._router_step(run, metrics)
            if not plan.horizon:  # a horizon run recorded its whole release at the start
                run.ledger = run.ledger.record(plan.release)
            run.add(metrics)
            self.state.global_step += 1
            self.state.epoch = self.state.global_step / plan.steps_per_epoch
            if stop is not None and self.state.global_step >= stop:
                self.state.privacy_target_epsilon_reached = True
                self.control.should_training_stop = True
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if int(self.state.epoch) > epoch_before:
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_save_evaluate(run)
        self._live = None
        if run.count:
            self._log_steps(run)
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            best = Path(self.state.best_model_checkpoint)
            run.params = checkpointing.restore_weights(self.model, best, args.device, set(self._params))
        self._params = self._optimizer.eval_params(run.opt_state, run.params)  # schedule-free: the average x
        self._plan, self._ledger, self._trained = plan, run.ledger, True
        self._router_state = run.router_state
        checkpointing.copy_into(self.model, self._params)
        self.topology.check_params(run.params)
        steps = self.state.global_step
        metrics = run.final_metrics(begin, steps=steps, trained=steps - first, dataset_size=len(self.train_dataset))
        self.log(metrics)  # adds epoch, as Hugging Face's
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if args.push_to_hub and self.is_world_process_zero():
            self.push_to_hub()
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _log_steps(self, run: Run) -> None:
        """Log the steps since the last row (under DDP with ``average_tokens_across_devices``: means over ranks)."""
        average = self.args.average_tokens_across_devices
        ranks = self.args.world_size if self.topology.is_distributed else 1
        self.log(
            run.drain(
                learning_rate=float(run.schedule(max(self.state.global_step - 1, 0))),
                clipping_norm=self.args.clipping_norm,
                mean=self.topology.mean if average else lambda value: value,
                total=lambda value: self.topology.mean(value) * ranks,
            )
        )
        if run.noise_only:  # the steps that ran were released and charged: a later train() is a new segment
            self._plan, self._ledger, self._trained, self._live = run.plan, run.ledger, True, None
            raise run.noise_only_error()

    def _log_save_evaluate(self, run: Run) -> None:
        if self.control.should_log:
            self._log_steps(run)
        metrics = self.evaluate(_run=run) if self.control.should_evaluate else None
        if self.control.should_save:
            checkpointing.save(
                run,
                args=self.args,
                state=self.state,
                model=self.model,
                processing_class=self.processing_class,
                topology=self.topology,
                metrics=metrics,
            )
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``epoch`` to ``logs`` in place (as Hugging Face's; with ``start_time``, a ``time.time()``, also its
        ``train_runtime``), record them in the history, send them ``on_log``."""
        if start_time is not None:
            logs.update(speed_metrics("train", start_time))
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # -- saving ----------------------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None) -> Path:
        """Save the trained weights, the tokenizer, ``accountant.json`` and the model card (``README.md``, which
        states the guarantee; for a PEFT adapter it replaces peft's generic card) to ``output_dir``.

        Nothing secret is written: no keys, noise, optimizer or sampler state.
        """
        folder = Path(output_dir or self.args.output_dir)
        checkpointing.copy_into(self.model, self._params)
        if not self.args.should_save:  # DDP: one writer (per node with save_on_each_node)
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        checkpointing.save_weights(self.model, self.processing_class, folder, safe=self.args.save_safetensors)
        if self._plan is not None and self._plan.accounted:
            checkpointing.write_accountant(folder, self.args, self._plan, self._ledger)
        write_trainer_card(self, folder)
        return folder

    def create_model_card(self, **kwargs: Any) -> None:
        """Hugging Face's ``create_model_card(language, license, tags, model_name, finetuned_from, tasks, ...)``:
        ``README.md`` in ``output_dir`` stating the guarantee (:func:`.model_card.write_trainer_card`)."""
        if self.is_world_process_zero():
            write_trainer_card(self, Path(self.args.output_dir), **kwargs)

    def push_to_hub(self, commit_message: str | None = "End of training", **kwargs: Any) -> object:
        """Save the model and its card, upload the publishable files, with Hugging Face's arguments
        (:func:`opake_torch.hub.push_trainer`)."""
        from opake_torch.hub import push_trainer

        return push_trainer(self, commit_message=commit_message, **kwargs)

    # -- evaluation ------------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval", *, _run: Run | None = None) -> dict:
        """Mean per-example loss (and ``compute_metrics``) on ``eval_dataset``; fires ``on_evaluate``."""
        params = self._params
        if _run is not None:  # during training: the model shows the run's current weights (schedule-free: x)
            params = self._optimizer.eval_params(_run.opt_state, _run.params)
            checkpointing.copy_into(self.model, params)
        output = self._prediction_loop(eval_dataset or self.eval_dataset, metric_key_prefix, params)
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=output.metrics)
        if self.args.save_strategy == "best" and _run is not None:
            best = self.state.best_metric
            folder = Path(self.args.output_dir) / f"{ckpt.PREFIX}-{self.state.global_step}"
            checkpointing.update_best(self.args, self.state, folder, output.metrics)
            if self.state.best_metric != best:
                self.control.should_save = True
        return output.metrics

    def predict(self, test_dataset: Any, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions, labels and metrics on ``test_dataset``; fires ``on_predict``."""
        output = self._prediction_loop(test_dataset, metric_key_prefix, self._params)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return output

    def _prediction_loop(self, dataset: Any, prefix: str, params: dict[str, torch.Tensor]) -> PredictionOutput:
        custom = type(self).compute_per_example_loss is not DPTrainer.compute_per_example_loss
        if dataset is not None:
            self._check_data(dataset, f"{prefix} dataset", training=False)
        return prediction_loop(
            self.model,
            dataset,
            args=self.args,
            host_batch_of=self._host_batch,
            to_device=self._to_device,
            label_names=self.label_names,
            logits_loss=lambda logits, labels: loss_from_logits(
                logits, labels, task=self.task, compute_loss_func=self.compute_loss_func
            ),
            per_example_loss=(lambda example: self.compute_per_example_loss(params, example)) if custom else None,
            compute_metrics=self.compute_metrics,
            prefix=prefix,
        )

    # -- callbacks -------------------------------------------------------------------------------------------------

    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        self.callback_handler.remove_callback(callback)

    @property
    def router_state(self) -> Any:
        """The MoE router release's :class:`~opake_core.moe.RouterState` after the last ``train()`` (its ``load`` is
        the filtered, noised load estimate; ``imbalance`` and ``filtered_noise_std`` are logged); None without the
        release."""
        return self._router_state

    @property
    def trainable_params(self) -> dict[str, torch.Tensor]:
        """The trainable parameters ``{name: tensor}``: during ``train()``, those the next step starts from (what a
        callback's ``on_step_begin`` reads is the iterate before that step; the model's own tensors are written at
        saves and at the end); otherwise the trained ones. Read them, do not modify them."""
        return self._live.params if self._live is not None else self._params

    @property
    def privacy_plan(self) -> PrivacyPlan | None:
        """The privacy plan (sampler, noise multiplier, steps, release) of the ``train()`` in progress, else of the
        last one; None before the first."""
        return self._live.plan if self._live is not None else self._plan

    @property
    def privacy_ledger(self) -> accounting.Ledger:
        """What this trainer's ``train()`` calls released, in order (the reported epsilon is this ledger's): of the
        ``train()`` in progress, else of the last one; empty before the first."""
        return self._live.ledger if self._live is not None else self._ledger

    @property
    def per_example_gradients_engine(self) -> str:
        """The engine that forms the per-example gradients: ``"layerwise"`` or ``"vmap"`` (what
        ``per_example_gradients="auto"`` chose; after ``train()``, what its check against ``grad`` left)."""
        return "vmap" if self._layerwise is None else "layerwise"

    def is_world_process_zero(self) -> bool:
        """Whether this is the global main process (rank 0)."""
        return self.args.process_index == 0

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine (local rank 0)."""
        return self.args.local_process_index == 0
