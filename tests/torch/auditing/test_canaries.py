"""Dirac gradient canaries and input-space canaries around real training runs (opake_torch.auditing).

Statistical assertions state the probability that a correct implementation fails them (at most 1e-3 each, or the
audit's own false-alarm rate where a run is audited once); the seeds are fixed, so the outcome is reproducible.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from tiny_hf import tiny_model, token_data
from torch.func import grad, vmap

from opake_core import accounting, mf, random
from opake_core.clipping import VMAP, Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_core.step import dp_sgd
from opake_core.tree import per_group
from opake_torch.auditing import (
    CANARY_LEAF,
    DiracGradients,
    audit_core_run,
    audit_dirac_run,
    audit_trainer_dirac,
    canary_rows,
    dirac_canaries,
    make_canaries,
    with_canary_block,
    with_dirac_canaries,
)
from opake_torch.auditing.canaries import EMPTY_SLOT
from opake_torch.transformers import DPTrainer, TrainingArguments

D, H, K = 8, 16, 4
DELTA = 1e-5


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(D, H, generator=g) / D**0.5, "w2": torch.randn(H, K, generator=g) / H**0.5}


def _loss(p, x, y):
    return F.cross_entropy((torch.relu(x @ p["w1"]) @ p["w2"])[None], y[None])


def _data(n=200):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)


def _multiplier(epsilon, q, steps):
    return accounting.calibrate_noise_multiplier(
        lambda z: accounting.repeat(accounting.poisson(accounting.gaussian(z), q), steps),
        target_epsilon=epsilon,
        delta=DELTA,
    ).value


def _dp_sgd_with(*, noise_multiplier: float):
    """A mechanism for ``audit_dirac_run(mechanism=...)``: DP-SGD (clipping norm 1) with this noise multiplier,
    whatever the audit claims (a planted leak)."""

    def mechanism(loss, *, optimizer, expected_batch_size, key, engine):
        return dp_sgd(
            loss,
            clipping_norm=1.0,
            noise_multiplier=noise_multiplier,
            key=key,
            optimizer=optimizer,
            expected_batch_size=expected_batch_size,
            engine=engine,
        )

    return mechanism


def _audit(canaries, **kwargs):
    """``audit_dirac_run`` of the test model on its data, clipping norm 1."""
    return audit_dirac_run(_loss, _params(), _data(), canaries, clipping_norm=1.0, **kwargs)


def test_dirac_canary_gradients_are_scaled_coordinate_vectors():
    canaries = dirac_canaries(key=random.key(1), num_canaries=6, gradient_norm=3.0)
    x, y, slots = canary_rows(_data(5), canaries)
    params = with_canary_block(_params(), canaries)
    grads = vmap(grad(with_dirac_canaries(_loss, canaries)), in_dims=(None, 0, 0, 0))(params, x, y, slots)
    real = vmap(grad(_loss), in_dims=(None, 0, 0))(_params(), x[:5], y[:5])
    for name in ("w1", "w2"):
        torch.testing.assert_close(grads[name][:5], real[name])
        assert torch.count_nonzero(grads[name][5:]) == 0  # canary slots never touch the real parameters
    assert torch.count_nonzero(grads[CANARY_LEAF][:5]) == 0  # real rows never touch the canary block
    for j, included in enumerate(canaries.included):
        expected = torch.zeros(6)
        if included:
            expected[j] = 3.0
        torch.testing.assert_close(grads[CANARY_LEAF][5 + j], expected)
    assert list(canaries.slots) == [j if inc else EMPTY_SLOT for j, inc in enumerate(canaries.included)]


@pytest.mark.parametrize("rule", ["fixed", "per_group"])
def test_dirac_gradients_release_the_clipped_sum_of_vmap(rule):
    """The audit's engine (the canary block written down, the real leaves by vmap of the real rows' loss) releases
    the clipped sum, norms and losses of the default engine on the canary loss: the canary block bit for bit, the
    real leaves to float rounding; with a clipping bound that binds, per-group bounds, a real row whose loss is not
    finite (it adds nothing) and every kind of row (real, included, excluded) in one batch."""
    canaries = dirac_canaries(key=random.key(3), num_canaries=12, gradient_norm=7.0)
    x, y, slots = canary_rows(_data(9), canaries)
    x[2] = math.inf  # a real row with a non-finite gradient
    params = with_canary_block(_params(), canaries)
    loss = with_dirac_canaries(_loss, canaries)
    bound = 0.5 if rule == "fixed" else per_group(params, {CANARY_LEAF: 2.0}, fallback=0.5)
    out = []
    for engine in (VMAP, Engine(gradients=DiracGradients(_loss, canaries))):
        grad_fn, state = clipped_grad(
            loss, clipping_norm=bound, batch_argnums=(1, 2, 3), engine=engine, return_diagnostics=True
        )
        out.append(grad_fn(params, x, y, slots, state=state)[0])
    (ref, ref_diag), (ours, diag) = out
    assert torch.equal(ours.value[CANARY_LEAF], ref.value[CANARY_LEAF])
    assert torch.count_nonzero(ours.value[CANARY_LEAF]) == int(canaries.included.sum())
    for name in ("w1", "w2"):
        assert torch.isfinite(ours.value[name]).all()
        torch.testing.assert_close(ours.value[name], ref.value[name], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(diag.norms, ref_diag.norms, equal_nan=True)
    torch.testing.assert_close(diag.losses, ref_diag.losses, equal_nan=True)


def test_noise_free_observations_are_the_participations_at_the_sampling_rate():
    """With the noise switched off in the mechanism (the claim keeps z = 1), every observation is the canary's
    participation: 0 or 1 for an included canary (its clipped gradient), always 0 for an excluded one; the rate of
    ones is q = 0.3 (an exact binomial test, failing with probability 1e-4)."""
    canaries = dirac_canaries(key=random.key(2), num_canaries=200, gradient_norm=10.0)

    noiseless = _dp_sgd_with(noise_multiplier=0.0)

    report = _audit(
        canaries,
        key=random.key(2),
        noise_multiplier=1.0,
        steps=20,
        sample_rate=0.3,
        mechanism=noiseless,
        guess_sets=[(20, 20)],
    )
    x = report.observations
    assert x.shape == (20, 200)
    assert np.all(x[:, ~canaries.included] == 0)
    inside = x[:, canaries.included]
    assert np.all((np.abs(inside) < 1e-6) | (np.abs(inside - 1) < 1e-5))
    ones, total = int(np.sum(inside > 0.5)), inside.size
    assert stats.binomtest(ones, total, 0.3).pvalue > 1e-4


def test_correct_dp_sgd_run_observations_and_audit():
    """A correct DP-SGD run (epsilon 4, q = 0.2, 100 steps, 1,000 canaries): the excluded canaries' observations
    are N(0, z^2) (chi-square test, fails with probability 1e-4), the run is not flagged (probability at most 0.05
    for a correct mechanism) and the all-iterates bound is positive (the audit sees the canaries)."""
    q, steps = 0.2, 100
    z = _multiplier(4.0, q, steps)
    canaries = dirac_canaries(key=random.key(3), num_canaries=1000, gradient_norm=100.0)
    report = _audit(canaries, key=random.key(3), noise_multiplier=z, steps=steps, sample_rate=q, claim_test=True)
    out = report.observations[:, ~canaries.included].ravel()
    chi = float(np.sum(out**2) / z**2)
    assert stats.chi2.sf(chi, out.size) > 5e-5 and stats.chi2.cdf(chi, out.size) > 5e-5
    assert report.theoretical_epsilon == pytest.approx(4.0, rel=1e-3)
    assert not report.flagged and report.claim_rejected is False
    assert 0 < report.epsilon_lower_bound < report.theoretical_epsilon
    assert len(report.guess_sets) == 2 and report.plan == {"steps": steps, "sample_rate": q, "noise_multiplier": z}


def test_halved_noise_is_flagged_with_the_claim_unchanged():
    """The same run with the mechanism's noise halved and the claim kept: flagged. The robust plan flags this leak in
    93 of 100 simulated runs at 200 steps and in 10 of 10 seeds of the docs' benchmark, so a fixed seed that is not
    flagged would point to a broken audit far more often than to chance."""
    q, steps = 0.2, 100
    z = _multiplier(4.0, q, steps)
    canaries = dirac_canaries(key=random.key(4), num_canaries=1000, gradient_norm=100.0)

    leaky = _dp_sgd_with(noise_multiplier=z / 2)

    report = _audit(canaries, key=random.key(4), noise_multiplier=z, steps=steps, sample_rate=q, mechanism=leaky)
    assert report.flagged and report.epsilon_lower_bound > report.theoretical_epsilon


def test_final_model_scores_are_the_summed_observations_under_sgd():
    """Under SGD the final canary coordinate moves by -lr * (C / B) * sum_t x_t: the final-model score is the sum
    of the all-iterates observations (up to float32 rounding)."""
    canaries = dirac_canaries(key=random.key(5), num_canaries=300, gradient_norm=2.0)
    common = dict(key=random.key(5), noise_multiplier=1.5, steps=15, sample_rate=0.25, guess_sets=[(30, 30)])
    every = _audit(canaries, **common)
    final = _audit(canaries, observe="final", **common)
    batch = 0.25 * (200 + 300)
    np.testing.assert_allclose(final.scores, 0.1 * (1.0 / batch) * every.observations.sum(axis=0), rtol=1e-4, atol=1e-6)
    assert final.observations is None and final.score == "sum"


def test_band_mf_audit_decorrelates_the_noise():
    """DP-FTRL (BandMF, 4 bands, cyclic Poisson): after decorrelation with the strategy matrix, the statistics of
    excluded canaries at the steps of their group are N(0, z1^2) (chi-square, fails with probability 1e-4)."""
    steps = 24
    canaries = dirac_canaries(key=random.key(6), num_canaries=400, gradient_norm=5.0)
    z = 1.2
    report = _audit(
        canaries,
        key=random.key(6),
        noise_multiplier=z,
        steps=steps,
        sample_rate=0.05,
        strategy=mf.band_mf(bands=4),
        guess_sets=[(40, 40)],
    )
    from opake_core.auditing import matrix_projections

    concrete = mf.optimize(mf.band_mf(bands=4), steps)
    projections, _ = matrix_projections(report.observations, mf.materialize(concrete, steps))
    z1 = z * mf.sensitivity(concrete, steps) / np.linalg.norm(mf.coefficients(concrete, steps))
    out = projections[:, ~canaries.included].ravel()
    chi = float(np.sum(out**2) / z1**2)
    assert stats.chi2.sf(chi, out.size) > 5e-5 and stats.chi2.cdf(chi, out.size) > 5e-5
    assert math.isfinite(report.theoretical_epsilon) and not report.flagged


def test_input_space_canaries_all_iterates_and_loss_drop():
    canaries = make_canaries(key=random.key(7), num_canaries=100, num_features=D, num_classes=K, scale=3.0)
    common = dict(key=random.key(7), noise_multiplier=1.0, clipping_norm=1.0, steps=8, sample_rate=0.3)
    every = audit_core_run(_loss, _params(), _data(), canaries, score="gradient", observe="all", **common)
    drop = audit_core_run(_loss, _params(), _data(), canaries, score="loss_drop", **common)
    for report in (every, drop):
        assert report.fdp is not None and report.fdp.delta == DELTA
        assert report.scores.shape == (100,) and report.consistent
    with pytest.raises(ConfigurationError, match="score='gradient'"):
        audit_core_run(_loss, _params(), _data(), canaries, score="loss", observe="all", **common)


def test_dp_trainer_dirac_audit_observes_every_privatized_gradient(tmp_path):
    """DPTrainer with SGD: the recovered per-step gradients of excluded canaries are N(0, z^2) (chi-square, fails
    with probability 1e-4), included canaries average q (z-test at 1e-4); not flagged at confidence 0.999."""

    def args(optim):
        return TrainingArguments(
            str(tmp_path / optim),
            per_device_train_batch_size=40,
            max_steps=15,
            privacy_noise_multiplier=2.0,
            use_cpu=True,
            disable_tqdm=True,
            save_strategy="no",
            report_to="none",
            optim=optim,
            learning_rate=0.1,
            clipping_norm=1.0,
        )

    report = audit_trainer_dirac(
        tiny_model("bert"),
        args("sgd"),
        token_data(100, classes=3),
        key=random.key(8),
        num_canaries=300,
        confidence=0.999,
        trainer_class=_Kept,
    )
    assert _Kept.made[-1].per_example_gradients_engine == "layerwise"  # the engine a user's run gets
    x, included = report.observations, report.included
    assert x.shape == (15, 300)
    out = x[:, ~included].ravel()
    chi = float(np.sum(out**2) / 4.0)
    assert stats.chi2.sf(chi, out.size) > 5e-5 and stats.chi2.cdf(chi, out.size) > 5e-5
    inside = x[:, included].ravel()
    q = 40 / 400
    assert abs(inside.mean() - q) < 3.9 * math.sqrt((4.0 + q * (1 - q)) / inside.size)
    assert math.isfinite(report.theoretical_epsilon) and not report.flagged
    final = audit_trainer_dirac(
        tiny_model("bert"),
        args("adamw"),
        token_data(100, classes=3),
        key=random.key(8),
        num_canaries=300,
        observe="final",
    )
    assert final.observations is None and final.scores.shape == (300,)
    with pytest.raises(ConfigurationError, match="optim='sgd'"):
        audit_trainer_dirac(tiny_model("bert"), args("adamw"), token_data(10), key=random.key(8), num_canaries=10)


class _Kept(DPTrainer):
    """DPTrainer that keeps its instances (to read which engine the audited run used)."""

    made: ClassVar[list[DPTrainer]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Kept.made.append(self)


class _OwnExampleLoss(_Kept):
    """A trainer with its own per-example loss and no batched one: the canaries go through that loss (vmap)."""

    def compute_per_example_loss(self, params, example):
        return 2.0 * super().compute_per_example_loss(params, example)


def test_dp_trainer_dirac_audit_with_a_per_example_loss_only(tmp_path):
    """A trainer that overrides only its per-example loss keeps it (and vmap) under the audit: excluded canaries'
    recovered gradients are N(0, z^2) (chi-square, fails with probability 1e-4)."""
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=20, max_steps=6, privacy_noise_multiplier=2.0, use_cpu=True,
        disable_tqdm=True, save_strategy="no", report_to="none", optim="sgd", learning_rate=0.1, clipping_norm=1.0,
    )  # fmt: skip
    report = audit_trainer_dirac(
        tiny_model("bert"), args, token_data(40, classes=3), key=random.key(9), num_canaries=60,
        trainer_class=_OwnExampleLoss, confidence=0.999,
    )  # fmt: skip
    assert _Kept.made[-1].per_example_gradients_engine == "vmap"
    assert report.observations.shape == (6, 60)
    out = report.observations[:, ~report.included].ravel()
    chi = float(np.sum(out**2) / 4.0)
    assert stats.chi2.sf(chi, out.size) > 5e-5 and stats.chi2.cdf(chi, out.size) > 5e-5


def test_bad_canary_settings_are_refused():
    canaries = dirac_canaries(key=random.key(9), num_canaries=10, gradient_norm=0.5)
    common = dict(key=random.key(9), noise_multiplier=1.0, steps=2, sample_rate=0.5)
    with pytest.raises(ConfigurationError, match="at least clipping_norm"):
        audit_dirac_run(_loss, _params(), _data(), canaries, clipping_norm=1.0, **common)
    with pytest.raises(ConfigurationError, match="observe"):
        audit_dirac_run(_loss, _params(), _data(), canaries, clipping_norm=0.5, observe="some", **common)
    with pytest.raises(ConfigurationError, match="observe='final'"):
        audit_dirac_run(_loss, _params(), _data(), canaries, clipping_norm=0.5, observe="final", score="max", **common)
    with pytest.raises(ConfigurationError, match="num_canaries"):
        dirac_canaries(key=random.key(9), num_canaries=1, gradient_norm=1.0)
    with pytest.raises(ConfigurationError, match="already"):
        with_canary_block(with_canary_block(_params(), canaries), canaries)


def test_the_trainer_audit_refuses_parallel_poisson_sampling_before_training(tmp_path, monkeypatch):
    """Under ddp_shard="global" a canary may be in several ranks' draws of a step, which the audit's simulations (one
    Poisson draw per step) do not model: refused before any step runs."""
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=4, max_steps=2, privacy_noise_multiplier=1.0, use_cpu=True,
        disable_tqdm=True, save_strategy="no", report_to="none", optim="sgd", clipping_norm=1.0, ddp_shard="global",
    )  # fmt: skip
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    trained = []
    monkeypatch.setattr(DPTrainer, "train", lambda self, *a, **k: trained.append(self))
    with pytest.raises(ConfigurationError, match="ddp_shard='per_rank'"):
        audit_trainer_dirac(tiny_model("bert"), args, token_data(20, classes=3), key=random.key(3), num_canaries=10)
    assert not trained
