"""Per-phase step times in the logs (``step_perf=True``): the keys appear in every training row, the times are
positive, add up to the step's time and to at most the wall time a callback measures around the step; a delay put into
one phase (the collator, the loss, the optimizer) is charged to that phase; off (the default) no key appears and the
run is the same bit for bit."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
from tiny_hf import tiny_args, tiny_model, token_data
from torchopt.base import GradientTransformation
from transformers import TrainerCallback

from opake_core import optim
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.data import collate
from opake_torch.transformers.loss import causal_lm_loss
from opake_torch.transformers.step_perf import PHASES

DATA = token_data(40)
KEYS = [f"perf/{phase}_sec" for phase in PHASES]
DELAY = 1.0  # seconds: far above a tiny model's phase on CPU after the first step, even on a loaded machine
_args = partial(tiny_args, max_steps=3, logging_steps=1, per_example_gradients="vmap", privacy_noise_seed=3)


class _Walls(TrainerCallback):
    """The wall time of each step, from ``on_step_begin`` to ``on_step_end`` (the step's phases run in between)."""

    def __init__(self):
        self.walls: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.walls.append(time.perf_counter() - self._start)


def _rows(trainer: DPTrainer) -> list[dict]:
    return [row for row in trainer.state.log_history if "loss" in row]


def test_phase_times_are_logged_positive_and_within_the_step(tmp_path):
    walls = _Walls()
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, step_perf=True), train_dataset=DATA, callbacks=[walls])
    trainer.train()
    rows = _rows(trainer)
    assert len(rows) == len(walls.walls) == 3  # one row a step
    for row, wall in zip(rows, walls.walls, strict=True):
        phases = [row[k] for k in KEYS]
        assert all(t > 0 for t in phases), row
        assert sum(phases) == pytest.approx(row["perf/step_sec"], rel=1e-9, abs=1e-12)  # they partition the step
        assert sum(phases) <= wall, (phases, wall)
        assert "perf/peak_memory_gb" not in row  # CPU: no peak to read
    assert trainer.state.log_history[-1].get("perf/step_sec") is None  # the final summary row has no phase times


class _Arm(TrainerCallback):
    """Arms the delays when training begins (the checks before the first step call the collator and the loss too)."""

    def __init__(self):
        self.armed = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.armed = True

    def sleep(self):
        if self.armed:
            time.sleep(DELAY)


def test_a_delay_in_one_phase_is_charged_to_that_phase(tmp_path):
    arm = _Arm()

    def slow_collator(rows):
        arm.sleep()
        return collate(rows)

    def slow_loss(logits, labels):
        arm.sleep()  # runs once per chunk under vmap (traced in Python)
        return causal_lm_loss(logits, labels)

    def slow_sgd(lr):
        base = optim.sgd(lr)

        def update(updates, state, *, params=None, inplace=False):
            arm.sleep()
            return base.transform.update(updates, state, params=params, inplace=inplace)

        return optim.Optimizer("slow_sgd", GradientTransformation(base.transform.init, update), non_private=False)

    labelled = [{**row, "labels": row["input_ids"]} for row in DATA]  # a custom loss reads the labels column
    cases = {
        "sample": {"data_collator": slow_collator, "train_dataset": DATA},
        "gradients": {"compute_loss_func": slow_loss, "train_dataset": labelled},
        "optimizer": {"optimizer_cls_and_kwargs": (slow_sgd, {}), "train_dataset": DATA},
    }
    for phase, kw in cases.items():
        arm.armed = False
        args = _args(tmp_path / phase, step_perf=True, max_steps=2)
        trainer = DPTrainer(tiny_model("llama"), args, callbacks=[arm], **kw)
        trainer.train()
        rows = _rows(trainer)
        assert all(row[f"perf/{phase}_sec"] >= DELAY for row in rows), (phase, rows)
        for row in rows[1:]:  # the first step also pays one-time costs (the first vmap call) in its gradients phase
            others = [row[k] for k in KEYS if k != f"perf/{phase}_sec"]
            assert max(others) < DELAY, (phase, row)


def test_off_by_default_no_keys_and_the_same_run(tmp_path):
    assert TrainingArguments(privacy_noise_multiplier=1.0).step_perf is False
    plain = DPTrainer(tiny_model("llama"), _args(tmp_path / "off"), train_dataset=DATA)
    plain.train()
    assert plain._step_perf is None
    assert not any(k.startswith("perf/") for row in plain.state.log_history for k in row)
    timed = DPTrainer(tiny_model("llama"), _args(tmp_path / "on", step_perf=True), train_dataset=DATA)
    timed.train()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), timed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
