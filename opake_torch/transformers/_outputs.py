"""The rules of the arguments that decide what a run writes and shows: logging, evaluation, saving and which
checkpoint is the best.

:class:`OutputRules` gives :class:`~opake_torch.transformers.TrainingArguments` the resolution of these fields (the
strategies and intervals, the report integrations, the log levels, the best-model metric), run by its
``__post_init__``. None of them changes what a step computes or releases.
"""

from __future__ import annotations

from opake_core.errors import ConfigurationError
from opake_torch.transformers import _parsing as p
from opake_torch.transformers._process import LOG_LEVELS

__all__ = ["OutputRules"]


class OutputRules:
    """The rules of the logging, evaluation and saving fields of
    :class:`~opake_torch.transformers.TrainingArguments` (module docstring)."""

    def _resolve_logging_eval_save(self) -> None:
        self.logging_strategy = p.as_choice(self.logging_strategy, "logging_strategy", ("no", "steps", "epoch"))
        self.save_strategy = p.as_choice(self.save_strategy, "save_strategy", ("no", "steps", "epoch", "best"))
        self.eval_strategy = p.as_choice(self.eval_strategy, "eval_strategy", ("no", "steps", "epoch"))
        self.logging_steps = p.as_steps(self.logging_steps, "logging_steps", allow_zero=True)
        if self.logging_strategy == "steps" and self.logging_steps == 0:
            raise ConfigurationError("logging_strategy='steps' requires a non-zero logging_steps.")
        self.save_steps = p.as_steps(self.save_steps, "save_steps")
        if self.enable_jit_checkpoint and self.save_only_model:
            raise ConfigurationError(
                "enable_jit_checkpoint=True writes a checkpoint to resume from, and save_only_model=True leaves out "
                "the DP state a resume needs; set save_only_model=False."
            )
        if self.eval_steps is None and self.eval_strategy == "steps":
            if self.logging_steps == 0:
                raise ConfigurationError("eval_strategy='steps' requires eval_steps or a non-zero logging_steps.")
            self.eval_steps = self.logging_steps
        if self.eval_steps is not None:
            self.eval_steps = p.as_steps(self.eval_steps, "eval_steps")
        self.report_to = p.report_to(self.report_to)
        self.log_level = p.as_choice(self.log_level, "log_level", tuple(LOG_LEVELS))
        self.log_level_replica = p.as_choice(self.log_level_replica, "log_level_replica", tuple(LOG_LEVELS))
        if not isinstance(self.project, str) or not self.project:
            raise ConfigurationError(f"project must be a non-empty string, got {self.project!r}.")
        for name in ("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, str) or (name == "trackio_static_space_id" and value is False)):
                raise ConfigurationError(f"{name} must be a string or None, got {value!r}.")
        tokens = self.include_num_input_tokens_seen
        if isinstance(tokens, bool):
            tokens = "all" if tokens else "no"
        self.include_num_input_tokens_seen = p.as_choice(
            tokens, "include_num_input_tokens_seen", ("no", "all", "non_padding")
        )
        self._resolve_best_model()

    def _resolve_best_model(self) -> None:
        metric = self.metric_for_best_model
        if metric is None and self.load_best_model_at_end:
            metric = "loss"
        if metric is None and self.save_strategy == "best":
            raise ConfigurationError("save_strategy='best' requires metric_for_best_model (e.g. 'loss').")
        if metric is not None:
            if not isinstance(metric, str) or not metric:
                raise ConfigurationError(f"metric_for_best_model must be a metric name, got {metric!r}.")
            if metric.startswith("train_"):
                raise ConfigurationError(
                    f"metric_for_best_model={metric!r} selects checkpoints on a training-set metric: which checkpoint "
                    "survives would reveal memorisation of the private data outside the DP guarantee. Use an eval "
                    "metric (e.g. 'loss' -> 'eval_loss')."
                )
            metric = metric if metric.startswith("eval_") else f"eval_{metric}"
            if self.greater_is_better is None:
                self.greater_is_better = not metric.endswith("loss")
        self.metric_for_best_model = metric
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ConfigurationError("save_strategy='best' requires eval_strategy != 'no' (best is judged on eval).")
        p.check_schedule_free_best_model(self.optim, self.load_best_model_at_end)
        if not self.load_best_model_at_end:
            return
        if self.save_strategy == "no" or self.eval_strategy == "no":
            raise ConfigurationError(
                f"load_best_model_at_end requires saving and evaluation, got save_strategy={self.save_strategy!r}, "
                f"eval_strategy={self.eval_strategy!r}."
            )
        if self.save_strategy == "best":
            return
        if self.save_strategy != self.eval_strategy:
            raise ConfigurationError(
                "--load_best_model_at_end requires the save and eval strategy to match, got "
                f"save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}."
            )
        if self.save_strategy == "steps":
            save, ev = self.save_steps, self.eval_steps
            if isinstance(save, float) != isinstance(ev, float) or round(save / ev, 9) % 1:
                raise ConfigurationError(
                    f"--load_best_model_at_end requires save_steps ({save!r}) to be a round multiple of eval_steps "
                    f"({ev!r}), both counts or both fractions."
                )
