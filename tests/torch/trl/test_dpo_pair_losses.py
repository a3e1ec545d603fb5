"""The per-pair DPO losses and options of dpo_losses (SimPO, CPO, ORPO, chosen NLL, MPO weights, WPO, LD-DPO,
f-DPO): each against a direct float64 computation from the papers' formulas (TRL's code for the names), from the
formula inputs and, through the trainer, from the model's own logits; and each pair's loss reads that pair only."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny_hf import tiny_model
from trl_support import preference_rows, tiny_tokenizer

from opake_core.errors import ConfigurationError
from opake_torch.transformers.trl import DPOConfig, DPOTrainer
from opake_torch.transformers.trl.dpo_losses import PairLogps, PairOptions, pair_loss

BASE = {"privacy_noise_multiplier": 0.0, "clipping_norm": math.inf, "use_cpu": True, "disable_tqdm": True,
        "report_to": "none", "save_strategy": "no", "max_steps": 1, "per_device_train_batch_size": 4}  # fmt: skip


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _log1mexp(x: float) -> float:
    return math.log(-math.expm1(x))


def _f(x: float, kind: str, a: float) -> float:
    if kind == "forward_kl":
        return 1 - math.exp(-x)
    if kind == "js_divergence":
        return math.log(2) + _logsig(x)
    if kind == "alpha_divergence":
        return (math.exp((a - 1) * x) - 1) / (a - 1)
    return x


def reference_loss(q: dict, o: dict) -> float:
    """One pair's loss from the papers, in Python floats. ``q``: Lw, Ll, Rw, Rl, nw, nl, Aw, Al, weight."""
    beta, e = o["beta"], o.get("label_smoothing", 0.0)
    total = 0.0
    for name, w in zip(o["loss_types"], o["loss_weights"], strict=True):
        if name == "chosen_nll":
            value = -q["Aw"]
        elif name == "simpo":
            z = beta * (q["Aw"] - q["Al"]) - o["simpo_gamma"]
            value = -(1 - e) * _logsig(z) - e * _logsig(-z)
        elif name == "cpo":
            z = beta * (q["Lw"] - q["Ll"])
            value = -(1 - e) * _logsig(z) - e * _logsig(-z) - o["cpo_alpha"] * q["Aw"]
        elif name == "orpo":
            odds = (q["Aw"] - q["Al"]) - (_log1mexp(q["Aw"]) - _log1mexp(q["Al"]))
            value = -q["Aw"] - o["orpo_lambda"] * _logsig(odds)
        else:
            kind, a = o.get("f_divergence_type", "reverse_kl"), o.get("f_alpha_divergence_coef", 0.5)
            c, r = _f(q["Lw"] - q["Rw"], kind, a), _f(q["Ll"] - q["Rl"], kind, a)
            if name == "sigmoid":
                value = -_logsig(beta * (c - r))
            elif name == "ipo":
                value = (c / q["nw"] - r / q["nl"] - 1 / (2 * beta)) ** 2
            elif name == "hinge":
                value = max(0.0, 1 - beta * (c - r))
            else:
                raise AssertionError(name)
        total += w * value
    return total * q.get("weight", 1.0)


def _pair(q: dict) -> PairLogps:
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return PairLogps(t(q["Lw"]), t(q["Ll"]), t(q["Rw"]), t(q["Rl"]), t(q["nw"]), t(q["nl"]), t(q["Aw"]), t(q["Al"]),
                     None if "weight" not in q else t(q["weight"]))  # fmt: skip


OPTIONS = {
    "chosen_nll": {"loss_types": ("chosen_nll",)},
    "simpo": {"loss_types": ("simpo",), "simpo_gamma": 0.7, "label_smoothing": 0.1},
    "cpo": {"loss_types": ("cpo",), "cpo_alpha": 0.3, "label_smoothing": 0.05},
    "orpo": {"loss_types": ("orpo",), "orpo_lambda": 0.4},
    "rpo_mpo": {"loss_types": ("sigmoid", "chosen_nll"), "loss_weights": (1.0, 0.25)},
    "mpo_three": {"loss_types": ("ipo", "simpo", "hinge"), "loss_weights": (0.5, 2.0, 1.0)},
    "forward_kl": {"loss_types": ("sigmoid",), "f_divergence_type": "forward_kl"},
    "js": {"loss_types": ("ipo",), "f_divergence_type": "js_divergence"},
    "alpha": {
        "loss_types": ("sigmoid", "hinge"),
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.3,
    },
}


def _options(spec: dict, beta: float) -> dict:
    o = {"simpo_gamma": 0.5, "cpo_alpha": 1.0, "orpo_lambda": 1.0, "beta": beta, **spec}
    o.setdefault("loss_weights", (1.0,) * len(o["loss_types"]))
    return o


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_pair_loss_equals_the_formula_in_float64(name, beta):
    o = _options(OPTIONS[name], beta)
    options = PairOptions(**o)
    rng = random.Random(f"{name}-{beta}")
    for _ in range(32):
        nw, nl = rng.randint(1, 12), rng.randint(1, 12)
        q = {"Lw": rng.uniform(-30, -0.5), "Ll": rng.uniform(-30, -0.5), "Rw": rng.uniform(-30, -0.5),
             "Rl": rng.uniform(-30, -0.5), "nw": float(nw), "nl": float(nl)}  # fmt: skip
        q["Aw"], q["Al"] = q["Lw"] / nw, q["Ll"] / nl
        if rng.random() < 0.5:
            q["weight"] = rng.uniform(0.0, 1.0)  # WPO's product of the two completions' weights
        ours = pair_loss(_pair(q), options)
        assert ours.dtype == torch.float64
        assert float(ours) == pytest.approx(reference_loss(q, o), rel=1e-12, abs=1e-12), q


# -- through the trainer: the model's logits, float64 formulas written out token by token ---------------------------


def _trainer(tmp_path, data, **kwargs):
    return DPOTrainer(tiny_model("llama"), _perturbed_reference(), DPOConfig(str(tmp_path), **{**BASE, **kwargs}),
                      train_dataset=data, processing_class=tiny_tokenizer())  # fmt: skip


def _perturbed_reference():
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _side_quantities(logits, ids, completion, shared: int | None, ld_alpha: float | None):
    """Float64 per-token loop: summed log-probability over the completion tokens (LD-weighted past ``shared``), the
    plain sum, the scored-token count and WPO's mean aligned log-probability."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    summed = plain = aligned = 0.0
    k = 0
    for t in range(1, len(ids)):
        if not completion[t]:
            continue
        k += 1
        lp = float(logp[t - 1, ids[t]])
        plain += lp
        summed += lp * (1.0 if ld_alpha is None or k <= shared else ld_alpha)
        aligned += lp - float(torch.logsumexp(2 * logp[t - 1], dim=-1))
    return summed, plain, k, aligned / k


def _expected(trainer, example, o) -> float:
    ld = o.get("ld_alpha")
    params = trainer._params
    q, counts = {}, {}
    for side in ("chosen", "rejected"):
        counts[side] = int(example[f"{side}_completion_mask"][1:].sum())
    shared = min(counts.values())
    for side, tag in (("chosen", "w"), ("rejected", "l")):
        ids, completion = example[f"{side}_input_ids"], example[f"{side}_completion_mask"]
        inputs = {"input_ids": ids[None], "attention_mask": example[f"{side}_attention_mask"][None]}
        with torch.no_grad():
            logits = trainer.apply_model(params, **inputs).logits[0]
            ref_logits = trainer._reference_logits(params, **inputs)[0]
        summed, plain, k, aligned = _side_quantities(logits, ids.tolist(), completion.tolist(), shared, ld)
        ref_summed, *_ = _side_quantities(ref_logits, ids.tolist(), completion.tolist(), shared, ld)
        q[f"L{tag}"], q[f"R{tag}"], q[f"A{tag}"] = summed, ref_summed, plain / k
        q[f"n{tag}"] = float(completion.sum())
        q[f"wpo_{tag}"] = math.exp(aligned)
    if o.get("use_weighting"):
        q["weight"] = q["wpo_w"] * q["wpo_l"]
    return reference_loss(q, o)


TRAINER_CASES = {
    "simpo": {"loss_type": "simpo", "simpo_gamma": 0.3},
    "cpo": {"loss_type": "cpo", "cpo_alpha": 0.5},
    "orpo": {"loss_type": "orpo", "orpo_lambda": 0.2},
    "chosen_nll": {"loss_type": "chosen_nll"},
    "rpo": {"loss_type": ["sigmoid", "chosen_nll"], "loss_weights": [1.0, 0.5]},
    "wpo": {"loss_type": "sigmoid", "use_weighting": True},
    "ld_dpo": {"loss_type": "ipo", "ld_alpha": 0.25},
    "f_dpo": {"loss_type": "sigmoid", "f_divergence_type": "js_divergence"},
}


def _as_options(kwargs: dict, beta: float) -> dict:
    types = kwargs["loss_type"]
    types = (types,) if isinstance(types, str) else tuple(types)
    spec = {k: v for k, v in kwargs.items() if k not in ("loss_type", "loss_weights")}
    return _options({"loss_types": types, "loss_weights": tuple(kwargs.get("loss_weights", (1.0,) * len(types))),
                     **spec}, beta)  # fmt: skip


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_trainer_loss_equals_the_formula_from_the_models_logits(tmp_path, case):
    kwargs = TRAINER_CASES[case]
    rows = preference_rows(3, seed=4)
    rows[0]["chosen"] = " the big cat sat on the mat"  # lengths differ: LD-DPO's shared length is the shorter one
    trainer = _trainer(tmp_path, rows, beta=0.5, **kwargs)
    for example in trainer.train_dataset:
        got = float(trainer.compute_per_example_loss(trainer._params, example))
        assert got == pytest.approx(_expected(trainer, example, _as_options(kwargs, 0.5)), rel=2e-5, abs=1e-5)


def _per_example(trainer, rows):
    batch = trainer.fetch_batch(trainer.train_dataset, rows)
    fn = torch.func.vmap(torch.func.grad_and_value(trainer.compute_per_example_loss), in_dims=(None, 0))
    return fn(trainer._params, batch)


@pytest.mark.parametrize("case", TRAINER_CASES)
def test_neighbour_changes_only_its_own_contribution(tmp_path, case):
    data = preference_rows(4)
    changed = [*data[:2], {"prompt": "big dog", "chosen": " ran on the mat", "rejected": " no"}, data[3]]
    (ga, la), (gb, lb) = (_per_example(_trainer(tmp_path, d, beta=2.0, **TRAINER_CASES[case]), [0, 1, 2, 3])
                          for d in (data, changed))  # fmt: skip
    keep = [0, 1, 3]
    torch.testing.assert_close(la[keep], lb[keep], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(la[2], lb[2])
    for name in ga:
        torch.testing.assert_close(ga[name][keep], gb[name][keep], atol=1e-6, rtol=1e-6)


def test_precomputed_reference_with_ld_alpha_equals_on_the_fly(tmp_path):
    data = preference_rows(4, seed=2)
    (g1, l1), (g2, l2) = (
        _per_example(_trainer(tmp_path, data, ld_alpha=0.5, **extra), [0, 1, 2, 3])
        for extra in ({}, {"precompute_ref_log_probs": True, "precompute_ref_batch_size": 3})
    )
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-5, rtol=1e-5)


# -- configuration --------------------------------------------------------------------------------------------------


def test_mpo_lists_and_their_weights():
    assert DPOConfig(**BASE, loss_type=["sigmoid", "chosen_nll"]).loss_type == ("sigmoid", "chosen_nll")
    assert DPOConfig(**BASE, loss_type="sigmoid, chosen_nll").loss_type == ("sigmoid", "chosen_nll")
    assert DPOConfig(**BASE, loss_type=["simpo"]).loss_type == "simpo"
    with pytest.raises(ConfigurationError, match="one weight per loss_type"):
        DPOConfig(**BASE, loss_type=["sigmoid", "chosen_nll"], loss_weights=[1.0])
    with pytest.raises(ConfigurationError, match="name each loss once"):
        DPOConfig(**BASE, loss_type=["sigmoid", "sigmoid"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "sft"}, "use loss_type='chosen_nll'"),
        ({"loss_type": ["sigmoid", "aot"]}, "sorts log-ratios across the batch"),
        ({"loss_type": "simpo", "f_divergence_type": "forward_kl"}, r"not of \['simpo'\]"),
        ({"f_divergence_type": "kl"}, "f_divergence_type must be one of"),
        ({"ld_alpha": 1.5}, "ld_alpha"),
        ({"simpo_gamma": -1.0}, "simpo_gamma"),
    ],
)
def test_refusals(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        DPOConfig(**BASE, **kwargs)
