"""``enable_jit_checkpoint``: a real SIGTERM or SIGUSR1 ends the run at the next step boundary with a complete
checkpoint (resuming from it continues the uninterrupted trajectory bit for bit), the process exits with
``128 + signal``, and the previous signal handlers are back after ``train()``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_hf import tiny_model, token_data
from transformers import TrainerCallback

from opake_core.errors import ConfigurationError
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers.preemption import TrainingPreempted

ROOT = Path(__file__).resolve().parents[3]
ARGS = {
    "per_device_train_batch_size": 8,
    "max_steps": 4,
    "privacy_noise_multiplier": 1.0,
    "privacy_noise_seed": 7,  # the uninterrupted reference run draws the same noise and batches
    "use_cpu": True,
    "disable_tqdm": True,
    "optim": "adamw",
    "learning_rate": 0.05,
    "lr_scheduler": "constant",
    "logging_strategy": "no",
    "save_strategy": "no",  # the only checkpoint a run writes is the just-in-time one
    "report_to": "none",
}

# The run in a child process: after step 1 its callback writes the marker, then waits until the parent has sent the
# signal, so that the signal arrives before the step-1 boundary and the checkpoint is checkpoint-1.
CHILD = f"""
import sys, time
from pathlib import Path
from tiny_hf import tiny_model, token_data
from transformers import TrainerCallback
from opake_torch.transformers import DPTrainer, TrainingArguments

out, marker, sent = sys.argv[1:4]

class Wait(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            Path(marker).touch()
            deadline = time.monotonic() + 120
            while not Path(sent).exists() and time.monotonic() < deadline:
                time.sleep(0.01)

args = TrainingArguments(out, enable_jit_checkpoint=True, **{ARGS!r})
DPTrainer(tiny_model("llama"), args, train_dataset=token_data(40), callbacks=[Wait()]).train()
print("train() returned")
"""


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def _wait_for(path: Path, child: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if child.poll() is not None:
            pytest.fail(f"the child exited ({child.returncode}) before step 1:\n{child.communicate()[1]}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the child did not reach step 1")
        time.sleep(0.05)


def test_sigterm_writes_a_complete_checkpoint_and_exits_for_a_requeue(tmp_path):
    out, marker, sent = tmp_path / "out", tmp_path / "stepped", tmp_path / "sent"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "support"), str(ROOT)])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), str(marker), str(sent)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(marker, child)
    os.kill(child.pid, signal.SIGTERM)
    sent.touch()
    stdout, stderr = child.communicate(timeout=300)
    # the code of a process killed by SIGTERM, without a traceback: a scheduler sees a failure and requeues
    assert child.returncode == 128 + signal.SIGTERM, stderr
    assert "train() returned" not in stdout and "Traceback" not in stderr
    assert sorted(p.name for p in out.iterdir()) == [f"{ckpt.PREFIX}-1"]  # at the next step boundary, sealed
    folder = out / f"{ckpt.PREFIX}-1"
    assert json.loads((folder / ckpt.ACCOUNTANT).read_text())["steps"] == 1  # the ledger agrees with the weights

    full = DPTrainer(
        tiny_model("llama"), TrainingArguments(str(tmp_path / "full"), **ARGS), train_dataset=token_data(40)
    )
    full.train()
    resumed = DPTrainer(tiny_model("llama"), TrainingArguments(str(out), **ARGS), train_dataset=token_data(40))
    output = resumed.train(resume_from_checkpoint=True)
    assert output.global_step == 4
    assert all(torch.equal(x, y) for x, y in zip(_params(full).values(), _params(resumed).values(), strict=True))
    assert resumed.ledger.epsilon(delta=1e-5) == full.ledger.epsilon(delta=1e-5)


class _Signal(TrainerCallback):
    """Sends ``signum`` to this process at the end of step 1."""

    def __init__(self, signum):
        self.signum = signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), self.signum)


def test_sigusr1_stops_at_the_step_boundary_and_the_previous_handlers_come_back(tmp_path):
    seen = []
    mine = lambda signum, frame: seen.append(signum)  # noqa: E731
    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        args = TrainingArguments(str(tmp_path), enable_jit_checkpoint=True, **ARGS)
        trainer = DPTrainer(
            tiny_model("llama"), args, train_dataset=token_data(40), callbacks=[_Signal(signal.SIGUSR1)]
        )
        with pytest.raises(TrainingPreempted) as caught:
            trainer.train()
        assert caught.value.code == 128 + signal.SIGUSR1 and caught.value.step == 1
        assert caught.value.checkpoint == tmp_path / f"{ckpt.PREFIX}-1" and caught.value.checkpoint.is_dir()
        assert "SIGUSR1" in str(caught.value) and "resume_from_checkpoint" in str(caught.value)
        assert trainer.ledger.releases == 1  # the run's releases stay charged
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGUSR1) is mine
        assert seen == []  # the run's own handler took the signal
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_without_the_option_the_signal_reaches_the_previous_handler(tmp_path):
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        trainer = DPTrainer(
            tiny_model("llama"),
            TrainingArguments(str(tmp_path), **{**ARGS, "max_steps": 2}),
            train_dataset=token_data(40),
            callbacks=[_Signal(signal.SIGUSR1)],
        )
        assert trainer.train().global_step == 2
        assert seen == [signal.SIGUSR1] and not list(tmp_path.glob(f"{ckpt.PREFIX}-*"))
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_checkpoint_without_dp_state_is_refused():
    with pytest.raises(ConfigurationError, match="save_only_model"):
        TrainingArguments("out", enable_jit_checkpoint=True, save_only_model=True, **ARGS)
