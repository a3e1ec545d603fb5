"""Fuzzing the data, the model and the core step with random bad input: 400 seeded cases.

Every case is judged by a validity predicate written here, independently of the checks under test (plain Python over
the rows' values, the model's output, the arguments). A case the predicate calls wrong must end in one of Opake's own
errors before the first step: no step begun, nothing in the ledger. A case it calls right must pass, and is then
confirmed by running it: the loss of a batch holding the changed row is finite (data), the run reaches its first step
(models), the step's update is finite (core). Any other exception, from inside torch, transformers, NumPy or
dp-accounting, fails the test, and so does a wrong case that passes (a silent acceptance) or a right one refused.

The cases come from a seeded generator, so a failure replays: its message holds the case.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
import time
import types

import numpy as np
import pytest
import torch
from tiny_hf import VOCAB, tiny_model, token_data
from torch import nn
from transformers import TrainerCallback
from transformers.modeling_outputs import CausalLMOutput, SequenceClassifierOutput

from opake_core import optim, random
from opake_core.clipping import clipped_grad
from opake_core.errors import OpakeError
from opake_core.step import dp_sgd
from opake_torch.transformers import DPTrainer, TrainingArguments

DATA_CASES, MODEL_CASES, CORE_CASES = 260, 40, 100
ROWS, CLASSES, POSITIONS, TYPES = 16, 3, 32, 2  # the tiny BERT: 3 classes, 32 positions, 2 token types
F32_MAX = float(torch.finfo(torch.float32).max)
NUMBERS = [-5, -1, 0, 1, 2, 3, 7, VOCAB - 1, VOCAB, VOCAB + 3, 2**31, 2**63 - 1, -100]
BAD = [-1, 0, -0.5, 0.5, 3, 10**9, 2**70, math.nan, math.inf, -math.inf, 1e-300, 1e308, "", "abc", None, True,
       [], {}, object()]  # fmt: skip


class Reached(Exception):
    """Raised at the first step's begin: everything before it passed."""


class StopAtFirstStep(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        raise Reached


def _args(path, **kw):
    base = {
        "per_device_train_batch_size": 4,
        "max_steps": 1,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 0,
        "per_example_gradients": "vmap",
    }
    return TrainingArguments(str(path), **{**base, **kw})


# -- the validity predicate ------------------------------------------------------------------------------------------


def _flat_ints(value, *, bools=False):
    """The value as a list of Python ints when it is a flat sequence of integers (of bools too with ``bools``), else
    None."""
    if isinstance(value, torch.Tensor):
        integral = not value.dtype.is_floating_point and not value.dtype.is_complex
        if value.dim() != 1 or not integral or (value.dtype == torch.bool and not bools):
            return None
        return [int(v) for v in value.tolist()]
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in ("iub" if bools else "iu"):
            return None
        return [int(v) for v in value.tolist()]
    if isinstance(value, list | tuple) and all(
        isinstance(v, int) and (bools or not isinstance(v, bool)) and -(2**63) <= v < 2**63 for v in value
    ):
        return [int(v) for v in value]
    return None


def _class_label(value):
    """A class id as an int, a tuple of floats (class probabilities), or None when it is neither."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.dtype.is_floating_point and value.dtype != torch.bool:
            return int(value)
        if value.dim() == 1 and value.dtype.is_floating_point:
            return tuple(float(v) for v in value.tolist())
        return None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value if -(2**63) <= value < 2**63 else None
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return tuple(value)
    return None


def rows_are_valid(rows, task):
    """Whether every row is one the model and the loss take: the contract of the trainer's data, written out."""
    read = {"input_ids", "attention_mask", "token_type_ids", "labels"}
    if not all(isinstance(row, dict) for row in rows):
        return False
    columns = {frozenset(set(row) & read) for row in rows}
    if len(columns) != 1:
        return False
    for row in rows:
        ids = _flat_ints(row.get("input_ids"))
        if ids is None or not all(0 <= t < VOCAB for t in ids):
            return False
        if task == "bert" and len(ids) > POSITIONS:
            return False
        if "attention_mask" in row:
            mask = _flat_ints(row["attention_mask"], bools=True)
            if mask is None or len(mask) != len(ids) or not set(mask) <= {0, 1}:
                return False
        if "token_type_ids" in row:
            types_ = _flat_ints(row["token_type_ids"])
            if types_ is None or len(types_) != len(ids) or not all(0 <= t < TYPES for t in types_):
                return False
        if task == "bert":
            label = _class_label(row.get("labels"))
            if label is None:
                return False
            if isinstance(label, int) and not 0 <= label < CLASSES:
                return False
            if isinstance(label, tuple) and (len(label) != CLASSES or not all(math.isfinite(v) for v in label)):
                return False
        elif "labels" in row:
            labels = _flat_ints(row["labels"])
            if labels is None or len(labels) != len(ids) or not all(t == -100 or 0 <= t < VOCAB for t in labels):
                return False
    return True


# -- data cases ------------------------------------------------------------------------------------------------------


def _base_rows(task):
    data = token_data(ROWS, seed=5, classes=CLASSES if task == "bert" else None)
    return [dict(row) for row in data]


def _corrupt(rows, task, gen, *, first):
    """Change one thing in the rows (a value, a type, a column), chosen by ``gen``; returns a description. A change
    to every row (a new column) comes first only; later ones change a row still intact."""
    intact = [
        i for i, row in enumerate(rows) if isinstance(row, dict) and isinstance(row.get("input_ids"), torch.Tensor)
    ]
    r = int(gen.choice(intact))
    row = rows[r]
    n = len(row["input_ids"])
    kinds = ["token", "ids", "mask", "label", "types", "row", "extra"] if first else ["token", "ids", "mask", "row"]
    kind = str(gen.choice(kinds))
    if kind == "token":
        ids = row["input_ids"].clone()
        ids[int(gen.integers(n))] = int(gen.choice([-3, -1, 0, VOCAB - 1, VOCAB, VOCAB + 5, 2**31]))
        row["input_ids"] = ids
    elif kind == "ids":
        options = {
            "float": row["input_ids"].float(),
            "float list": [float(t) for t in row["input_ids"]],
            "strings": [str(int(t)) for t in row["input_ids"]],
            "2-D": row["input_ids"][None],
            "ragged": [[1, 2], [3]],
            "None": None,
            "text": "some text",
            "dict": {"ids": 1},
            "0-d": torch.tensor(5),
            "bool": row["input_ids"] > 10,
            "list": [int(t) for t in row["input_ids"]],
            "numpy": row["input_ids"].numpy().astype(np.int32),
            "empty": [],
            "huge": [2**70, 1],
        }
        name = str(gen.choice(list(options)))
        row["input_ids"] = options[name]
        if name in ("list", "numpy", "empty", "float", "float list", "strings", "bool") and "attention_mask" in row:
            row["attention_mask"] = torch.ones(len(options[name]), dtype=torch.long)
        kind = f"ids={name}"
    elif kind == "mask":
        options = {
            "two": torch.full((n,), 2),
            "minus": torch.full((n,), -1),
            "short": torch.ones(max(n - 1, 0), dtype=torch.long),
            "long": torch.ones(n + 1, dtype=torch.long),
            "float": torch.ones(n),
            "bool": torch.ones(n, dtype=torch.bool),
            "zeros": torch.zeros(n, dtype=torch.long),
            "deleted": None,
        }
        name = str(gen.choice(list(options)))
        if name == "deleted":
            del row["attention_mask"]
        else:
            row["attention_mask"] = options[name]
        kind = f"mask={name}"
    elif kind == "label" and task == "bert":
        name = str(gen.choice(["int", "float", "nan", "string", "None", "probabilities", "short probabilities", "bool",
                               "huge", "1-D int", "deleted", "numpy"]))  # fmt: skip
        value = {
            "int": torch.tensor(int(gen.choice(NUMBERS))),
            "float": 1.0,
            "nan": math.nan,
            "string": "positive",
            "None": None,
            "probabilities": [0.2, 0.3, 0.5],
            "short probabilities": [0.5, 0.5],
            "bool": True,
            "huge": 2**70,
            "1-D int": torch.tensor([1]),
            "numpy": np.int64(int(gen.integers(-1, 4))),
        }.get(name)
        if name == "deleted":
            del row["labels"]
        else:
            row["labels"] = value
        kind = f"label={name}"
    elif kind == "label":  # causal LM: a labels column for every row, one of them changed
        for other in rows:
            other["labels"] = other["input_ids"].clone()
        name = str(gen.choice(["ignored", "token", "short", "float"]))
        labels = row["labels"].clone()
        if name == "ignored":
            labels[0] = -100
        elif name == "token":
            labels[int(gen.integers(n))] = int(gen.choice(NUMBERS))
        elif name == "short":
            labels = labels[:-1]
        else:
            labels = labels.float()
        row["labels"] = labels
        kind = f"labels={name}"
    elif kind == "types" and task == "bert":
        for other in rows:
            other["token_type_ids"] = torch.zeros(len(other["input_ids"]), dtype=torch.long)
        name = str(gen.choice(["zeros", "two", "short", "one row only"]))
        if name == "two":
            row["token_type_ids"] = torch.full((n,), 2)
        elif name == "short":
            row["token_type_ids"] = torch.zeros(max(n - 1, 0), dtype=torch.long)
        elif name == "one row only":
            for other in rows:
                if other is not row:
                    del other["token_type_ids"]
        kind = f"types={name}"
    elif kind == "row":
        rows[r] = [row["input_ids"]] if gen.random() < 0.5 else "a row"
    elif kind == "extra" or kind == "types":
        for other in rows:
            other["text"] = "unused"
        if task == "bert" and gen.random() < 0.5:  # a long record: past BERT's 32 positions
            row["input_ids"] = torch.randint(1, VOCAB, (POSITIONS + 8,))
            row["attention_mask"] = torch.ones(POSITIONS + 8, dtype=torch.long)
            kind = "long"
    return f"row {r}: {kind}"


def _finite_loss_with(trainer, rows, r):
    """The losses of a batch of row ``r`` and one other row: finite (the loss takes the row)."""
    batch = trainer.fetch_batch(rows, np.array([r, (r + 1) % len(rows)]))
    losses = trainer.compute_batch_losses(trainer._params, batch)
    return bool(torch.isfinite(losses).all())


def _run_data_cases(tmp_path, gen, outcomes):
    trainers = {
        task: DPTrainer(tiny_model(task), _args(tmp_path / task), train_dataset=_base_rows(task),
                        callbacks=[StopAtFirstStep()])
        for task in ("bert", "llama")
    }  # fmt: skip
    for case in range(DATA_CASES):
        task = "bert" if case % 2 == 0 else "llama"
        rows = copy.deepcopy(_base_rows(task))
        what = [_corrupt(rows, task, gen, first=i == 0) for i in range(1 + int(gen.random() < 0.25))]
        trainer, valid = trainers[task], rows_are_valid(rows, task)
        label = f"{task} data case {case} ({'; '.join(what)}; valid={valid})"
        if valid:  # passes the check, and the loss of a batch holding a changed row is finite
            _passes(lambda: trainer._check_data(rows, "train_dataset", training=True), label)  # noqa: B023
            r = int(what[-1].split(":")[0].split()[1])
            _passes(lambda: _finite_loss_with(trainer, rows, r), label)  # noqa: B023
            assert _finite_loss_with(trainer, rows, r), label
            outcomes["accepted"] += 1
        else:
            trainer.train_dataset = rows
            _refused_before_the_first_step(trainer, label)
            outcomes["refused"] += 1


def _passes(fn, label):
    try:
        fn()
    except OpakeError as exc:
        pytest.fail(f"refused a valid case: {type(exc).__name__}: {exc} -- {label}")
    except Exception as exc:
        pytest.fail(f"raw {type(exc).__name__}: {exc} -- {label}")


def _refused_before_the_first_step(trainer, label):
    try:
        trainer.train()
    except Reached:
        pytest.fail(f"silently accepted: training reached its first step -- {label}")
    except OpakeError as exc:
        assert str(exc), label
    except Exception as exc:
        pytest.fail(f"raw {type(exc).__name__}: {exc} -- {label}")
    assert trainer.state.global_step == 0 and trainer.ledger.releases == 0, label


# -- model cases -----------------------------------------------------------------------------------------------------


class _Wrapped(nn.Module):
    """A tiny model whose output is changed by ``change(logits) -> output``."""

    def __init__(self, family, change):
        super().__init__()
        self.inner, self.change = tiny_model(family), change
        self.config = self.inner.config

    def forward(self, input_ids=None, attention_mask=None):
        return self.change(self.inner(input_ids=input_ids, attention_mask=attention_mask).logits)


class WrappedForSequenceClassification(_Wrapped):
    pass


class WrappedForCausalLM(_Wrapped):
    pass


def _broken(logits):
    raise RuntimeError("a head that fails")


MODEL_CHANGES = {  # name -> (change, valid)
    "ModelOutput": (None, True),
    "tuple": (lambda lg: (lg,), False),
    "plain dict": (lambda lg: {"logits": lg}, False),
    "tensor": (lambda lg: lg, False),
    "None": (lambda lg: None, False),
    "other name": (lambda lg: types.SimpleNamespace(scores=lg), False),
    "list logits": (lambda lg: types.SimpleNamespace(logits=lg.tolist()), False),
    "int logits": (lambda lg: types.SimpleNamespace(logits=lg.long()), False),
    "extra dim": (lambda lg: types.SimpleNamespace(logits=lg[..., None]), False),
    "no batch dim": (lambda lg: types.SimpleNamespace(logits=lg[0]), False),
    "one more class": (lambda lg: types.SimpleNamespace(logits=torch.cat([lg, lg[..., :1]], dim=-1)), False),
    "one position less": (lambda lg: types.SimpleNamespace(logits=lg[:, :-1] if lg.dim() == 3 else lg[:0]), False),
    "raises": (_broken, False),
}


def _run_model_cases(tmp_path, gen, outcomes):
    for case in range(MODEL_CASES):
        family = "bert" if case % 2 == 0 else "llama"
        name = str(gen.choice(list(MODEL_CHANGES)))
        change, valid = MODEL_CHANGES[name]
        output = SequenceClassifierOutput if family == "bert" else CausalLMOutput
        change = change or (lambda lg, output=output: output(logits=lg))
        model = (WrappedForSequenceClassification if family == "bert" else WrappedForCausalLM)(family, change)
        label = f"{family} model case {case} ({name}; valid={valid})"
        rows = _base_rows(family)
        try:
            trainer = DPTrainer(model, _args(tmp_path / f"m{case}"), train_dataset=rows, callbacks=[StopAtFirstStep()])
        except OpakeError:
            assert not valid, label
            outcomes["refused"] += 1
            continue
        if valid:
            with pytest.raises(Reached):  # the run reaches its first step
                trainer.train()
            outcomes["accepted"] += 1
        else:
            _refused_before_the_first_step(trainer, label)
            outcomes["refused"] += 1


# -- core cases ------------------------------------------------------------------------------------------------------


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def core_is_valid(kw):
    """Whether the arguments of ``dp_sgd`` (or ``clipped_grad``) describe a step whose update is finite."""
    c, n = kw["clipping_norm"], kw["expected_batch_size"]
    z = kw.get("noise_multiplier", 0.0)
    if not (_is_real(c) and c > 0):  # NaN fails too
        return False
    if not (_is_real(n) and math.isfinite(n) and n > 0 and 1 / n <= F32_MAX):
        return False
    if not (_is_real(z) and (z == 0 or 1e-6 <= z <= 1e6)):  # the documented range of a noise multiplier
        return False
    if math.isfinite(c) and c / n > F32_MAX:
        return False
    if z > 0 and (math.isinf(c) or z * c / n > F32_MAX / 64):
        return False
    mb = kw["microbatch_size"]
    if mb is not None and (not isinstance(mb, int) or isinstance(mb, bool) or mb < 1):
        return False
    step = "noise_multiplier" in kw  # a dp_sgd step takes its batch as a tuple; clipped_grad as arguments
    return (
        isinstance(kw.get("key", random.key(0)), random.Key)
        and callable(kw["loss_fn"])
        and (kw["batch"] == "good" or (kw["batch"] == "list" and not step))
        and kw["params"] == "good"
        and kw.get("optimizer", "sgd") == "sgd"
    )


def _core_case(gen):
    kw = {
        "clipping_norm": 1.0,
        "noise_multiplier": 1.0,
        "expected_batch_size": 4.0,
        "microbatch_size": None,
        "key": random.key(1),
        "loss_fn": "good",
        "batch": "good",
        "params": "good",
        "optimizer": "sgd",
    }
    names = ["clipping_norm", "noise_multiplier", "expected_batch_size", "microbatch_size", "key", "loss_fn",
             "batch", "params", "optimizer"]  # fmt: skip
    for name in gen.choice(names, size=int(gen.integers(1, 4)), replace=False):
        if name == "batch":
            kw[name] = str(gen.choice(["list", "mismatched", "strings", "0-d", "good"]))
        elif name == "params":
            kw[name] = str(gen.choice(["int leaf", "None", "empty", "good"]))
        elif name == "optimizer":
            kw[name] = str(gen.choice(["None", "object", "string", "sgd"]))
        elif name == "loss_fn":
            kw[name] = str(gen.choice(["None", "number", "good"]))
        else:
            kw[str(name)] = BAD[int(gen.integers(len(BAD)))]
    kw["loss_fn"] = {"None": None, "number": 3, "good": lambda p, x, y: ((p["w"] * x).sum() - y) ** 2}[kw["loss_fn"]]
    if gen.random() < 0.3:  # clipped_grad alone
        kw.pop("noise_multiplier"), kw.pop("key"), kw.pop("optimizer")
    return kw


def _core_inputs(kw):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, generator=gen), torch.randn(6, generator=gen)
    batch = {
        "good": (x, y),
        "list": [x, y],
        "mismatched": (x, y[:4]),
        "strings": (x, "abc"),
        "0-d": (torch.tensor(1.0), y),
    }[kw["batch"]]
    params = {"good": {"w": torch.zeros(3)}, "int leaf": {"w": torch.zeros(3, dtype=torch.long)}, "None": None,
              "empty": {}}[kw["params"]]  # fmt: skip
    return params, batch


def _run_core(kw):
    """One step (or one clipped_grad call); returns the new parameters (or the clipped sum)."""
    params, batch = _core_inputs(kw)
    if "noise_multiplier" not in kw:
        fn, state = clipped_grad(
            kw["loss_fn"],
            clipping_norm=kw["clipping_norm"],
            normalize_by=kw["expected_batch_size"],
            microbatch_size=kw["microbatch_size"],
            batch_argnums=(1, 2),
        )
        clipped, _ = fn(params, *batch, state=state)
        return clipped.value
    opt = {"sgd": optim.sgd(0.1), "None": None, "object": object(), "string": "sgd"}[kw["optimizer"]]
    step_fn, dp_state = dp_sgd(
        kw["loss_fn"],
        clipping_norm=kw["clipping_norm"],
        noise_multiplier=kw["noise_multiplier"],
        key=kw["key"],
        optimizer=opt,
        expected_batch_size=kw["expected_batch_size"],
        microbatch_size=kw["microbatch_size"],
    )
    new, *_ = step_fn(params, optim.sgd(0.1).init(params) if kw["optimizer"] == "sgd" else None, dp_state, batch)
    return new


def _run_core_cases(gen, outcomes):
    for case in range(CORE_CASES):
        kw = _core_case(gen)
        valid = core_is_valid({**kw, "optimizer": kw.get("optimizer", "sgd")})
        shown = {k: (v if not callable(v) else "loss") for k, v in kw.items()}
        label = f"core case {case} ({shown!r:.300}; valid={valid})"
        try:
            out = _run_core(kw)
        except OpakeError as exc:
            assert not valid, f"refused a valid case: {type(exc).__name__}: {exc} -- {label}"
            outcomes["refused"] += 1
            continue
        except Exception as exc:
            pytest.fail(f"raw {type(exc).__name__}: {exc} -- {label}")
        assert valid, f"silently accepted -- {label}"
        assert all(torch.isfinite(v).all() for v in out.values()), label
        outcomes["accepted"] += 1


def test_bad_data_models_and_core_arguments_fail_clearly_before_the_first_step(tmp_path, caplog):
    began = time.perf_counter()
    gen = np.random.default_rng(2032)
    outcomes = {"refused": 0, "accepted": 0}
    with caplog.at_level(logging.ERROR):
        _run_data_cases(tmp_path, gen, outcomes)
        _run_model_cases(tmp_path, gen, outcomes)
        _run_core_cases(gen, outcomes)
    assert sum(outcomes.values()) == DATA_CASES + MODEL_CASES + CORE_CASES == 400
    assert outcomes["refused"] > 200 and outcomes["accepted"] > 40, outcomes  # the generator makes both kinds
    print(f"fuzz: {outcomes} in {time.perf_counter() - began:.1f} s")
