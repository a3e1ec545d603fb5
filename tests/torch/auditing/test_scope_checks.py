"""The scope checks of the audits against planted bugs the canary audit never sees.

Planted bugs (each changes one piece of a step, the claim stays the library's):

- no noise on the biases: the noise mechanism adds its noise and then puts the clipped values back on every bias;
- noise x 1/1.5 on the biases: the same, with two thirds of the noise left on the biases;
- DP-FTRL noise whose streamed buffers are reset at every step, and noise drawn for another per-group allocation;
- an accountant that counts half the steps: the trainer's ledger records every other step;
- an accountant that records twice the multiplier the noise was drawn with.

False alarms: every noise check runs at its default false-alarm rate 1e-3 (Bonferroni over the leaves), and the rate
test of the accounting check at 1e-3, so a correct run is flagged with probability at most 1e-3; "at least 9 of 10
correct runs pass" then fails with probability below 5e-5. The seeds are fixed, so the outcomes are reproducible.
"""

from __future__ import annotations

import dataclasses

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from tiny_hf import tiny_model, token_data

from opake_core import accounting, mf, random
from opake_core.accounting.ledger import Ledger
from opake_core.errors import ConfigurationError
from opake_core.mf import mf_gaussian_noise
from opake_core.noise import gaussian_noise
from opake_core.step import dp_step
from opake_core.tree import Noised, per_group
from opake_torch.auditing import audit_trainer_accounting, audit_trainer_noise, check_noise_scale
from opake_torch.transformers import DPTrainer, TrainingArguments

D, H, K, B = 16, 32, 10, 8.0
SEEDS = range(10)


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(D, H, generator=g) / D**0.5,
        "b1": torch.zeros(H),
        "w2": torch.randn(H, K, generator=g) / H**0.5,
        "b2": torch.zeros(K),
    }


def _loss(p, x, y):
    return F.cross_entropy((torch.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])[None], y[None])


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(8, D, generator=g), torch.randint(0, K, (8,), generator=g)


def _is_bias(name):
    return name in ("b1", "b2") or name.endswith("bias")


def _bias_noise(noise, keep):
    """``noise`` with only the fraction ``keep`` of its noise left on the biases (0: none)."""
    noise_fn, state = noise

    def fn(clipped, s):
        noised, s = noise_fn(clipped, s)
        value = {
            k: clipped.value[k].to(v.dtype) + keep * (v - clipped.value[k].to(v.dtype)) if _is_bias(k) else v
            for k, v in noised.value.items()
        }
        return Noised(value, noised.sensitivity, noised.noise_std), s

    return fn, state


def _without_memory(noise):
    """A streamed matrix mechanism whose buffers are reset to their initial zeros before every step."""
    noise_fn, state = noise
    zeros = state.buffers
    return (lambda clipped, s: noise_fn(clipped, dataclasses.replace(s, buffers=zeros))), state


def _dp_sgd_with_bias_noise(keep):
    def mechanism(loss_fn, *, clipping_norm, noise_multiplier, key, compute_dtype=torch.float32, **options):
        noise = _bias_noise(
            gaussian_noise(noise_multiplier=noise_multiplier, key=key, compute_dtype=compute_dtype), keep
        )
        return dp_step(loss_fn, clipping=clipping_norm, noise=noise, **options)

    return mechanism


def _core_check(seed, keep=None):
    claim = {"noise_multiplier": 1.3, "clipping_norm": 1.0, "expected_batch_size": B}
    mechanism = None
    if keep is not None:
        step = _dp_sgd_with_bias_noise(keep)
        mechanism = lambda loss_fn, **o: step(  # noqa: E731
            loss_fn, clipping_norm=claim["clipping_norm"], noise_multiplier=claim["noise_multiplier"], **o
        )
    return check_noise_scale(_loss, _params(), _batch(), key=random.key(seed), mechanism=mechanism, **claim)


# -- the core step -----------------------------------------------------------------------------------------------------


def test_core_dp_sgd_noise_passes_a_correct_step_on_every_leaf():
    reports = [_core_check(seed) for seed in SEEDS]
    assert sum(not r.flagged for r in reports) >= 9, [r.flagged_leaves for r in reports]
    first = reports[0]
    assert {leaf.name for leaf in first.leaves} == {"w1", "b1", "w2", "b2"}
    assert not first.underpowered and all(0.8 < leaf.std_ratio < 1.2 for leaf in first.leaves)


def test_core_flags_no_noise_on_the_biases():
    reports = [_core_check(seed, keep=0.0) for seed in SEEDS]
    assert sum(set(r.flagged_leaves) == {"b1", "b2"} for r in reports) >= 9
    assert all(leaf.std_ratio == 0.0 for leaf in reports[0].leaves if leaf.name.startswith("b"))


def test_core_flags_two_thirds_of_the_noise_on_the_biases():
    """The detectable error of the default check (scale_error 1/3) on leaves powered for it."""
    reports = [_core_check(seed, keep=2 / 3) for seed in SEEDS]
    assert all(not r.underpowered for r in reports)
    assert sum(r.flagged and set(r.flagged_leaves) <= {"b1", "b2"} for r in reports) >= 9


def test_core_per_group_claim():
    bound = per_group(_params(), {"^b": 0.5}, fallback=2.0)
    claim = {"noise_multiplier": 1.3, "clipping_norm": bound, "expected_batch_size": B}
    correct = [check_noise_scale(_loss, _params(), _batch(), key=random.key(s), **claim) for s in SEEDS]
    assert sum(not r.flagged for r in correct) >= 9
    # noise drawn for one bound of 2.0 everywhere: 2.0 / sqrt(0.5 * 2.5) = 1.79 times the biases' claimed std, and
    # 2.0 / sqrt(2.0 * 2.5) = 0.89 times the weights' (the allocation of noise_std_for)
    scalar = check_noise_scale(
        _loss,
        _params(),
        _batch(),
        key=random.key(0),
        mechanism=lambda loss_fn, **o: dp_step(
            loss_fn, clipping=2.0, noise=gaussian_noise(noise_multiplier=1.3, key=o.pop("key")), **o
        ),
        **claim,
    )
    ratio = {leaf.name: leaf.std_ratio for leaf in scalar.leaves}
    assert scalar.flagged and ratio["b1"] == pytest.approx(2.0 / 1.25**0.5, rel=0.15)
    assert ratio["w1"] == pytest.approx(2.0 / 5**0.5, rel=0.05)


def test_core_dp_ftrl_noise_is_whitened_and_checked():
    n_steps = 16
    strategy = mf.optimize(mf.band_mf(bands=3), n_steps)
    claim = {"noise_multiplier": 1.3, "clipping_norm": 1.0, "expected_batch_size": B, "strategy": strategy}
    reports = [
        check_noise_scale(_loss, _params(), _batch(), key=random.key(s), n_steps=n_steps, **claim) for s in SEEDS
    ]
    assert sum(not r.flagged for r in reports) >= 9, [r.flagged_leaves for r in reports]
    planted = [
        check_noise_scale(
            _loss,
            _params(),
            _batch(),
            key=random.key(s),
            n_steps=n_steps,
            mechanism=lambda loss_fn, *, key, **o: dp_step(
                loss_fn,
                clipping=1.0,
                noise=_bias_noise(
                    mf_gaussian_noise(_params(), strategy, n_steps=n_steps, noise_multiplier=1.3, key=key), 0.0
                ),
                **o,
            ),
            **claim,
        )
        for s in SEEDS
    ]
    assert sum(set(r.flagged_leaves) == {"b1", "b2"} for r in planted) >= 9
    # the streamed buffers reset at every step: each step's noise is its first term alone, uncorrelated
    reset = [
        check_noise_scale(
            _loss,
            _params(),
            _batch(),
            key=random.key(s),
            n_steps=n_steps,
            mechanism=lambda loss_fn, *, key, **o: dp_step(
                loss_fn,
                clipping=1.0,
                noise=_without_memory(
                    mf_gaussian_noise(_params(), strategy, n_steps=n_steps, noise_multiplier=1.3, key=key)
                ),
                **o,
            ),
            **claim,
        )
        for s in SEEDS
    ]
    assert sum({"w1", "w2"} <= set(r.flagged_leaves) for r in reset) >= 9


def test_core_check_refuses_what_it_cannot_claim():
    with pytest.raises(ConfigurationError, match="noise multiplier > 0"):
        check_noise_scale(
            _loss,
            _params(),
            _batch(),
            key=random.key(0),
            noise_multiplier=0.0,
            clipping_norm=1.0,
            expected_batch_size=B,
        )
    with pytest.raises(ConfigurationError, match="n_steps"):
        check_noise_scale(
            _loss,
            _params(),
            _batch(),
            key=random.key(0),
            noise_multiplier=1.0,
            clipping_norm=1.0,
            expected_batch_size=B,
            strategy=mf.band_mf(bands=2),
        )


# -- DPTrainer ---------------------------------------------------------------------------------------------------------


def _args(tmp_path, seed, **kwargs):
    return TrainingArguments(
        str(tmp_path / "out"),
        per_device_train_batch_size=8,
        privacy_noise_multiplier=1.0,
        privacy_noise_seed=seed,
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        **kwargs,
    )


DATA = token_data(24, classes=3)


def test_trainer_noise_check_passes_correct_runs_and_flags_no_noise_on_the_biases(tmp_path, monkeypatch):
    """Four steps: every leaf is tested (the classifier's bias on 12 values); a missing noise gives S = 0."""
    correct = [audit_trainer_noise(tiny_model("bert"), _args(tmp_path, s), DATA, steps=4) for s in SEEDS]
    assert sum(not r.flagged for r in correct) >= 9, [r.flagged_leaves for r in correct]
    biases = {leaf.name for leaf in correct[0].leaves if leaf.name.endswith("bias")}
    assert "classifier.bias" in biases and len(correct[0].leaves) == 25
    monkeypatch.setattr("opake_torch.transformers.engines.dp_sgd", _dp_sgd_with_bias_noise(0.0))
    planted = [audit_trainer_noise(tiny_model("bert"), _args(tmp_path, s), DATA, steps=4) for s in SEEDS]
    assert sum(set(r.flagged_leaves) == biases for r in planted) >= 9


def test_trainer_noise_check_at_full_power(tmp_path, monkeypatch):
    report = audit_trainer_noise(tiny_model("bert"), _args(tmp_path, 0), DATA)
    assert not report.underpowered and not report.flagged, report.flagged_leaves
    monkeypatch.setattr("opake_torch.transformers.engines.dp_sgd", _dp_sgd_with_bias_noise(2 / 3))
    planted = audit_trainer_noise(tiny_model("bert"), _args(tmp_path, 0), DATA)
    assert planted.flagged and all(name.endswith("bias") for name in planted.flagged_leaves)


def _half_ledger(monkeypatch):
    """The trainer's ledger records every other step."""
    record, calls = Ledger.record, []

    def every_other(self, process, count=1):
        calls.append(process)
        return self if len(calls) % 2 == 0 else record(self, process, count)

    monkeypatch.setattr(Ledger, "record", every_other)


def _pld_epsilon(steps, q, z, delta):
    """dp-accounting directly: ``steps`` Poisson-subsampled Gaussian steps."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
    )
    return dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta)


def test_trainer_accounting_matches_dp_accounting_and_flags_half_the_steps(tmp_path, monkeypatch):
    def audit(seed):
        trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, seed, max_steps=6, optim="sgd"), train_dataset=DATA)
        return audit_trainer_accounting(trainer, key=random.key(seed))

    correct = [audit(s) for s in SEEDS]
    assert sum(not r.flagged for r in correct) >= 9, [r.reasons for r in correct]
    direct = _pld_epsilon(6, 8 / 24, 1.0, correct[0].delta)
    assert correct[0].steps == 6 and correct[0].claimed_epsilon == pytest.approx(direct, rel=1e-9)
    _half_ledger(monkeypatch)
    planted = [audit(s) for s in SEEDS]
    assert all(r.flagged and r.claimed_steps == 3 and r.steps == 6 for r in planted)
    assert planted[0].claimed_epsilon < planted[0].observed_epsilon == pytest.approx(direct, rel=1e-9)


def test_trainer_checks_refuse_what_they_do_not_cover(tmp_path):
    mf_band = {"privacy_noise_mechanism": "mf_band", "privacy_noise_mechanism_kwargs": {"bands": 2}}
    args = _args(tmp_path, 0, max_steps=4, **mf_band)
    with pytest.raises(ConfigurationError, match="DP-FTRL"):
        audit_trainer_noise(tiny_model("bert"), args, DATA)
    with pytest.raises(ConfigurationError, match="float32 or float64"):
        audit_trainer_noise(tiny_model("bert").to(torch.bfloat16), _args(tmp_path, 0), DATA)
    with pytest.raises(ConfigurationError, match="whole-horizon"):
        audit_trainer_accounting(DPTrainer(tiny_model("bert"), args, train_dataset=DATA), key=random.key(0))
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, 0, max_steps=2), train_dataset=DATA)
    trainer.train()
    with pytest.raises(ConfigurationError, match="fresh trainer"):
        audit_trainer_accounting(trainer, key=random.key(0))


def test_trainer_noise_is_tested_at_the_accountants_multiplier(tmp_path, monkeypatch):
    """An accountant that records twice the multiplier the noise was drawn with: every leaf's noise is half the
    claim (std ratio 0.5), flagged wherever a leaf has enough values."""
    record = Ledger.record

    def doubled(self, process, count=1):
        inner = accounting.gaussian(2 * process.inner.noise_multiplier)
        return record(self, accounting.poisson(inner, process.sample_rate), count)

    monkeypatch.setattr(Ledger, "record", doubled)
    report = audit_trainer_noise(tiny_model("bert"), _args(tmp_path, 0), DATA, steps=4)
    assert report.flagged and all(0.4 < leaf.std_ratio < 0.6 for leaf in report.leaves)
    assert set(report.flagged_leaves) >= {leaf.name for leaf in report.leaves if leaf.coordinates >= 400}
