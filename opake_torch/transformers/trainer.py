"""``DPTrainer``: Hugging Face-style training with a differential-privacy guarantee.

A training step is the core DP-SGD step, nothing more: sample a Poisson batch, per-example gradients, clip, noise,
optimizer update, then account. This class adds what users of ``transformers.Trainer`` expect at the edges:
arguments, callbacks, progress, logs, evaluation, checkpoints that resume exactly.

Logged values other than the privacy parameters (loss, clip rate, accuracy...) are exact statistics of the private
data and are **outside** the privacy guarantee; keep them private.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import PredictionOutput, TrainOutput

from opake_core import accounting
from opake_core.clipping import AdaptiveClipState, Engine, MaterializedGradients, VmapGradients
from opake_core.errors import CheckpointError, ConfigurationError, OpakeError
from opake_core.sampling.state import SamplerState
from opake_core.step import DPState, dp_ftrl, dp_sgd, rekeyed, unkeyed
from opake_core.tree import per_group
from opake_torch import distributed
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, unsupported_parameters
from opake_torch.patches import apply_compat_patches, check_attention_implementation
from opake_torch.patches.checkpointing import check_memory_knobs, enable_vmap_checkpointing
from opake_torch.patches.families import apply_family_patches
from opake_torch.patches.kernels import FusedGradients
from opake_torch.patches.performance import apply_performance_kernels
from opake_torch.state_files import write_json
from opake_torch.transformers import checkpoint as ckpt
from opake_torch.transformers.arguments import TrainingArguments
from opake_torch.transformers.compile import CudaGraphChunk, compile_chunk
from opake_torch.transformers.data import collate, fetch, language_modeling_labels, model_input_names
from opake_torch.transformers.evaluation import prediction_loop
from opake_torch.transformers.keys import RunKeys, first_keys, next_keys
from opake_torch.transformers.loss import (
    batch_losses,
    fused_causal_lm_losses,
    fused_head,
    infer_task,
    loss_from_logits,
)
from opake_torch.transformers.microbatch import run_with_oom_retry
from opake_torch.transformers.optimizer import build_optimizer, build_schedule
from opake_torch.transformers.privacy import PrivacyPlan, build_plan, clipping_rule, ledger_epsilon
from opake_torch.transformers.reporting import RunLogCallback

__all__ = ["DPTrainer", "DPTrainerState"]

logger = logging.getLogger(__name__)


@dataclass
class DPTrainerState(TrainerState):
    """Hugging Face's ``TrainerState`` plus the resolved privacy parameters of the run."""

    privacy_resolved_delta: float | None = None
    privacy_resolved_noise_multiplier: float | None = None
    privacy_calibration_source: str | None = None
    privacy_target_epsilon_reached: bool = False


@dataclass
class _Run:
    """The mutable state of one ``train()`` call."""

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
    count: int = 0
    total_loss: float = 0.0
    total_count: int = 0
    total_nonfinite: int = 0


class DPTrainer:
    """Train a Hugging Face model (or any module whose output has ``.logits``) with DP-SGD.

    Args:
        model: the model; moved to ``args.device``. PEFT models train their adapters only (frozen weights are
            passed through).
        args: :class:`TrainingArguments`, which must name a privacy knob (a noise multiplier or a target epsilon).
        data_collator: ``list of examples -> batch dict``; defaults to right-padding with ``processing_class``'s pad
            token.
        train_dataset, eval_dataset: map-style datasets of dicts (``len`` and ``[i]``).
        processing_class: the tokenizer (used for the pad token and saved with the model).
        compute_loss_func: ``(logits, labels) -> scalar`` for **one** example (no batch dimension), replacing
            the loss inferred from the model class.
        compute_metrics: ``EvalPrediction -> dict`` for evaluation.
        callbacks: ``transformers.TrainerCallback`` instances or classes.
        optimizers: must be ``(None, None)``; choose the optimizer with ``args.optim``.
    """

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
        if not isinstance(args, TrainingArguments):
            raise ConfigurationError(
                "DPTrainer needs args=opake_torch.transformers.TrainingArguments(...) with privacy_noise_multiplier "
                "or privacy_target_epsilon; convert Hugging Face arguments with TrainingArguments.from_hf."
            )
        if tuple(optimizers) != (None, None):
            raise ConfigurationError(
                "optimizers=(optimizer, scheduler) is not supported: a torch.optim optimizer cannot check that its "
                "gradients were noised. Choose the optimizer with args.optim and the schedule with args.lr_scheduler."
            )
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            raise ConfigurationError(
                f"pass the bare model, not {type(model).__name__}: DPTrainer handles DDP itself; DataParallel is "
                "not supported (use torchrun)."
            )
        if args.cuda_graphs and args.device.type != "cuda":
            raise ConfigurationError(
                f"cuda_graphs={args.cuda_graphs} captures CUDA graphs and needs a CUDA device; this run is on "
                f"{args.device}. Set cuda_graphs=0."
            )
        self.args = args
        self._distributed = self._init_distributed(args)
        self.compat_patches = apply_compat_patches() + apply_family_patches(model) if args.use_compat_patches else []
        check_attention_implementation(model)
        if args.gradient_checkpointing:
            enable_vmap_checkpointing(model)
        check_memory_knobs(model, args)
        self.model = model.to(args.device)
        if self._distributed:  # every rank starts from rank 0's weights
            distributed.broadcast_params(dict(self.model.named_parameters()))
        kernels_config = dict(args.performance_kernels_config or {})
        if args.per_example_gradients != "vmap" and kernels_config.get("lora", True):
            # the fused LoRA kernel bypasses the adapter layers, which the layerwise engine reads
            kernels_config["lora"] = False
        self.performance_patches = apply_performance_kernels(
            self.model, use_performance_kernels=args.use_performance_kernels, performance_kernels_config=kernels_config
        )
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.data_collator = data_collator
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.chunk_graphs: CudaGraphChunk | None = None  # the CUDA-graph captures of the chunk (cuda_graphs > 0)
        self.task = None if compute_loss_func is not None else infer_task(model)
        self.label_names = tuple(args.label_names or ["labels"])
        self._columns = (
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
        self._keys = first_keys(args, is_distributed=self._distributed)  # secrets: never logged or published
        self._ledger = accounting.Ledger()  # what this trainer's train() calls released, in order
        self._trained = False  # a later fresh train() call is a new segment, with new keys
        self._plan: PrivacyPlan | None = None
        self._microbatch: int | None = args.microbatch_size
        self._layerwise = self._layerwise_engine()
        default = [DefaultFlowCallback, PrinterCallback if args.disable_tqdm else ProgressCallback, RunLogCallback]
        self.callback_handler = CallbackHandler(
            default + list(callbacks or []), self.model, processing_class, None, None
        )
        self.state = DPTrainerState(
            is_local_process_zero=args.local_process_index == 0, is_world_process_zero=args.process_index == 0
        )
        self.control = TrainerControl()
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    @staticmethod
    def _init_distributed(args: TrainingArguments) -> bool:
        """Under torchrun (WORLD_SIZE > 1): initialize the process group and refuse what DDP does not support."""
        if args.world_size <= 1:
            if distributed.is_distributed():
                raise ConfigurationError(
                    f"a process group of {distributed.get_world_size()} ranks is initialized but WORLD_SIZE is not "
                    "set: launch with torchrun (or set WORLD_SIZE, RANK and LOCAL_RANK), so that sampling and "
                    "accounting see the cluster."
                )
            return False
        if args.auto_find_microbatch_size:
            raise ConfigurationError(
                "auto_find_microbatch_size is not supported under DDP: an out-of-memory retry on one rank would "
                "desynchronize the cross-rank sum. Set microbatch_size explicitly."
            )
        initialized = distributed.init_process_group(args.ddp_backend, args.ddp_timeout, args.device)
        if distributed.get_rank() != args.process_index:
            raise ConfigurationError(
                f"the process group rank {distributed.get_rank()} differs from RANK={args.process_index}; launch with "
                "torchrun, whose RANK is the process group rank."
            )
        return initialized

    # -- batches ---------------------------------------------------------------------------------------------------

    def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.data_collator is not None:
            batch = dict(self.data_collator(examples))
        else:
            pad = getattr(self.processing_class, "pad_token_id", None) or 0
            batch = collate(
                examples,
                pad_token_id=pad,
                max_length=self.args.max_length,
                pad_to_multiple_of=self.args.pad_to_multiple_of,
            )
        if self.task == "causal_lm":
            batch = language_modeling_labels(batch)
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if self.args.device.type == "cuda":  # from pinned memory the copy does not wait for the queued GPU work
            return {k: v.pin_memory().to(self.args.device, non_blocking=True) for k, v in tensors.items()}
        return {k: v.to(self.args.device) for k, v in tensors.items()}

    def _batch(self, dataset: Any, indices: np.ndarray) -> dict[str, torch.Tensor]:
        if len(indices):
            return self._collate(fetch(dataset, indices, self._columns))
        template = self._collate(fetch(dataset, [0], self._columns))  # an empty Poisson draw is still a step
        return {k: v[:0] for k, v in template.items()}

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

    def _layerwise_engine(self) -> LayerwiseGradients | None:
        """The layerwise engine when ``per_example_gradients`` allows it and the model is served by it, else None."""
        mode = self.args.per_example_gradients
        if mode == "vmap":
            return None
        reasons = unsupported_parameters(self.model, self._params)
        overrides = type(self).compute_per_example_loss is not DPTrainer.compute_per_example_loss
        if overrides and type(self).compute_batch_losses is DPTrainer.compute_batch_losses:
            reasons.append(f"{type(self).__name__} overrides compute_per_example_loss but not compute_batch_losses")
        if self.args.gradient_checkpointing:
            reasons.append("gradient_checkpointing is on")
        if reasons:
            if mode == "layerwise":
                raise ConfigurationError(
                    f"per_example_gradients='layerwise' cannot serve this run: {'; '.join(reasons[:5])}. Use "
                    "per_example_gradients='vmap' (or 'auto', which picks it)."
                )
            logger.info("per-example gradients by vmap(grad): %s", "; ".join(reasons[:5]))
            return None
        args = self.args

        def loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16):
                return self.compute_batch_losses(params, batch)

        return LayerwiseGradients(self.model, loss)

    def _check_layerwise(self) -> None:
        """Compare the layerwise engine with grad of the per-example loss on the first two training examples, once.

        On a mismatch, or any error of the layerwise pass, ``'auto'`` falls back to vmap(grad) with a warning and
        ``'layerwise'`` raises.
        """
        if self._layerwise is None or not len(self.train_dataset):
            return
        batch = self._batch(self.train_dataset, np.arange(min(2, len(self.train_dataset))))
        low = (torch.bfloat16, torch.float16)
        low_precision = self.args.bf16 or any(p.dtype in low for p in self.model.parameters())
        try:
            self._layerwise.check(self._params, self._loss_fn(), batch, rtol=5e-2 if low_precision else 1e-2)
        except Exception as exc:  # a mismatch, or a model the batched pass cannot run: auto falls back
            if self.args.per_example_gradients == "layerwise":
                raise
            logger.warning("per-example gradients fall back to vmap(grad): %s: %s", type(exc).__name__, exc)
            self._layerwise = None

    def _chunk_transform(self) -> Any:
        """The wrapper of the per-chunk clip function that ``cuda_graphs`` or ``torch_compile`` ask for, else None.

        With a ``microbatch_size`` every chunk is padded to it (dead rows add nothing), so that Poisson batches of any
        size replay the same graphs; without one, each distinct batch size is its own signature. The captures are
        kept in ``self.chunk_graphs`` (a :class:`~opake_torch.transformers.compile.CudaGraphChunk`).
        """
        args = self.args
        if args.cuda_graphs:
            if args.microbatch_size is None:
                logger.warning(
                    "cuda_graphs=%d without microbatch_size: every distinct batch size is captured separately (up to "
                    "%d, then eager). Set microbatch_size so that every chunk is padded to one shape.",
                    args.cuda_graphs,
                    args.cuda_graphs,
                )

            def capture(chunk: Any) -> CudaGraphChunk:
                self.chunk_graphs = CudaGraphChunk(chunk, args.cuda_graphs)
                return self.chunk_graphs

            return capture
        if args.torch_compile:
            return lambda chunk: compile_chunk(chunk, backend=args.torch_compile_backend, mode=args.torch_compile_mode)
        return None

    def _loss_fn(self) -> Any:
        args = self.args

        def loss(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16):
                return self.compute_per_example_loss(params, example)

        return loss

    def _clipping_norm(self) -> Any:
        bound = self.args.clipping_norm
        if isinstance(bound, dict):
            patterns = {k: v for k, v in bound.items() if k != "fallback"}
            return per_group(self._params, patterns, fallback=bound["fallback"])
        return clipping_rule(self.args)

    # -- training --------------------------------------------------------------------------------------------------

    def _start(self, saved: dict[str, Any] | None, folder: Path | None) -> tuple[_Run, Any]:
        """The plan, the step function and the initial run state of a ``train()`` call.

        A resume (``saved``, the checkpoint's ``dp_state.json``) continues the checkpoint's ledger and, when the
        configuration is unchanged, its keys; otherwise the call continues this trainer's own ledger. A changed
        configuration, or a second call, starts a new segment with new keys (see :mod:`.keys`).
        """
        args = self.args
        if self.train_dataset is None:
            raise ConfigurationError("train() needs a train_dataset.")
        if saved is None and self._trained and args.is_complete_horizon:
            raise ConfigurationError(
                f"this trainer already ran its {args.privacy_noise_mechanism!r} / {args.sampling_mode!r} horizon, "
                "which is accounted once as a whole; a second train() would start another horizon with noise the "
                "accountant does not cover. To continue an interrupted run, resume from its checkpoint "
                "(train(resume_from_checkpoint=True)); to train further, start a new DPTrainer."
            )
        ledger = self._saved_ledger(saved, folder) if saved else self._ledger
        done = saved["global_step"] if saved else 0
        unchanged = saved is not None and saved["configuration"] == ckpt.configuration(args)
        kept = saved["noise_multiplier"] if unchanged else None
        plan = build_plan(args, len(self.train_dataset), spent=ledger, done=done, resumed_multiplier=kept)
        keys = self._segment_keys(saved, folder, plan, ledger, unchanged=unchanged)
        optimizer = build_optimizer(args, plan.total_steps)
        self._check_layerwise()
        transform = self._chunk_transform()  # cuda_graphs / torch_compile: how each chunk is launched
        # Fused Triton norms and scaled sums on CUDA (the identical torch path where they cannot run), but not inside a
        # captured or compiled chunk; per-example gradients from one batched pass where the model allows it.
        fused = args.device.type == "cuda" and transform is None
        vmapped = VmapGradients(FusedGradients if fused else MaterializedGradients)
        common = {
            "optimizer": optimizer,
            "clipping_norm": self._clipping_norm(),
            "noise_multiplier": plan.noise_multiplier,
            "key": keys.noise,
            "expected_batch_size": plan.expected_batch_size,
            "compute_dtype": args.privacy_noise_mechanism_kwargs.get("compute_dtype", torch.float32),
            "engine": Engine(gradients=vmapped if self._layerwise is None else self._layerwise, transform=transform),
            # DDP: clipped sums are normalized by the cluster expected batch, summed across ranks, then noised once
            "reduce": distributed.sum_gradients if self._distributed else None,
        }

        def make_step(microbatch_size: int | None) -> tuple[Any, Any]:
            options = {**common, "microbatch_size": microbatch_size}
            if plan.strategy is None:
                counts = distributed.sum_counts if self._distributed else None
                return dp_sgd(self._loss_fn(), reduce_count=counts, **options)
            return dp_ftrl(
                self._loss_fn(), params=self._params, strategy=plan.strategy, n_steps=plan.total_steps, **options
            )

        self._make_step = make_step
        step_fn, dp_state = make_step(args.microbatch_size)
        zero = torch.zeros((), device=args.device)
        run = _Run(
            plan=plan,
            keys=keys,
            ledger=ledger if saved or not plan.horizon else ledger.record(plan.release),
            params=dict(self._params),
            opt_state=optimizer.init(self._params),
            dp_state=dp_state,
            sampler_state=plan.sampler.init(),
            schedule=build_schedule(args, plan.total_steps),
            loss_sum=zero.clone(),
            clip_sum=zero.clone(),
            nonfinite=torch.zeros((), dtype=torch.int64, device=args.device),
        )
        self._keys = keys
        return run, step_fn

    @staticmethod
    def _saved_ledger(saved: dict[str, Any], folder: Path | None) -> accounting.Ledger:
        try:
            return accounting.Ledger.from_json(saved["ledger"])
        except OpakeError as exc:
            raise CheckpointError(f"{folder}/{ckpt.DP_STATE}: its privacy ledger is invalid ({exc}).") from exc

    def _segment_keys(
        self,
        saved: dict[str, Any] | None,
        folder: Path | None,
        plan: PrivacyPlan,
        ledger: accounting.Ledger,
        *,
        unchanged: bool,
    ) -> RunKeys:
        """The checkpoint's keys for an unchanged resume (same arguments, same multiplier), new keys for a new
        segment, this trainer's own otherwise."""
        if saved is None:
            if not self._trained:
                return self._keys
            return next_keys(self.args, released=ledger.releases, is_distributed=self._distributed)
        self._check_same_run(saved, plan, folder)
        keys = RunKeys.from_json(saved, f"{folder}/{ckpt.DP_STATE}")
        if unchanged and plan.noise_multiplier == saved["noise_multiplier"]:
            return keys
        logger.info("the configuration changed since %s: the run continues with new noise and sampler keys", folder)
        return next_keys(self.args, released=ledger.releases, is_distributed=self._distributed)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Run DP training; returns Hugging Face's ``TrainOutput(global_step, training_loss, metrics)``.

        ``resume_from_checkpoint`` is a checkpoint folder, or True for the latest one under ``output_dir``: the
        weights, optimizer, sampler, keys, step and accountant are restored and the run continues the identical
        trajectory.
        """
        args, begin = self.args, time.perf_counter()
        folder = ckpt.latest_checkpoint(args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
        if resume_from_checkpoint is True and folder is None:
            raise CheckpointError(f"resume_from_checkpoint=True but {args.output_dir} holds no checkpoint.")
        folder = Path(folder) if folder else None
        saved = None
        if folder is not None:
            ckpt.require_resumable(folder)
            saved = ckpt.read_manifest(folder)
        run, step_fn = self._start(saved, folder)
        plan = run.plan
        self.state = DPTrainerState(
            max_steps=plan.total_steps,
            num_train_epochs=math.ceil(plan.total_steps / plan.steps_per_epoch),
            logging_steps=_as_count(args.logging_steps, plan.total_steps),
            eval_steps=_as_count(args.eval_steps or args.logging_steps, plan.total_steps),
            save_steps=_as_count(args.save_steps, plan.total_steps),
            train_batch_size=args.train_batch_size,
            is_world_process_zero=args.process_index == 0,
            privacy_resolved_delta=plan.delta,
            privacy_resolved_noise_multiplier=plan.noise_multiplier,
            privacy_calibration_source=plan.calibration_source,
        )
        if saved is not None:
            self._restore(folder, saved, run)
        if self._distributed:
            self._check_ranks_agree(run)
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
            if args.auto_find_microbatch_size and len(indices):
                step_fn, outputs = self._step_with_oom_retry(step_fn, run, batch, len(indices))
            else:
                outputs = step_fn(run.params, run.opt_state, run.dp_state, (batch,))
            run.params, run.opt_state, run.dp_state, metrics = outputs
            if not plan.horizon:  # a horizon run recorded its whole release at the start
                run.ledger = run.ledger.record(plan.release)
            finite = torch.isfinite(metrics.loss)  # no host sync: read at the next log
            run.loss_sum += torch.where(finite, metrics.loss, 0.0)
            run.nonfinite += ~finite
            run.clip_sum += metrics.clip_rate
            run.count += 1
            self.state.global_step += 1
            self.state.epoch = self.state.global_step / plan.steps_per_epoch
            if stop is not None and self.state.global_step >= stop:
                self.state.privacy_target_epsilon_reached = True
                self.control.should_training_stop = True
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if int(self.state.epoch) > epoch_before:
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_save_evaluate(run)
        self._flush_logs(run)
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            self._restore_weights(Path(self.state.best_model_checkpoint), run)
        self._params = run.params
        self._plan, self._ledger, self._trained = plan, run.ledger, True
        self._sync_model(run.params)
        if self._distributed:
            distributed.check_params_synchronized(run.params)
        metrics = self._final_metrics(run, time.perf_counter() - begin)
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if args.push_to_hub and self.is_world_process_zero():
            self.push_to_hub()
        mean_loss = run.total_loss / max(run.total_count, 1)
        return TrainOutput(self.state.global_step, mean_loss, metrics)

    def _check_ranks_agree(self, run: _Run) -> None:
        """Keys, step counters and the privacy configuration must be the same on every rank (ConfigurationError)."""
        plan, sampler_state = run.plan, run.sampler_state
        distributed.check_synchronized(
            noise_key=run.keys.noise,
            sampler_key=run.keys.sampler,
            global_step=self.state.global_step,
            dp_step=run.dp_state.step,
            sampler_step=sampler_state.step,
            noise_multiplier=plan.noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            sample_rate=plan.sample_rate,
            total_steps=plan.total_steps,
            delta=plan.delta,
            mechanism=self.args.privacy_noise_mechanism,
            mechanism_kwargs={k: str(v) for k, v in self.args.privacy_noise_mechanism_kwargs.items()},
            clipping_norm=self.args.clipping_norm,
            clipping_mode=self.args.clipping_mode,
            optim=self.args.optim,
            learning_rate=self.args.learning_rate,
            parameters=sorted(self._params),
        )

    def _step_with_oom_retry(self, step_fn: Any, run: _Run, batch: dict, batch_size: int) -> tuple[Any, Any]:
        """Run the step; on out-of-memory, halve the vmap chunk and rerun the same batch and step state (keys included).

        The step functions are pure, so a failed attempt changed nothing: the retried step releases exactly what
        the first attempt would have (privacy-neutral). The converged chunk is kept for the following steps.
        """
        current = self._microbatch or batch_size
        steps = {current: step_fn}

        def attempt(chunk: int) -> Any:
            if chunk not in steps:
                steps[chunk] = self._make_step(chunk)[0]
            return steps[chunk](run.params, run.opt_state, run.dp_state, (batch,))

        outputs, chunk = run_with_oom_retry(attempt, microbatch_size=current, batch_size=batch_size)
        if chunk < current:
            self._microbatch = chunk
            self.log({"converged_microbatch_size": float(chunk)})
        return steps[chunk], outputs

    @staticmethod
    def _privacy_logs(plan: PrivacyPlan, ledger: accounting.Ledger) -> dict[str, float]:
        """The public privacy parameters; epsilon is that of the whole ledger (earlier calls and resumes too)."""
        logs = {"privacy_noise_multiplier": plan.noise_multiplier}
        if plan.accounted:
            logs["privacy_epsilon"] = ledger_epsilon(ledger, plan.delta)
            logs["privacy_delta"] = plan.delta
        return logs

    def _current_bound(self, run: _Run) -> float:
        clip = run.dp_state.clip
        return clip.clipping_norm if isinstance(clip, AdaptiveClipState) else _scalar_bound(self.args.clipping_norm)

    def _flush_logs(self, run: _Run) -> None:
        if run.count:
            self._emit_step_logs(run)

    def _emit_step_logs(self, run: _Run) -> None:
        loss_sum, clip_sum = run.loss_sum, run.clip_sum
        if self._distributed and self.args.average_tokens_across_devices:  # the same logged values on every rank
            loss_sum, clip_sum = distributed.reduce_mean(loss_sum), distributed.reduce_mean(clip_sum)
        nonfinite = int(run.nonfinite.item())
        finite = run.count - nonfinite
        loss = (loss_sum / finite).item() if finite else math.nan
        if nonfinite:
            logger.warning(
                "%d of the last %d steps had examples with a non-finite loss (NaN or inf). Those examples added "
                "nothing to the clipped sum, but the steps still released noise and are charged to epsilon. Check "
                "the learning rate, the data, and bf16 overflow.",
                nonfinite,
                run.count,
            )
        run.total_nonfinite += nonfinite
        logs = {
            "loss": loss,
            "learning_rate": float(run.schedule(max(self.state.global_step - 1, 0))),
            "privacy_clip_rate": (clip_sum / run.count).item(),
            "privacy_clipping_norm": self._current_bound(run),
            "privacy_noise_std": _noise_std(run.plan, self._current_bound(run)),
            "nonfinite_loss_steps": run.total_nonfinite,
            **self._privacy_logs(run.plan, run.ledger),
        }
        if finite:
            run.total_loss += loss * finite
            run.total_count += finite
        run.loss_sum.zero_()
        run.clip_sum.zero_()
        run.nonfinite.zero_()
        run.count = 0
        self.log(logs)

    def _log_save_evaluate(self, run: _Run) -> None:
        if self.control.should_log:
            self._emit_step_logs(run)
        metrics = None
        if self.control.should_evaluate:
            metrics = self.evaluate(_run=run)
        if self.control.should_save:
            self._save_checkpoint(run, metrics)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _final_metrics(self, run: _Run, seconds: float) -> dict[str, float]:
        metrics = {
            "train_runtime": seconds,
            "train_steps": float(self.state.global_step),
            "train_steps_per_second": self.state.global_step / max(seconds, 1e-9),
            "train_loss": run.total_loss / max(run.total_count, 1),
            "nonfinite_loss_steps": run.total_nonfinite,
            **self._privacy_logs(run.plan, run.ledger),
        }
        return metrics

    def log(self, logs: dict[str, float]) -> None:
        """Record ``logs`` in the state's history and send them to the callbacks (``on_log``)."""
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def _sync_model(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            own = dict(self.model.named_parameters())
            for name, value in params.items():
                own[name].copy_(value)

    def _manifest(self, run: _Run) -> dict[str, Any]:
        """The JSON part of the private DP state (``dp_state.json``): counters, keys, ledger, configuration."""
        plan = run.plan
        return {
            "global_step": self.state.global_step,
            **run.keys.to_json(),
            "ledger": run.ledger.to_json(),
            "sampler_state": run.sampler_state.to_json(),
            "configuration": ckpt.configuration(self.args),
            "calibration_source": plan.calibration_source,
            "delta": plan.delta,
            "world_size": self.args.world_size,
            "versions": accounting.library_versions(),
            **self._mechanism_fields(plan),
        }

    def _save_checkpoint(self, run: _Run, metrics: dict[str, float] | None) -> Path:
        args = self.args
        folder = Path(args.output_dir) / f"{ckpt.PREFIX}-{self.state.global_step}"
        self._sync_model(run.params)
        self._update_best(folder, metrics)

        def write(tmp: Path) -> None:
            self._save_weights(tmp)
            if run.plan.accounted:
                self._write_accountant(tmp, run.plan, run.ledger)
            self.state.save_to_json(str(tmp / ckpt.TRAINER_STATE))
            (tmp / ckpt.TRAINING_ARGS).write_text(json.dumps(args.to_dict(), indent=2, default=str))
            if not args.save_only_model:
                ckpt.write_state(
                    tmp,
                    self._manifest(run),
                    step_state=unkeyed(run.dp_state),  # the keys are stored in dp_state.json only
                    opt_state=run.opt_state,
                    rng_state=torch.get_rng_state(),
                )

        if not self._distributed:
            if args.should_save:
                self._write_checkpoint(folder, write)
            return folder
        # DDP: rank 0 (local rank 0 of each node with save_on_each_node) writes; a failure aborts every rank
        try:
            if args.should_save:
                self._write_checkpoint(folder, write)
        except BaseException:
            distributed.all_ok(False, "checkpoint save")
            raise
        distributed.all_ok(True, "checkpoint save")
        return folder

    def _write_checkpoint(self, folder: Path, write: Any) -> None:
        ckpt.write_atomically(folder, write)
        protect = (Path(self.state.best_model_checkpoint),) if self.state.best_model_checkpoint else ()
        ckpt.rotate(self.args.output_dir, self.args.save_total_limit, protect=protect)

    def _write_accountant(self, folder: Path, plan: PrivacyPlan, ledger: accounting.Ledger) -> None:
        """``accountant.json``: the public record of what was released and the epsilon it costs (no keys; epsilon is
        the string ``"inf"`` for a non-private run)."""
        epsilon = ledger_epsilon(ledger, plan.delta)
        record = {
            "epsilon": epsilon if math.isfinite(epsilon) else "inf",
            "delta": plan.delta,
            "steps": plan.total_steps if plan.horizon else ledger.releases,
            "ledger": ledger.to_json(),
            "noise_multiplier": plan.noise_multiplier,
            "sample_rate": plan.sample_rate,
            "sampling_mode": self.args.sampling_mode,
            "mechanism": self.args.privacy_noise_mechanism,
            "horizon": plan.horizon,
        }
        write_json(folder / ckpt.ACCOUNTANT, record)

    def _update_best(self, folder: Path, metrics: dict[str, float] | None) -> None:
        name = self.args.metric_for_best_model
        if not metrics or name is None or name not in metrics:
            return
        value, best = metrics[name], self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better:
            self.state.best_metric = value
            self.state.best_global_step = self.state.global_step
            self.state.best_model_checkpoint = str(folder)

    def _save_weights(self, folder: Path) -> None:
        if hasattr(self.model, "save_pretrained"):
            self.model.save_pretrained(folder, safe_serialization=self.args.save_safetensors)
        else:
            from safetensors.torch import save_model

            save_model(self.model, str(folder / "model.safetensors"))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(folder)

    def _restore_weights(self, folder: Path, run: _Run) -> None:
        adapter = folder / "adapter_model.safetensors"
        if adapter.is_file():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, _read_weights(adapter, self.args.device))
        else:
            weights = folder / "model.safetensors"
            if not weights.is_file():
                raise CheckpointError(f"{folder} holds no model.safetensors or adapter_model.safetensors.")
            state = _read_weights(weights, self.args.device)
            missing = set(self._params) - set(state)
            own = dict(self.model.named_parameters())
            wrong = [k for k, v in state.items() if k in own and v.shape != own[k].shape]
            if wrong:
                raise CheckpointError(f"{weights} has tensors of other shapes than the model: {wrong[:5]}.")
            with torch.no_grad():
                for name, value in state.items():
                    if name in own:
                        own[name].copy_(value)
            if missing - _tied_names(self.model):
                raise CheckpointError(f"{weights} lacks trainable parameters {sorted(missing)[:5]}.")
        run.params = {name: p.detach().clone() for name, p in self.model.named_parameters() if name in self._params}

    def _restore(self, folder: Path, saved: dict[str, Any], run: _Run) -> None:
        """Load the checkpoint's tensors, weights and trainer state into ``run`` and ``self.state``, after checking
        that its step counters agree (CheckpointError otherwise)."""
        args = self.args
        step_state, run.opt_state, rng_state = ckpt.read_tensors(
            folder, step_template=run.dp_state, opt_template=run.opt_state, device=args.device
        )
        try:
            state = DPTrainerState.load_from_json(str(folder / ckpt.TRAINER_STATE))
        except (OSError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{folder / ckpt.TRAINER_STATE} is unreadable: {exc}") from exc
        sampler = SamplerState.from_json(saved["sampler_state"])
        counters = {
            f"{ckpt.DP_STATE} global_step": saved["global_step"],
            f"{ckpt.TRAINER_STATE} global_step": state.global_step,
            "step state": step_state.step,
            "sampler state": sampler.step,
        }
        if len(set(counters.values())) != 1 or (not run.plan.horizon and run.ledger.releases < sampler.step):
            raise CheckpointError(
                f"{folder}: the step counters disagree ({counters}; {run.ledger.releases} releases in the ledger), "
                "so the checkpoint was edited or assembled from different runs. Resume from another checkpoint."
            )
        self._restore_weights(folder, run)
        run.dp_state = rekeyed(step_state, run.dp_state)  # the keys of this segment (saved unkeyed)
        torch.set_rng_state(rng_state)
        if self._distributed:  # rank 0 wrote the state; each rank keeps its own sampler configuration
            run.sampler_state = distributed.local_sampler_state(sampler, run.sampler_state)
        elif sampler.config == run.sampler_state.config:
            run.sampler_state = sampler
        else:  # a per-step run resumed at another rate (a new segment): this sampler, continued at the same step
            run.sampler_state = SamplerState(sampler.step, run.sampler_state.config)
        for name in ("global_step", "epoch", "log_history", "best_metric", "best_global_step", "best_model_checkpoint"):
            setattr(self.state, name, getattr(state, name))

    def _check_same_run(self, saved: dict[str, Any], plan: PrivacyPlan, folder: Path | None) -> None:
        """Refuse a resume whose world size changed, or a horizon resume whose mechanism, horizon, multiplier, rate
        or clipping changed: a horizon is accounted as a whole and its noise is correlated across steps."""
        if saved["world_size"] != self.args.world_size:
            raise CheckpointError(
                f"{folder} was written with world size {saved['world_size']}, this run has {self.args.world_size}: "
                "per-rank sampling and accounting depend on it. Resume with the same number of processes."
            )
        if not plan.horizon:
            return
        now = self._mechanism_fields(plan)
        changed = {k: (saved[k], v) for k, v in now.items() if saved[k] != v}
        if changed:
            raise CheckpointError(
                f"{folder} belongs to another run configuration; (saved, now) values differ: {changed}. A horizon "
                "mechanism (DP-FTRL, k-out-of-t) is accounted for its whole horizon with correlated noise, so its "
                "mechanism, multiplier, horizon, batch and clipping cannot change on resume."
            )

    def _mechanism_fields(self, plan: PrivacyPlan) -> dict[str, Any]:
        """What a horizon run cannot change on resume (saved in ``dp_state.json``)."""
        args = self.args
        return {
            "mechanism": args.privacy_noise_mechanism,
            "mechanism_kwargs": {k: str(v) for k, v in args.privacy_noise_mechanism_kwargs.items()},
            "sampling_mode": args.sampling_mode,
            "noise_multiplier": plan.noise_multiplier,
            "total_steps": plan.total_steps,
            "expected_batch_size": plan.expected_batch_size,
            "clipping_norm": str(args.to_dict()["clipping_norm"]),
        }

    def save_model(self, output_dir: str | None = None) -> Path:
        """Save the trained weights, the tokenizer and ``accountant.json`` to ``output_dir``.

        Nothing secret is written: no keys, noise, optimizer or sampler state.
        """
        folder = Path(output_dir or self.args.output_dir)
        self._sync_model(self._params)
        if self._distributed and not self.args.should_save:  # DDP: one writer (per node with save_on_each_node)
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        self._save_weights(folder)
        if self._plan is not None and self._plan.accounted:
            self._write_accountant(folder, self._plan, self._ledger)
        return folder

    def push_to_hub(self, repo_id: str | None = None) -> object:
        """Save the model to ``output_dir`` and upload its publishable files (never ``runs/``, keys or checkpoints)."""
        from opake_torch.hub import push_to_hub

        folder = self.save_model()
        repo = repo_id or self.args.hub_model_id or Path(self.args.output_dir).name
        return push_to_hub(folder, repo, token=self.args.hub_token, private=self.args.hub_private_repo is not False)

    # -- evaluation ------------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval", *, _run: _Run | None = None) -> dict:
        """Mean per-example loss (and ``compute_metrics``) on ``eval_dataset``; fires ``on_evaluate``."""
        if _run is not None:  # during training: the model shows the run's current weights
            self._sync_model(_run.params)
        params = _run.params if _run is not None else self._params
        output = self._prediction_loop(eval_dataset or self.eval_dataset, metric_key_prefix, params)
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=output.metrics)
        if self.args.save_strategy == "best" and _run is not None:
            best = self.state.best_metric
            self._update_best(Path(self.args.output_dir) / f"{ckpt.PREFIX}-{self.state.global_step}", output.metrics)
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
        return prediction_loop(
            self.model,
            dataset,
            args=self.args,
            batch_of=self._batch,
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

    def is_world_process_zero(self) -> bool:
        return self.args.process_index == 0


def _as_count(value: int | float, total: int) -> int:
    """A step interval: an int count, or a float fraction of the run (rounded up, at least 1)."""
    return max(1, math.ceil(value * total)) if isinstance(value, float) and value < 1 else max(1, int(value))


def _noise_std(plan: PrivacyPlan, bound: float) -> float:
    """The scale of the noise on the normalized update (before DP-FTRL's correlation); 0 for a non-private run."""
    if plan.noise_multiplier == 0:
        return 0.0
    return plan.noise_multiplier * bound / plan.expected_batch_size


def _scalar_bound(bound: float | dict[str, float]) -> float:
    if isinstance(bound, dict):
        return math.sqrt(sum(v * v for v in bound.values()))
    return float(bound)


def _read_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors weights file; CheckpointError when it is damaged or not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc


def _tied_names(model: nn.Module) -> set[str]:
    all_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return all_names - {name for name, _ in model.named_parameters()}
