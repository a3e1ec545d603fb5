"""The harness's training modes: how each one is built on a freshly built model of a workload.

Every mode but the trainer's is a builder ``(workload, batch, settings) -> step``, a zero-argument closure that runs
one training step on the fixed batch (:data:`BUILDERS`). The trainer modes run ``DPTrainer.train()`` themselves and
return their step times (:func:`opake_trainer`). Every private mode uses ``settings.noise_multiplier`` and
``settings.clipping_norm``; every mode uses AdamW with :data:`LR` and :data:`WEIGHT_DECAY`.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from settings import Settings
from timing import peak_gib, reserved_gib, sync
from workloads import Workload, build_model, model_inputs, per_example_losses

OPACUS_MODES = ("opacus_hooks", "opacus_ghost")
TRAINER_MODES = ("opake_trainer", "opake_trainer_kernels", "opake_trainer_graphs")
MODES = ("nonprivate", *OPACUS_MODES, "opake_core", *TRAINER_MODES)
LR, WEIGHT_DECAY = 1e-4, 0.01


def opacus_available() -> bool:
    return importlib.util.find_spec("opacus") is not None


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def nonprivate_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    """Plain Hugging Face training: ``model(**batch).loss.backward()`` and ``torch.optim.AdamW``."""
    opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WEIGHT_DECAY)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    return step


def nonprivate(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    return nonprivate_step(build_model(workload, settings.device), batch)


def opacus_hooks(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = build_model(workload, settings.device)
    size = batch["input_ids"].shape[0]
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=False)
    opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WEIGHT_DECAY)
    dpo = DPOptimizer(
        opt, noise_multiplier=settings.noise_multiplier, max_grad_norm=settings.clipping_norm, expected_batch_size=size
    )

    def step() -> None:
        dpo.zero_grad(set_to_none=True)
        per_example_losses(gsm, batch, workload.task).mean().backward()
        dpo.step()

    return step


def opacus_ghost(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
    from opacus.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = build_model(workload, settings.device)
    size, bound = batch["input_ids"].shape[0], settings.clipping_norm
    gsm = GradSampleModuleFastGradientClipping(
        model, batch_first=True, loss_reduction="mean", strict=False, max_grad_norm=bound, use_ghost_clipping=True
    )
    opt = torch.optim.AdamW(trainable(model), lr=LR, weight_decay=WEIGHT_DECAY)
    dpo = DPOptimizerFastGradientClipping(
        opt,
        noise_multiplier=settings.noise_multiplier,
        max_grad_norm=bound,
        expected_batch_size=size,
        loss_reduction="mean",
    )
    criterion = DPLossFastGradientClipping(gsm, dpo, torch.nn.CrossEntropyLoss(reduction="mean"), "mean")
    labels = batch["labels"]

    def step() -> None:
        dpo.zero_grad(set_to_none=True)
        logits = gsm(**model_inputs(batch)).logits
        if workload.task == "causal_lm":
            shifted = logits[:, :-1].float().contiguous()
            flat = shifted.reshape(-1, shifted.shape[-1])
            loss = criterion(flat, labels[:, 1:].reshape(-1), shape=shifted.shape[:2])
        else:
            loss = criterion(logits.float(), labels)
        loss.backward()
        dpo.step()

    return step


def core_parts(workload: Workload, settings: Settings) -> tuple[torch.nn.Module, Any, dict, dict, Callable]:
    """The model, its functional form ``(apply, params, frozen)`` and the per-example loss of the opake modes."""
    from opake_torch.functional import functional_model
    from opake_torch.patches import apply_runtime_patches
    from opake_torch.transformers.loss import per_example_loss

    apply_runtime_patches()
    model = build_model(workload, settings.device)
    apply, params, frozen = functional_model(model)

    def loss_fn(params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> torch.Tensor:
        return per_example_loss(apply, params, frozen, example, task=workload.task)

    return model, apply, params, frozen, loss_fn


class CoreStep:
    """``opake_core.step.dp_sgd`` on a fixed batch; holds the running params and states."""

    def __init__(self, workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> None:
        from opake_core import random
        from opake_core.optim import adamw
        from opake_core.step import dp_sgd

        self.model, _, self.params, _, self.loss_fn = core_parts(workload, settings)
        size = batch["input_ids"].shape[0]
        self.microbatch = settings.microbatch_for(size)
        optimizer = adamw(LR, weight_decay=WEIGHT_DECAY)
        self.step_fn, self.dp_state = dp_sgd(
            self.loss_fn,
            optimizer=optimizer,
            clipping_norm=settings.clipping_norm,
            noise_multiplier=settings.noise_multiplier,
            expected_batch_size=float(size),
            microbatch_size=self.microbatch,
            key=random.key(0),
        )
        self.opt_state = optimizer.init(self.params)
        self.batch = batch

    def __call__(self) -> None:
        self.params, self.opt_state, self.dp_state, _ = self.step_fn(
            self.params, self.opt_state, self.dp_state, (self.batch,)
        )


def opake_core(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> Callable[[], None]:
    return CoreStep(workload, batch, settings)


BUILDERS: dict[str, Callable[[Workload, dict[str, torch.Tensor], Settings], Callable[[], None]]] = {
    "nonprivate": nonprivate,
    "opacus_hooks": opacus_hooks,
    "opacus_ghost": opacus_ghost,
    "opake_core": opake_core,
}


def opake_trainer(
    workload: Workload,
    batch: dict[str, torch.Tensor],
    settings: Settings,
    *,
    kernels: bool = False,
    graphs: bool = False,
) -> dict[str, Any]:
    """Run ``DPTrainer.train()`` for warmup + steps steps; returns the step times and peak memory."""
    from transformers import TrainerCallback

    from opake_torch.transformers import DPTrainer, TrainingArguments

    device = settings.device
    size = batch["input_ids"].shape[0]
    rows = [{k: v[i].cpu() for k, v in batch.items()} for i in range(size)]
    times: list[float] = []

    class StepTimer(TrainerCallback):
        begin = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync(device)
            if state.global_step == settings.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync(device)
            if state.global_step > settings.warmup:
                times.append(time.perf_counter() - self.begin)

    total = settings.warmup + settings.steps
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder,
            per_device_train_batch_size=size,
            microbatch_size=settings.microbatch_for(size),
            learning_rate=LR,
            weight_decay=WEIGHT_DECAY,
            optim="adamw",
            lr_scheduler="constant",
            max_steps=total,
            privacy_noise_multiplier=settings.noise_multiplier,
            clipping_norm=settings.clipping_norm,
            sampling_mode="poisson",
            logging_steps=total,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=device.type == "cpu",
            seed=0,
            use_performance_kernels=kernels,
            cuda_graphs=1 if graphs else 0,
        )
        trainer = DPTrainer(build_model(workload, device), args, train_dataset=rows, callbacks=[StepTimer()])
        trainer.train()
    engine = trainer.per_example_gradients_engine
    return {
        "times": times,
        "peak_gib": peak_gib(device),
        "reserved_gib": reserved_gib(device),
        "per_example_gradients": engine,
    }
