"""Run logs: ``<logging_dir>/log.jsonl`` (``<output_dir>/runs`` by default), and the ``report_to`` integrations.

``report_to`` goes through Hugging Face's own integration callbacks, the ones ``transformers.Trainer`` uses
(:func:`transformers.integrations.get_reporting_integration_callbacks`): TensorBoard, Weights & Biases, MLflow,
Comet, ClearML, ... They receive every log row, the privacy parameters (``privacy_epsilon``, ``privacy_delta``,
``privacy_noise_multiplier``, ...) included, and name them as they name any other value (TensorBoard:
``train/privacy_epsilon``, ``eval/loss``). ``"all"`` means every integration that is installed and ``"none"``
none, as in Hugging Face. A backend that is not installed is refused when the trainer is built, with the command
that installs it, not at ``train()``. TensorBoard writes under ``logging_dir`` (or ``$TENSORBOARD_LOGGING_DIR``).

Every logged value except the privacy parameters (epsilon, delta, noise multiplier, noise std, clipping bound) is
an exact statistic of the private data and is **outside** the privacy guarantee: so is whatever the integrations
send to their servers. The ``runs/`` folder is never uploaded by the hub helpers; review anything else before
publishing.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerCallback

from opake_core.errors import ConfigurationError

__all__ = ["INSTALL", "RunLogCallback", "integration_callbacks"]

# report_to name -> (the transformers.integrations check that it is installed, what `pip install` needs)
INSTALL: dict[str, tuple[str | None, str]] = {
    "azure_ml": ("is_azureml_available", "azureml-core"),
    "clearml": ("is_clearml_available", "clearml"),
    "codecarbon": ("is_codecarbon_available", "codecarbon"),
    "comet_ml": ("is_comet_available", "comet_ml"),
    "dagshub": ("is_dagshub_available", "dagshub mlflow"),
    "dvclive": ("is_dvclive_available", "dvclive"),
    "flyte": ("is_flyte_deck_standard_available", "flytekit flytekitplugins-deck-standard"),
    "kubeflow": (None, "kubeflow"),  # a Kubeflow TrainJob's environment, not a package
    "mlflow": ("is_mlflow_available", "mlflow"),
    "neptune": ("is_neptune_available", "neptune"),
    "swanlab": ("is_swanlab_available", "swanlab"),
    "tensorboard": ("is_tensorboard_available", "tensorboard"),
    "trackio": ("is_trackio_available", "trackio"),
    "wandb": ("is_wandb_available", "wandb"),
}


def integration_callbacks(args: Any) -> list[TrainerCallback]:
    """Hugging Face's integration callbacks for ``args.report_to``, built (so that a missing backend fails now).

    ConfigurationError for a name that is no integration (with the closest names) or a backend that is not
    installed (with its ``pip install`` command).
    """
    from transformers import integrations

    names: list[str] = []
    for name in args.report_to:
        names += integrations.get_available_reporting_integrations() if name == "all" else [name]
    names = list(dict.fromkeys(names))
    known = sorted(integrations.INTEGRATION_TO_CALLBACK)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ConfigurationError(
                f"report_to={name!r} is not a Hugging Face integration.{hint} Known: {known}, or 'all' / 'none'."
            )
        check = INSTALL.get(name, (None, name))[0]
        if check is not None and not getattr(integrations, check, lambda: True)():
            raise _missing(name)
    callbacks = []
    for name, cls in zip(names, integrations.get_reporting_integration_callbacks(names), strict=True):
        try:
            callback = cls()
        except (ImportError, RuntimeError) as exc:
            raise _missing(name, exc) from exc
        if name == "tensorboard" and os.getenv("TENSORBOARD_LOGGING_DIR") is None:
            callback.logging_dir = str(args.logging_dir)  # beside log.jsonl, under runs/ (never uploaded)
        callbacks.append(callback)
    return callbacks


def _missing(name: str, cause: Exception | None = None) -> ConfigurationError:
    package = INSTALL.get(name, (None, name))[1]
    why = f" ({cause})" if cause is not None else ""
    return ConfigurationError(
        f"report_to={name!r} needs the {name} backend, which is not installed{why}: run `pip install {package}`, "
        f"or remove {name!r} from report_to."
    )


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class RunLogCallback(TrainerCallback):
    """Append every log row to ``<logging_dir>/log.jsonl``; a resumed run first drops the rows logged after its
    checkpoint."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            _forget_after(Path(args.logging_dir) / "log.jsonl", state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        folder = Path(args.logging_dir)
        folder.mkdir(parents=True, exist_ok=True)
        row = {"step": state.global_step, **{k: _json_safe(v) for k, v in logs.items()}}
        with open(folder / "log.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")


def _forget_after(path: Path, step: int) -> None:
    """Drop the rows of ``path`` logged after ``step``: a run resumed at ``step`` logs those steps again."""
    if not step or not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True) if _row_step(line) <= step]
    path.write_text("".join(kept))


def _row_step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0.0  # a damaged row is kept as it is
