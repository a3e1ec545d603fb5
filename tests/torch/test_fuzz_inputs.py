"""Fuzzing the two front doors, ``TrainingArguments`` (with the privacy plan it resolves to) and the ``opake`` CLI,
with random bad input: every case ends in one of Opake's own errors (or a clean argparse usage error) within 30 s,
never in a raw exception from inside torch, transformers or dp-accounting, and never in a hang. The argument names
include Hugging Face's and Opacus' (honoured, aliased, inert and refused ones) and an unknown name.

The cases come from a seeded generator, so a failure replays: the assertion message holds the case.
"""

from __future__ import annotations

import contextlib
import io
import math
import signal
import warnings

import numpy as np
import pytest

from opake_core.errors import OpakeError
from opake_torch.cli import main
from opake_torch.transformers import TrainingArguments, arguments
from opake_torch.transformers.privacy import build_plan

CASES = 240
LIMIT_S = 30
BAD_VALUES = [
    -1, 0, -0.5, 0.5, 1.5, 3, 10**9, 2**70, math.nan, math.inf, -math.inf, 1e-300, 1e308,
    "", "abc", "-1", "nan", "1e400", None, True, False, [], [1, "a"], {}, {"bad": 1}, {"min": -1}, object(),
]  # fmt: skip
FIELDS = [
    "per_device_train_batch_size", "microbatch_size", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
    "optim", "lr_scheduler", "warmup_steps", "num_train_epochs", "max_steps", "clipping_norm", "clipping_mode",
    "clipping_kwargs", "privacy_target_epsilon", "privacy_target_delta", "privacy_noise_multiplier",
    "privacy_accounting", "privacy_noise_mechanism", "privacy_noise_mechanism_kwargs", "noise_calibration_kwargs",
    "sampling_mode", "sampling_kwargs", "privacy_noise_seed", "privacy_noise_generator", "privacy_allow_large_delta",
    "logging_steps", "save_steps", "eval_steps", "save_total_limit", "label_smoothing_factor", "max_length",
    "pad_to_multiple_of", "seed", "cuda_graphs", "per_example_gradients", "torch_compile_mode",
    # Hugging Face and Opacus names (see opake_torch/transformers/_from_hf.py), and one that does not exist
    "tf32", "log_level", "log_on_each_node", "gradient_checkpointing_kwargs", "do_train", "project",
    "lr_scheduler_type", "max_grad_norm", "auto_find_batch_size", "target_epsilon", "target_delta",
    "gradient_accumulation_steps", "train_sampling_strategy", "fp16", "dataloader_prefetch_factor",
    "no_such_argument",
]  # fmt: skip
BASE = {"max_steps": 4, "privacy_noise_multiplier": 1.0, "use_cpu": True, "per_device_train_batch_size": 8}
CLI_FLAGS = {
    "epsilon": ["--noise-multiplier", "--sample-rate", "--batch-size", "--dataset-size", "--steps", "--epochs",
                "--delta", "--sampler", "--truncated-batch-size", "--k", "--allocation", "--mechanism", "--bands"],
    "calibrate": ["--target-epsilon", "--sample-rate", "--dataset-size", "--steps", "--delta", "--min", "--max",
                  "--tolerance", "--mechanism", "--sampler"],
    "steps": ["--noise-multiplier", "--target-epsilon", "--sample-rate", "--dataset-size", "--delta",
              "--max-steps"],
}  # fmt: skip
CLI_BASE = {
    "epsilon": ["--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
    "calibrate": ["--target-epsilon", "3", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
    "steps": ["--noise-multiplier", "1.0", "--target-epsilon", "3", "--sample-rate", "0.01", "--delta", "1e-5"],
}
CLI_VALUES = ["-1", "0", "nan", "inf", "-inf", "1e-300", "1e308", "abc", "", "3", "0.5", "1", "2", "1000000000",
              "poisson", "k_out_of_t", "mf_band", "cyclic_poisson", "block"]  # fmt: skip


class Hang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def stop(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _argument_cases(gen: np.random.Generator) -> list[dict]:
    cases = []
    for _ in range(CASES):
        names = gen.choice(FIELDS, size=int(gen.integers(1, 4)), replace=False)
        cases.append({**BASE, **{str(n): BAD_VALUES[int(gen.integers(len(BAD_VALUES)))] for n in names}})
    return cases


def _cli_cases(gen: np.random.Generator) -> list[list[str]]:
    cases = []
    for _ in range(CASES):
        command = str(gen.choice(list(CLI_FLAGS)))
        argv = ["privacy", command, *CLI_BASE[command]]
        for flag in gen.choice(CLI_FLAGS[command], size=int(gen.integers(1, 4)), replace=False):
            argv += [str(flag), CLI_VALUES[int(gen.integers(len(CLI_VALUES)))]]
        cases.append(argv)
    return cases


def test_bad_training_arguments_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(arguments, "_set_tf32", lambda enabled: None)  # tf32=True would switch the process's TF32
    outcomes = {"refused": 0, "planned": 0}
    for kwargs in _argument_cases(np.random.default_rng(2026)):
        try:
            with time_limit(LIMIT_S), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                args = TrainingArguments(str(tmp_path), **kwargs)
                build_plan(args, 64)
            outcomes["planned"] += 1
        except OpakeError as exc:
            assert str(exc), kwargs
            outcomes["refused"] += 1
        except Exception as exc:
            pytest.fail(f"{type(exc).__name__}: {exc} for TrainingArguments(**{kwargs!r})")
    assert outcomes["refused"] > CASES // 2, outcomes  # the generator does produce bad input


def test_bad_cli_input_fails_clearly():
    codes = []
    for argv in _cli_cases(np.random.default_rng(2027)):
        err = io.StringIO()
        try:
            with time_limit(LIMIT_S), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(argv)
        except SystemExit as exc:  # argparse: a usage error, exit status 2
            code = exc.code
        except Exception as exc:
            pytest.fail(f"{type(exc).__name__}: {exc} for opake {' '.join(argv)}")
        assert code in (0, 2), (code, argv)
        assert "Traceback" not in err.getvalue(), argv
        if code == 2:
            assert "error:" in err.getvalue(), argv
        codes.append(code)
    assert codes.count(2) > CASES // 3, codes
