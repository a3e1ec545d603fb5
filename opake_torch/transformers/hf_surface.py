"""The ``transformers.Trainer`` surface of :class:`~opake_torch.transformers.DPTrainer` that example scripts use, at
the edge of the trainer: the methods they call (logging, metrics files, callbacks, the model card, the Hub), the log
level a trainer sets when it is built, and the refusal of the ``Trainer`` methods a DP step never calls.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import trainer_pt_utils
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, PrinterCallback, ProgressCallback
from transformers.trainer_utils import speed_metrics
from transformers.utils import logging as hf_logging

from opake_core.errors import ConfigurationError
from opake_torch.transformers.accelerator import ProcessAccelerator
from opake_torch.transformers.arguments import LOG_LEVELS, TrainingArguments
from opake_torch.transformers.model_card import write_trainer_card
from opake_torch.transformers.reporting import RunLogCallback, integration_callbacks

__all__ = ["SEAMS", "HFSurface", "apply_log_level", "build_model", "callback_handler", "refuse_overrides"]

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


def build_model(model: Any, model_init: Callable[..., Any] | None) -> Any:
    """``model``, or what ``model_init()`` (or ``model_init(None)``: Hugging Face's ``model_init(trial)``) builds when
    ``model`` is None, as ``transformers.Trainer`` does. It is called once, here, after ``set_seed(args.seed)``: a
    later ``train()`` continues the trained model (a new segment of the same run), it does not build a fresh one."""
    if model_init is None:
        if model is None:
            raise ConfigurationError("DPTrainer needs a model: pass model=..., or model_init=() -> model.")
        return model
    if model is not None:
        raise ConfigurationError(
            "both model and model_init were given; transformers.Trainer would replace the model by model_init() at "
            "every train(), which DPTrainer does not (its train() calls continue one private run). Pass one of them."
        )
    count = len(inspect.signature(model_init).parameters)
    if count > 1:
        raise ConfigurationError(f"model_init must take 0 or 1 argument (the trial), it takes {count}.")
    built = model_init() if count == 0 else model_init(None)
    if built is None:
        raise ConfigurationError("model_init returned None; it must return the model to train.")
    return built


def apply_log_level(args: TrainingArguments) -> None:
    """As ``transformers.Trainer`` does when it is built: this process's level (``args.get_process_log_level()``:
    ``log_level`` on the processes that log, ``log_level_replica`` on the others) on the ``transformers`` logger, and
    on the ``opake_torch`` logger; ``"passive"`` leaves both as they are."""
    if LOG_LEVELS[args.log_level if args.should_log else args.log_level_replica] == -1:
        return
    level = args.get_process_log_level()
    hf_logging.set_verbosity(level)
    logging.getLogger("opake_torch").setLevel(level)


def callback_handler(args: TrainingArguments, model: Any, processing_class: Any, callbacks: Any) -> CallbackHandler:
    """Hugging Face's callback handler of a trainer, with its callbacks in order: the default flow (log, evaluate
    and save intervals), ``report_to``'s integrations, the run log (``log.jsonl``), the user's ``callbacks``, and a
    progress bar (printed logs with ``disable_tqdm``)."""
    reporting = [*integration_callbacks(args), RunLogCallback]
    printer = PrinterCallback if args.disable_tqdm else ProgressCallback
    return CallbackHandler(
        [DefaultFlowCallback, *reporting, *(callbacks or []), printer], model, processing_class, None, None
    )


class HFSurface:
    """``transformers.Trainer``'s methods and attributes for scripts, on a trainer with ``args``, ``state``,
    ``control``, ``callback_handler`` (Hugging Face's), ``model`` and ``save_model``."""

    log_metrics = trainer_pt_utils.log_metrics
    save_metrics = trainer_pt_utils.save_metrics
    save_state = trainer_pt_utils.save_state
    metrics_format = staticmethod(trainer_pt_utils.metrics_format)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``epoch`` to ``logs`` in place (as Hugging Face's; with ``start_time``, a ``time.time()``, also its
        ``train_runtime``), record them in the history, send them ``on_log``."""
        if start_time is not None:
            logs.update(speed_metrics("train", start_time))
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    @functools.cached_property
    def accelerator(self) -> ProcessAccelerator:
        """What scripts read of ``accelerate.Accelerator`` (``print``, ``is_main_process``, ``wait_for_everyone``,
        ``num_processes``, ``device``...), for the trainer's processes: :class:`.accelerator.ProcessAccelerator`."""
        return ProcessAccelerator(self.args)

    @property
    def model_wrapped(self) -> Any:
        """The model: DPTrainer never wraps it (its DDP is the step's own cross-rank sum), so this is ``model``."""
        return self.model

    @property
    def hub_model_id(self) -> str:
        """The Hub repository :meth:`push_to_hub` uploads to: ``args.hub_model_id``, else ``output_dir``'s name."""
        return self.args.hub_model_id or Path(self.args.output_dir).name

    def end(self) -> None:
        """As Hugging Face's, once at the very end of a script: destroy the process group of a distributed run
        (:meth:`.accelerator.ProcessAccelerator.end_training`); train, evaluate, save and push need it before."""
        self.accelerator.end_training()

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: every trial trains on the private data and spends privacy budget that no single run's epsilon
        counts, and choosing the best trial leaks through the choice."""
        raise ConfigurationError(
            "hyperparameter_search is not supported: every trial is a training run on the private data, and the "
            "epsilon of one trial does not count the others or the choice among them (the guarantee would not hold "
            "for the model you keep). Tune on public or proxy data, or account the whole search yourself (private "
            "selection, e.g. Papernot and Steinke 2022) and run one DPTrainer with the chosen settings."
        )

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
        dataset_name: str | None = None,
    ) -> None:
        """Hugging Face's ``create_model_card`` (and TRL's ``dataset_name``): ``README.md`` in ``output_dir`` stating
        the guarantee, with these arguments as its metadata (:func:`.model_card.write_trainer_card`)."""
        if self.is_world_process_zero():
            write_trainer_card(
                self, Path(self.args.output_dir), language=language, license=license, tags=tags,
                model_name=model_name, finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                dataset=dataset or dataset_name, dataset_args=dataset_args,
            )  # fmt: skip

    def push_to_hub(self, commit_message: str | None = "End of training", **kwargs: Any) -> object:
        """Save the model and its card, upload the publishable files, with Hugging Face's arguments
        (:func:`opake_torch.hub.push_trainer`)."""
        from opake_torch.hub import push_trainer

        return push_trainer(self, commit_message=commit_message, **kwargs)

    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        """Whether this is the global main process (rank 0)."""
        return self.args.process_index == 0

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine (local rank 0)."""
        return self.args.local_process_index == 0
