"""Fuzzing the two front doors, ``TrainingArguments`` (with the TRL configs, and the privacy plan it resolves to) and
the ``opake`` command line.

Two properties, over seeded generated cases (a failure replays: its message holds the case):

* no raw failure: every case ends in one of Opake's own errors (or a clean ``argparse`` usage error, exit status 2)
  within 30 s, never in an exception from inside torch, transformers, numpy or dp-accounting, never in a hang;
* no silent acceptance: a per-field (per-flag) validity predicate written here from the documented rules, not from
  the code under test, says whether a value is right for that field over a valid base; a value it calls wrong must
  be refused and a value it calls right must be accepted (and stored, or reach the answer, unchanged).

The argument and command-line cases number about 3,500 and run in about 45 s on two CPU cores (the oracle over every
checked field and value is most of the count; the command-line cases, which run the accountants, most of the time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import signal
import typing
import warnings

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from opake_core.errors import OpakeError
from opake_torch import demo
from opake_torch.cli import main
from opake_torch.transformers import TrainingArguments, arguments
from opake_torch.transformers.privacy import build_plan
from opake_torch.transformers.trl import DPOConfig, SFTConfig

LIMIT_S = 30
INT32 = 2**31 - 1  # the documented bound of counts
SEED_MAX = 2**32 - 1  # numpy's seeding range
TF32 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
SCALE = 1e6  # the documented bound of learning rates, weight decay, clipping bounds, noise multipliers, temperatures


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


# -- the validity predicates of the arguments (docs/arguments.md, "Validation rules") ----------------------------------


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A finite int or float (a huge int is finite)."""
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


def count(low, high):
    return lambda v: is_int(v) and low <= v <= high


def real(low, high, *, open_low=False, open_high=False):
    def ok(v):
        if not is_real(v):
            return False
        return (v > low if open_low else v >= low) and (v < high if open_high else v <= high)

    return ok


def optional(rule):
    return lambda v: v is None or rule(v)


def interval(*, zero: bool):
    """A step interval: a count (0 only where allowed) or a fraction of the run in (0, 1); a float >= 1 integral."""

    def ok(v):
        if not is_real(v) or v > INT32 or v < 0:
            return False
        if isinstance(v, float) and 0 < v < 1:
            return True
        return float(v).is_integer() and (v >= 1 or (zero and v == 0))

    return ok


def numeric_text(v):
    """A number, or a string that reads as one (as the command line gives it), else None."""
    if is_real(v) or (isinstance(v, float)):
        return v
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def clipping_bound(v) -> bool:  # the base has noise, so math.inf (no clipping) is wrong
    if isinstance(v, dict):
        return "fallback" in v and all(clipping_bound(x) for x in v.values())
    v = numeric_text(v)
    return v is not None and not isinstance(v, bool) and real(1e-12, SCALE)(v)


def noise_multiplier(v) -> bool:
    return is_real(v) and (v == 0 or real(1e-6, SCALE)(v))


def router_coefficient(v) -> bool:  # a positive coefficient needs router_aux_kwargs, absent from the base
    return v is None or (not isinstance(v, bool) and numeric_text(v) == 0)


BASE = {"max_steps": 4, "privacy_noise_multiplier": 1.0, "use_cpu": True, "per_device_train_batch_size": 8}
LEARNING_RATE = 5e-5  # the default: weight decay must keep learning_rate * weight_decay <= 1
SPEC = {
    "per_device_train_batch_size": count(1, INT32),
    "per_device_eval_batch_size": optional(count(1, INT32)),
    "microbatch_size": optional(count(1, BASE["per_device_train_batch_size"])),
    "max_steps": lambda v: is_int(v) and (v == -1 or 1 <= v <= INT32),
    "num_train_epochs": real(0, SCALE, open_low=True),
    "warmup_steps": interval(zero=True),
    "logging_steps": interval(zero=False),  # logging_strategy="steps" needs a non-zero interval
    "save_steps": interval(zero=False),
    "eval_steps": optional(interval(zero=False)),
    "eval_delay": real(0, INT32),
    "learning_rate": real(0, SCALE),
    "weight_decay": lambda v: real(0, SCALE)(v) and v * LEARNING_RATE <= 1,
    "adam_epsilon": real(0, SCALE),
    "adam_beta1": real(0, 1, open_high=True),
    "adam_beta2": real(0, 1, open_high=True),
    "label_smoothing_factor": real(0, 1, open_high=True),
    "cuda_graphs": count(0, INT32),
    "per_example_row_multiple": count(1, INT32),
    "layerwise_ghost_advantage": real(0, SCALE, open_low=True),
    "seed": count(0, SEED_MAX),
    "data_seed": optional(count(0, SEED_MAX)),
    "privacy_noise_seed": optional(is_int),
    "save_total_limit": optional(count(1, INT32)),
    "dataloader_num_workers": count(0, 1024),
    "max_length": optional(count(1, INT32)),
    "pad_to_multiple_of": optional(count(1, INT32)),
    "local_rank": count(-1, INT32),
    "ddp_timeout": count(1, INT32),
    "clipping_norm": clipping_bound,
    "router_aux_loss_coef": router_coefficient,
    "privacy_noise_multiplier": noise_multiplier,
    "privacy_target_epsilon": optional(real(0, SCALE, open_low=True)),
    "privacy_target_delta": optional(real(0, 1, open_low=True, open_high=True)),
    "gradient_checkpointing": lambda v: v is None or isinstance(v, bool),  # None: Hugging Face's default, off
    "load_best_model_at_end": lambda v: v is False,  # True needs the eval and save strategies the base lacks
    "privacy_max_rows_per_user": lambda v: v is None,  # any count is refused at the base's privacy_unit="record"
    "tf32": lambda v: v is None or v is False or (v is True and TF32),
    # SFTConfig
    "loss_chunk_size": count(1, INT32),
    "packing": lambda v: v is False,  # True breaks one row = one example
    "padding_free": lambda v: v is False,
    # DPOConfig (loss_type "sigmoid")
    "beta": real(0, SCALE, open_low=True),
    "discopop_tau": real(0, SCALE, open_low=True),
    "ref_model_mixup_alpha": real(0, 1, open_low=True),  # TR-DPO's alpha, in (0, 1]
    "ref_model_sync_steps": count(1, INT32),
    "label_smoothing": real(0, 1, open_high=True),
    "precompute_ref_batch_size": optional(count(1, INT32)),
    "simpo_gamma": real(0, SCALE),
    "cpo_alpha": real(0, SCALE),
    "orpo_lambda": real(0, SCALE),
    "ld_alpha": optional(real(0, 1)),
    "f_alpha_divergence_coef": real(0, SCALE),
}
VALUES = [
    True, False, None, 0, 1, -1, 2, 8, 0.5, 1.5, 50.0, 1e-7, 1e-13, 1e-300, 1e300, 1e308, INT32, INT32 + 1, 2**32,
    2**70, 10**400, math.nan, math.inf, -math.inf, "1", "0", "False", "yes", "", "nan", "1e400", [], [1, "a"], {},
    {"fallback": 2.0}, {"min": -1}, ["labels"],
]  # fmt: skip
# Stored as something else than given, by documented resolution: None resolved to a value, strings and dicts read.
NORMALIZED = {
    "per_device_eval_batch_size",
    "data_seed",
    "clipping_norm",
    "router_aux_loss_coef",
    "eval_steps",
    "gradient_checkpointing",
    "dataloader_pin_memory",
}  # fmt: skip (use_cpu turns pinning off)
# Rules that read another field of the base, which a case with several fields may change.
CONTEXTUAL = {"microbatch_size", "weight_decay", "clipping_norm", "privacy_noise_multiplier", "router_aux_loss_coef",
              "learning_rate", "per_device_train_batch_size"}  # fmt: skip


@functools.cache
def checked_fields(cls: type) -> dict[str, tuple[type, bool]]:
    """``{name: (kind, optional)}`` of the fields annotated bool, int or float (alone or with None), found here from
    the annotations, independently of the code under test."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        kinds = set(typing.get_args(hint)) or {hint}
        optional_ = type(None) in kinds
        kinds.discard(type(None))
        if kinds <= {bool} and kinds:
            out[f.name] = (bool, optional_)
        elif kinds and kinds <= {int, float, dict[str, float], str} and kinds & {int, float}:
            out[f.name] = (float, optional_)
    return out


def valid(cls: type, name: str, value) -> bool:
    kind, optional_ = checked_fields(cls)[name]
    if name in SPEC:
        return SPEC[name](value)
    assert kind is bool, f"{cls.__name__}.{name} is numeric: give it a rule in SPEC"
    return isinstance(value, bool) or (optional_ and value is None)


def _fields_under_test(cls: type) -> list[str]:
    own = set(checked_fields(cls)) - (set() if cls is TrainingArguments else set(checked_fields(TrainingArguments)))
    return sorted(own)


def _construct(cls: type, kwargs: dict):
    with time_limit(LIMIT_S), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls("fuzz_output", **kwargs)


def test_every_checked_field_has_a_rule():
    for cls in (TrainingArguments, SFTConfig, DPOConfig):
        numeric = [n for n, (kind, _) in checked_fields(cls).items() if kind is not bool]
        assert set(numeric) <= set(SPEC), set(numeric) - set(SPEC)
    flags = [n for n, (kind, _) in checked_fields(TrainingArguments).items() if kind is bool]
    assert len(flags) >= 30 and {"save_only_model", "bf16", "push_to_hub", "torch_compile"} <= set(flags)


@pytest.mark.parametrize("cls", [TrainingArguments, SFTConfig, DPOConfig], ids=lambda c: c.__name__)
def test_each_field_refuses_exactly_the_wrong_values(monkeypatch, cls):
    """Every checked field (bool or numeric, by annotation) with every value of the pool, over a valid base."""
    monkeypatch.setattr(arguments, "_set_tf32", lambda enabled: None)  # tf32=True would switch the process's TF32
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    silent, wrongly_refused, raw, changed, cases = [], [], [], [], 0
    for name in _fields_under_test(cls):
        for value in VALUES:
            cases += 1
            kwargs = {**BASE, name: value}
            if name == "privacy_noise_multiplier" and value is None:
                kwargs["privacy_target_epsilon"] = 3.0  # None means: calibrate to the target
            expected = valid(cls, name, value) or (name == "privacy_noise_multiplier" and value is None)
            try:
                args = _construct(cls, kwargs)
            except OpakeError as exc:
                assert str(exc)
                if expected:
                    wrongly_refused.append((name, value, str(exc)[:160]))
                continue
            except Exception as exc:
                raw.append((name, value, f"{type(exc).__name__}: {exc}"[:160]))
                continue
            if not expected:
                silent.append((name, value, getattr(args, name)))
            elif value is not None and name not in NORMALIZED and not _same(getattr(args, name), value):
                changed.append((name, value, getattr(args, name)))
    assert not raw, raw
    assert not silent, silent
    assert not wrongly_refused, wrongly_refused
    assert not changed, changed
    assert cases >= len(VALUES) * (30 if cls is TrainingArguments else 5)


def _same(stored, given) -> bool:
    """The stored value is the given one (a count given as an integral float may be stored as the int)."""
    return type(stored) is not str and stored == given


MULTI_CASES = 300
MULTI_FIELDS = [
    *sorted(SPEC.keys() - {"loss_chunk_size", "packing", "padding_free", "beta", "discopop_tau", "label_smoothing",
                            "precompute_ref_batch_size", "simpo_gamma", "cpo_alpha", "orpo_lambda", "ld_alpha",
                            "f_alpha_divergence_coef"}),
    "optim", "lr_scheduler", "clipping_mode", "clipping_kwargs", "privacy_noise_mechanism",
    "privacy_noise_mechanism_kwargs", "noise_calibration_kwargs", "sampling_mode", "sampling_kwargs",
    "privacy_noise_generator", "per_example_gradients", "torch_compile_mode", "label_names", "save_only_model", "bf16",
    "push_to_hub", "torch_compile", "privacy_accounting", "ignore_data_skip",
    # Hugging Face and Opacus names (see opake_torch/transformers/_from_hf.py), and one that does not exist
    "tf32", "log_level", "log_on_each_node", "gradient_checkpointing_kwargs", "do_train", "project",
    "lr_scheduler_type", "max_grad_norm", "auto_find_batch_size", "target_epsilon", "target_delta",
    "gradient_accumulation_steps", "train_sampling_strategy", "fp16", "dataloader_prefetch_factor",
    "no_such_argument",
]  # fmt: skip


def test_combinations_of_bad_arguments_fail_clearly(monkeypatch):
    """1 to 3 fields at once, through to the privacy plan: no raw error, and a value wrong for its field (SPEC or a
    bool field) is refused whatever the others hold (the other rules only refuse more)."""
    monkeypatch.setattr(arguments, "_set_tf32", lambda enabled: None)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gen = np.random.default_rng(2026)
    outcomes = {"refused": 0, "planned": 0}
    for _ in range(MULTI_CASES):
        names = gen.choice(MULTI_FIELDS, size=int(gen.integers(1, 4)), replace=False)
        kwargs = {**BASE, **{str(n): VALUES[int(gen.integers(len(VALUES)))] for n in names}}
        checked = set(checked_fields(TrainingArguments)) - CONTEXTUAL
        wrong = [n for n in names if n in checked and not valid(TrainingArguments, n, kwargs[n])]
        try:
            args = _construct(TrainingArguments, kwargs)
            with time_limit(LIMIT_S), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build_plan(args, 64)
        except OpakeError as exc:
            assert str(exc), kwargs
            outcomes["refused"] += 1
            continue
        except Exception as exc:
            pytest.fail(f"{type(exc).__name__}: {exc} for TrainingArguments(**{kwargs!r})")
        assert not wrong, f"accepted {wrong} in {kwargs!r}"
        outcomes["planned"] += 1
    assert outcomes["refused"] > MULTI_CASES // 2 and outcomes["planned"] > MULTI_CASES // 20, outcomes


# -- the command line --------------------------------------------------------------------------------------------------


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        with time_limit(LIMIT_S), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as exc:  # argparse: a usage error, exit status 2
        code = exc.code
    except Exception as exc:
        pytest.fail(f"{type(exc).__name__}: {exc} for opake {' '.join(argv)}")
    assert "Traceback" not in err.getvalue(), argv
    assert code in (0, 2), (code, argv, err.getvalue())
    if code == 2:
        assert "error:" in err.getvalue(), argv
    return code, out.getvalue(), err.getvalue()


@functools.cache
def rdp_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """Epsilon of Poisson-sampled Gaussian DP-SGD from dp-accounting directly: the reference of reachability."""
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def number(text: str):
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def integer(text: str):
    try:
        return int(text)
    except ValueError:
        return None


def in_range(low, high, *, integral=False, open_low=False, open_high=False):
    def ok(text):
        v = integer(text) if integral else number(text)
        return v is not None and (v > low if open_low else v >= low) and (v < high if open_high else v <= high)

    return ok


def sigma_ok(text):
    v = number(text)
    return v is not None and (v == 0 or 1e-6 <= v <= SCALE)


never = lambda text: False  # noqa: E731 (a flag the base's sampler or mechanism does not read, or no flag at all)
N_OK = lambda text: in_range(1, 2**53, integral=True)(text) and 1e-5 < 1 / int(text)  # noqa: E731 (delta < 1/N)
COMMON = {
    "--sample-rate": in_range(0, 1, open_low=True),
    "--dataset-size": N_OK,
    "--delta": in_range(0, 1, open_low=True, open_high=True),
    "--sampler": lambda text: text == "poisson",  # the others need flags of their own (or are DP-FTRL samplers)
    "--mechanism": lambda text: text in ("gaussian", "mf_identity"),  # mf_identity: Poisson + RDP is plain DP-SGD
    "--accountant": lambda text: text == "rdp",
    "--batch-size": never,  # the base gives --sample-rate
    "--truncated-batch-size": never,
    "--k": never,
    "--allocation": never,
    "--mc-samples": never,
    "--bands": never,
    "--max-buffers": never,
    "--bandwidth": never,
    "--alpha": never,
    "--beta": never,
    "--lambda": never,
    "--no-such-flag": never,
}
Q, STEPS, DELTA, TARGET, SIGMA = 0.01, 100, 1e-5, 3.0, 1.0
COMMANDS = {
    "epsilon": (
        ["--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
        {
            **COMMON,
            "--noise-multiplier": sigma_ok,
            "--steps": in_range(1, INT32, integral=True),
            "--epochs": never,  # the base gives --steps
            "--target-epsilon": never,
        },
    ),
    "calibrate": (
        ["--target-epsilon", "3", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
        {
            **COMMON,
            "--target-epsilon": lambda t: (
                in_range(0, SCALE, open_low=True)(t) and rdp_epsilon(10.0, Q, STEPS, DELTA) <= float(t)
            ),  # reachable at --max 10
            "--sample-rate": lambda t: (
                COMMON["--sample-rate"](t) and rdp_epsilon(10.0, float(t), STEPS, DELTA) <= TARGET
            ),
            "--steps": lambda t: in_range(1, INT32, integral=True)(t) and rdp_epsilon(10.0, Q, int(t), DELTA) <= TARGET,
            "--delta": lambda t: COMMON["--delta"](t) and rdp_epsilon(10.0, Q, STEPS, float(t)) <= TARGET,
            "--min": lambda t: in_range(1e-6, SCALE)(t) and float(t) < 10.0,
            "--max": lambda t: (
                in_range(1e-6, SCALE)(t) and float(t) > 0.11 and rdp_epsilon(float(t), Q, STEPS, DELTA) <= TARGET
            ),
            "--tolerance": in_range(1e-9, 1, open_high=True),
            "--epochs": never,
            "--noise-multiplier": never,
        },
    ),
    "steps": (
        ["--noise-multiplier", "1.0", "--target-epsilon", "3", "--sample-rate", "0.01", "--delta", "1e-5"],
        {
            **COMMON,
            "--mechanism": lambda text: text == "gaussian",  # a DP-FTRL mechanism is accounted for its horizon only
            "--noise-multiplier": lambda t: (
                sigma_ok(t) and number(t) != 0 and rdp_epsilon(number(t), Q, 1, DELTA) <= TARGET
            ),  # one step fits the target
            "--target-epsilon": lambda t: (
                in_range(0, SCALE, open_low=True)(t) and rdp_epsilon(SIGMA, Q, 1, DELTA) <= float(t)
            ),
            "--sample-rate": lambda t: COMMON["--sample-rate"](t) and rdp_epsilon(SIGMA, float(t), 1, DELTA) <= TARGET,
            "--delta": lambda t: COMMON["--delta"](t) and rdp_epsilon(SIGMA, Q, 1, float(t)) <= TARGET,
            "--max-steps": in_range(1, INT32, integral=True),
            "--steps": never,
            "--epochs": never,
        },
    ),
}
CLI_VALUES = ["-1", "0", "1", "2", "3", "0.5", "100", "1000000000", "3000000000", "1e-7", "1e-300", "1e308", "nan",
              "inf", "-inf", "abc", "", "poisson", "k_out_of_t", "gaussian", "mf_identity", "mf_band", "block",
              "rdp"]  # fmt: skip
ANSWER_KEYS = {"--noise-multiplier": "noise_multiplier", "--sample-rate": "sample_rate", "--steps": "steps",
               "--delta": "delta", "--dataset-size": "dataset_size", "--target-epsilon": "target_epsilon",
               "--min": "min", "--max": "max", "--tolerance": "tolerance", "--max-steps": "max_steps"}  # fmt: skip


def test_each_flag_refuses_exactly_the_wrong_values():
    """Every flag of ``opake privacy epsilon|calibrate|steps`` set to every value of the pool over a valid base (RDP,
    so that an accepted case answers in milliseconds); an accepted value must reach the answer unchanged."""
    silent, wrongly_refused = [], []
    cases = [(c, f, v) for c, (_, rules) in COMMANDS.items() for f in rules for v in CLI_VALUES]
    for command, flag, text in cases:
        base, rules = COMMANDS[command]
        argv = ["privacy", command, *base, "--accountant", "rdp", "--json", flag, text]
        code, out, err = _main(argv)
        expected = rules[flag](text)
        if code == 0 and not expected:
            silent.append((command, flag, text, out.strip()[:120]))
        elif code != 0 and expected:
            wrongly_refused.append((command, flag, text, err.strip().splitlines()[-1][:160]))
        elif code == 0 and flag in ANSWER_KEYS:
            got = json.loads(out)[ANSWER_KEYS[flag]]
            assert got == (int(text) if flag in ("--steps", "--dataset-size", "--max-steps") else float(text)), argv
    assert not silent, silent
    assert not wrongly_refused, wrongly_refused
    assert len(cases) > 1500


CLI_RANDOM_CASES = 300
CLI_FLAGS = {
    "epsilon": ["--noise-multiplier", "--sample-rate", "--batch-size", "--dataset-size", "--steps", "--epochs",
                "--delta", "--sampler", "--truncated-batch-size", "--k", "--allocation", "--mechanism", "--bands",
                "--mc-samples", "--accountant"],
    "calibrate": ["--target-epsilon", "--sample-rate", "--dataset-size", "--steps", "--delta", "--min", "--max",
                  "--tolerance", "--mechanism", "--sampler", "--mc-samples"],
    "steps": ["--noise-multiplier", "--target-epsilon", "--sample-rate", "--dataset-size", "--delta",
              "--max-steps", "--sampler"],
}  # fmt: skip
MONTE_CARLO = {"k_out_of_t", "balls_in_bins", "b_min_sep", "mf_blt", "mf_band"}


def test_combinations_of_bad_flags_fail_clearly():
    """1 to 3 flags at once: no raw error, no hang. ``epsilon`` runs the PLD default; ``calibrate`` and ``steps``
    search with RDP (their PLD searches take seconds each, and ``test_cli_privacy.py`` covers them)."""
    gen = np.random.default_rng(2028)
    codes = []
    for _ in range(CLI_RANDOM_CASES):
        command = str(gen.choice(list(CLI_FLAGS)))
        argv = ["privacy", command, *COMMANDS[command][0], *([] if command == "epsilon" else ["--accountant", "rdp"])]
        for flag in gen.choice(CLI_FLAGS[command], size=int(gen.integers(1, 4)), replace=False):
            argv += [str(flag), CLI_VALUES[int(gen.integers(len(CLI_VALUES)))]]
        if MONTE_CARLO & set(argv) and "--mc-samples" not in argv:
            argv += ["--mc-samples", "1000"]  # keeps a Monte Carlo answer to a second (the default takes minutes)
        codes.append(_main(argv)[0])
    assert codes.count(2) > CLI_RANDOM_CASES // 3, codes


def test_demo_flags_are_refused_or_reach_the_run(monkeypatch, tmp_path):
    """``opake demo --epochs X`` and ``--target-epsilon X``; accepted values must reach the run's configuration
    (the run itself, a minute of training, is replaced by a recorder)."""
    seen = []

    def record(config, output_dir):
        seen.append(config)
        private = {"final_epsilon": 1.0, "delta": 1e-3, "exposures": [1.0]}
        return {"private": private, "non_private": private}

    monkeypatch.setattr(demo, "run", record)
    rules = {"--epochs": in_range(0, 100, open_low=True), "--target-epsilon": in_range(0, SCALE, open_low=True)}
    for flag, rule in rules.items():
        for text in CLI_VALUES:
            code, _, _ = _main(["demo", "--output-dir", str(tmp_path / "demo"), flag, text])
            assert (code == 0) == rule(text), (flag, text)
            if code == 0:
                assert getattr(seen[-1], flag[2:].replace("-", "_")) == float(text)
