"""Every Hugging Face learning-rate scheduler that is a function of the step gives, at every step of the run, the
learning rate that ``transformers.get_scheduler`` gives (a ``torch.optim.lr_scheduler.LambdaLR`` on a torch
optimizer); the two that read training metrics are refused with the reason.

The reference is transformers' own scheduler, stepped as ``transformers.Trainer`` steps it (one ``scheduler.step()``
after each optimizer step), so the learning rate of update ``k`` is the scheduler's ``get_last_lr()`` after ``k``
steps; Opake's schedule is called with ``k`` (the updates already applied).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from opake_core.errors import ConfigurationError
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers.optimizer import build_schedule

transformers = pytest.importorskip("transformers")

LR = 3e-3
TOTAL = 40
DP = {"privacy_noise_multiplier": 1.0, "use_cpu": True}

CASES = [
    ("linear", 0, {}),
    ("linear", 7, {}),
    ("cosine", 0, {}),
    ("cosine", 5, {"num_cycles": 1.5}),
    ("cosine_with_restarts", 4, {}),
    ("cosine_with_restarts", 4, {"num_cycles": 3}),
    ("polynomial", 6, {}),
    ("polynomial", 0, {"lr_end": 1e-4, "power": 2.0}),
    ("constant_with_warmup", 9, {}),
    ("inverse_sqrt", 8, {}),
    ("inverse_sqrt", 5, {"timescale": 3}),
    ("cosine_with_min_lr", 6, {"min_lr_rate": 0.1}),
    ("cosine_with_min_lr", 0, {"min_lr": 1e-4, "num_cycles": 1.0}),
    ("cosine_warmup_with_min_lr", 6, {"min_lr_rate": 0.2}),
    ("cosine_warmup_with_min_lr", 1, {"min_lr_rate": 0.2}),
    ("cosine_warmup_with_min_lr", 5, {"min_lr": 2e-4, "warmup_lr_rate": 0.3}),
    ("warmup_stable_decay", 5, {"num_decay_steps": 10}),
    ("warmup_stable_decay", 4, {"num_decay_steps": 12, "num_stable_steps": 10, "decay_type": "1-sqrt"}),
    ("warmup_stable_decay", 4, {"num_decay_steps": 9, "warmup_type": "cosine", "min_lr_ratio": 0.05}),
    ("warmup_stable_decay", 6, {"num_decay_steps": 8, "warmup_type": "1-sqrt", "decay_type": "linear"}),
]


def _transformers_rates(name, warmup, kwargs):
    """The learning rate of each of the ``TOTAL`` updates under ``transformers.get_scheduler``."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the scheduler steps without an optimizer step
        scheduler = transformers.get_scheduler(
            name, optimizer, num_warmup_steps=warmup, num_training_steps=TOTAL, scheduler_specific_kwargs=dict(kwargs)
        )
        rates = []
        for _ in range(TOTAL):
            rates.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
    return rates


@pytest.mark.parametrize(("name", "warmup", "kwargs"), CASES, ids=[f"{n}-w{w}-{k}" for n, w, k in CASES])
def test_each_scheduler_matches_transformers_at_every_step(tmp_path, name, warmup, kwargs):
    args = TrainingArguments(
        str(tmp_path), learning_rate=LR, lr_scheduler_type=name, warmup_steps=warmup, lr_scheduler_kwargs=kwargs, **DP
    )
    schedule = build_schedule(args, TOTAL)
    ours = [schedule(step) for step in range(TOTAL)]
    reference = _transformers_rates(name, warmup, kwargs)
    assert ours == pytest.approx(reference, rel=1e-12, abs=1e-18)
    assert len(set(reference)) > 2  # the case exercises a schedule, not a constant


def test_a_fractional_warmup_counts_steps_as_transformers_does(tmp_path):
    """Hugging Face's warm-up of a fraction r is ceil(r * total) steps (TrainingArguments.get_warmup_steps)."""
    hf_args = transformers.TrainingArguments(str(tmp_path), warmup_steps=0.1, report_to="none")
    warmup = hf_args.get_warmup_steps(45)
    args = TrainingArguments(str(tmp_path), learning_rate=LR, warmup_steps=0.1, **DP)
    schedule = build_schedule(args, 45)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    reference = transformers.get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=45)
    rates = [reference.lr_lambdas[0](step) * LR for step in range(45)]
    assert warmup == 5 and [schedule(step) for step in range(45)] == pytest.approx(rates, rel=1e-12, abs=1e-18)


def test_the_schedulers_are_every_step_scheduler_of_transformers():
    from opake_torch.transformers._parsing import REFUSED_SCHEDULERS, SCHEDULER_ALIASES, SCHEDULERS

    names = {kind.value for kind in transformers.SchedulerType}
    ours = set(SCHEDULERS) | set(SCHEDULER_ALIASES) | set(REFUSED_SCHEDULERS)
    assert names == ours
    assert {name for name, _, _ in CASES} | {"constant"} == (set(SCHEDULERS) | set(SCHEDULER_ALIASES))


@pytest.mark.parametrize(("name", "metric"), [("reduce_lr_on_plateau", "evaluation loss"), ("greedy", "training")])
def test_schedulers_driven_by_metrics_are_refused_with_the_reason(tmp_path, name, metric):
    why = rf"lr_scheduler='{name}' is refused: .*{metric}.*function of the step"
    with pytest.raises(ConfigurationError, match=why):
        TrainingArguments(str(tmp_path), lr_scheduler_type=name, **DP)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("cosine_with_min_lr", {}, "exactly one of"),
        ("cosine_with_min_lr", {"min_lr": 1e-5, "min_lr_rate": 0.1}, "exactly one of"),
        ("warmup_stable_decay", {}, "num_decay_steps"),
        ("polynomial", {"num_cycles": 2}, "unsupported keys"),
    ],
)
def test_missing_or_foreign_scheduler_kwargs_are_refused_at_construction(tmp_path, name, kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        TrainingArguments(str(tmp_path), lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, **DP)


def test_bad_scheduler_values_are_refused_when_the_schedule_is_built(tmp_path):
    polynomial = TrainingArguments(str(tmp_path), lr_scheduler_type="polynomial", learning_rate=1e-4,
                                   lr_scheduler_kwargs={"lr_end": 1e-3}, **DP)  # fmt: skip
    with pytest.raises(ConfigurationError, match="end_value must be below init_value"):
        build_schedule(polynomial, TOTAL)
    wsd = TrainingArguments(str(tmp_path), lr_scheduler_type="warmup_stable_decay", warmup_steps=5,
                            lr_scheduler_kwargs={"num_decay_steps": 10, "decay_type": "exp"}, **DP)  # fmt: skip
    with pytest.raises(ConfigurationError, match="decay_type must be one of"):
        build_schedule(wsd, TOTAL)
    no_warmup = TrainingArguments(str(tmp_path), lr_scheduler_type="cosine_warmup_with_min_lr",
                                  lr_scheduler_kwargs={"min_lr_rate": 0.1}, **DP)  # fmt: skip
    with pytest.raises(ConfigurationError, match="needs a warm-up"):
        build_schedule(no_warmup, TOTAL)


def test_the_command_line_takes_the_scheduler_and_its_kwargs(tmp_path):
    parser = transformers.HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--privacy_noise_multiplier", "1", "--lr_scheduler_type",
              "cosine_with_restarts", "--lr_scheduler_kwargs", '{"num_cycles": 2}', "--warmup_steps", "3",
              "--learning_rate", str(LR)]
    )  # fmt: skip
    assert (args.lr_scheduler, args.lr_scheduler_kwargs) == ("cosine_with_restarts", {"num_cycles": 2})
    schedule = build_schedule(args, TOTAL)
    assert [schedule(k) for k in range(TOTAL)] == pytest.approx(
        _transformers_rates("cosine_with_restarts", 3, {"num_cycles": 2}), rel=1e-12
    )
    assert math.isclose(schedule(3), args.learning_rate)
