"""``DPTrainer`` with the private MoE router release (``router_aux_loss_coef > 0``), on tiny random Qwen3-MoE and
Mixtral configs: the refusals, epsilon against dp-accounting at ``z / sqrt(1 + ratio)``, the released load estimate
against a float64 loop (noise multiplier 0), exact resumes, and no trace of the un-noised statistic in the logs."""

from __future__ import annotations

import copy
import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting import pld
from tiny_hf import tiny_model, tiny_moe, token_data

from opake_core.errors import ConfigurationError
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers.routers import RouterSetup, capture_router_logits
from opake_torch.transformers.run_state import Run

transformers = pytest.importorskip("transformers")

DATA = token_data(16)
DELTA = len(DATA) ** -1.1
ROUTER = {"router_aux_loss_coef": 0.1, "router_aux_kwargs": {"max_tokens": 6, "mean_tokens": 5.0}}


def _args(path, **kw) -> TrainingArguments:
    base = {
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "optim": "sgd",
        "learning_rate": 0.5,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        **ROUTER,
    }
    return TrainingArguments(str(path), **{**base, **kw})


def _pld_epsilon(z: float, q: float, steps: int) -> float:
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return accountant.get_epsilon(DELTA)


# -- refusals --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"router_aux_kwargs": {"max_tokens": 6, "ratio": 0.0}}, r"router_aux_kwargs\['ratio'\] must be a finite"),
        ({"router_aux_kwargs": {"max_tokens": 6, "ratio": -1}}, r"got -1: the release's noise multiplier"),
        ({"router_aux_kwargs": {"max_tokens": 0}}, r"router_aux_kwargs\['max_tokens'\] must be an integer >= 1"),
        ({"router_aux_kwargs": {"max_tokens": 6.5}}, r"must be an integer >= 1, got 6.5"),
        ({"router_aux_kwargs": {}}, r"router_aux_kwargs needs 'max_tokens'"),
        ({"router_aux_kwargs": {"max_tokens": 6, "filter_beta": 1.0}}, r"\['filter_beta'\] must be in \[0, 1\)"),
        ({"router_aux_kwargs": {"max_tokens": 6, "window": 3}}, r"unsupported keys .*\['window'\]"),
        ({"router_aux_loss_coef": -0.1}, r"router_aux_loss_coef must be in \[0, 1e\+06\] .* got -0.1"),
        ({"router_aux_loss_coef": 0.0}, r"router_aux_kwargs=.* is set but router_aux_loss_coef is 0.0"),
        (
            {"privacy_noise_mechanism": "mf_band", "privacy_noise_mechanism_kwargs": {"bands": 2}},
            r"router release is a DP-SGD release",
        ),
        ({"clipping_mode": "adaptive"}, r"needs fixed scalar clipping .* got 'adaptive'"),
        ({"clipping_mode": "auto"}, r"needs fixed scalar clipping .* got 'auto'"),
        ({"clipping_norm": {"model.*": 1.0, "fallback": 1.0}}, r"got a per-group clipping_norm"),
    ],
)
def test_invalid_router_arguments_are_refused_at_construction(tmp_path, kw, needle):
    with pytest.raises(ConfigurationError, match=needle):
        _args(tmp_path, **kw)


def test_the_release_is_off_by_default_and_parsed_with_its_defaults(tmp_path):
    off = _args(tmp_path, router_aux_loss_coef=None, router_aux_kwargs=None)
    assert not off.router_release and off.router_aux_kwargs == {}
    on = _args(tmp_path, router_aux_kwargs='{"max_tokens": 6}')
    assert on.router_release
    assert on.router_aux_kwargs == {"max_tokens": 6, "ratio": 0.02, "mean_tokens": None, "filter_beta": 0.99}


def test_a_dense_model_and_per_example_metrics_are_refused_at_trainer_construction(tmp_path):
    with pytest.raises(ConfigurationError, match="not a mixture-of-experts model"):
        DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=DATA)

    class WithMetrics(DPTrainer):
        def example_metrics(self):
            raise AssertionError("never built")

    with pytest.raises(ConfigurationError, match=r"example_metrics.*not combined"):
        WithMetrics(tiny_moe("qwen3_moe"), _args(tmp_path), train_dataset=DATA)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_layerwise_engine_trains_the_release_as_vmap_does(tmp_path, model_type):
    """With the release on, 'auto' takes the layerwise engine: its batched loss returns every example's surrogate
    and load statistic from one forward. With the same keys it trains the weights and releases the load estimates
    of vmap(grad), step after step (the estimate of one step steers the routers at the next)."""
    runs = {}
    for engine in ("auto", "vmap"):
        args = _args(tmp_path / engine, max_steps=3, privacy_noise_seed=5, per_example_gradients=engine)
        trainer = DPTrainer(tiny_moe(model_type), args, train_dataset=DATA)
        trainer.train()
        runs[engine] = trainer
    assert runs["auto"].per_example_gradients_engine == "layerwise"
    assert runs["vmap"].per_example_gradients_engine == "vmap"
    layerwise, vmap = (dict(runs[e].model.named_parameters()) for e in ("auto", "vmap"))
    for name, value in vmap.items():
        torch.testing.assert_close(layerwise[name], value, rtol=1e-4, atol=1e-6, msg=name)
    states = [runs[e].router_state for e in ("auto", "vmap")]
    assert states[0].step == states[1].step == 3
    torch.testing.assert_close(states[0].filtered, states[1].filtered, rtol=0, atol=1e-9)


# -- accounting ------------------------------------------------------------------------------------------------------


def test_epsilon_is_dp_accounting_at_the_effective_multiplier_and_the_config_is_restored(tmp_path):
    """Logs, ``accountant.json`` and the model card: a Poisson-sampled Gaussian at ``z / sqrt(1 + rho)``. The model's
    ``output_router_logits=True`` is off during the steps (Hugging Face's batch-level auxiliary loss does not run
    under vmap) and saved as it was."""
    rho, z, steps = 0.5, 1.0, 3
    model = tiny_moe("mixtral")
    model.config.output_router_logits = True
    args = _args(tmp_path, max_steps=steps, router_aux_kwargs={"max_tokens": 6, "ratio": rho})
    trainer = DPTrainer(model, args, train_dataset=DATA)
    output = trainer.train()
    expected = _pld_epsilon(z / math.sqrt(1 + rho), 4 / len(DATA), steps)
    assert output.metrics["privacy_epsilon"] == pytest.approx(expected, rel=1e-6)
    assert expected > _pld_epsilon(z, 4 / len(DATA), steps)
    assert [row["privacy_epsilon"] for row in trainer.state.log_history[:steps]] == pytest.approx(
        [_pld_epsilon(z / math.sqrt(1 + rho), 4 / len(DATA), n) for n in range(1, steps + 1)], rel=1e-6
    )
    assert trainer.model.config.output_router_logits is True
    folder = trainer.save_model(str(tmp_path / "final"))
    record = json.loads((folder / ckpt.ACCOUNTANT).read_text())
    assert record["epsilon"] == pytest.approx(expected, rel=1e-6) and record["noise_multiplier"] == z
    assert json.loads((folder / "config.json").read_text())["output_router_logits"] is True
    assert "MoE router release" in (folder / "README.md").read_text()


def test_a_target_epsilon_calibrates_the_gradient_multiplier_for_the_effective_one(tmp_path):
    rho, target, steps = 0.2, 3.0, 4
    args = _args(
        tmp_path,
        max_steps=steps,
        privacy_noise_multiplier=None,
        privacy_target_epsilon=target,
        router_aux_kwargs={"max_tokens": 6, "ratio": rho},
    )
    trainer = DPTrainer(tiny_moe("qwen3_moe"), args, train_dataset=DATA)
    output = trainer.train()
    z = trainer.state.privacy_resolved_noise_multiplier
    q = 4 / len(DATA)
    assert trainer.state.privacy_calibration_source == "calibrated"
    assert _pld_epsilon(z / math.sqrt(1 + rho), q, steps) <= target * (1 + 1e-6)
    assert _pld_epsilon(0.98 * z / math.sqrt(1 + rho), q, steps) > target
    assert output.metrics["privacy_epsilon"] == pytest.approx(_pld_epsilon(z / math.sqrt(1 + rho), q, steps), rel=1e-6)


# -- the release -----------------------------------------------------------------------------------------------------


def _true_load(model: torch.nn.Module, rows: list[dict], *, k: int, e: int, max_tokens: int, mean: float, batch: float):
    """The filter's estimate after one exact release, by a float64 loop: every example alone (no padding), its top-k
    experts per real token and layer, ``s(x) = w_x (h(x) - k/E)`` summed, divided by the expected batch, pooled over
    layers, centred, plus ``k/E``."""
    total = None
    with torch.no_grad():
        for row in rows:
            ids = row["input_ids"][None]
            real = ids.shape[1]
            with capture_router_logits(model) as captured:
                model(input_ids=ids)
            logits = torch.stack([c.reshape(real, e).double() for c in captured])  # [L, T, E]
            hits = torch.zeros(logits.shape[0], e, dtype=torch.float64)
            for layer in range(logits.shape[0]):
                for t in range(real):
                    for expert in torch.topk(logits[layer, t], k).indices.tolist():
                        hits[layer, expert] += 1.0 / real
            statistic = min(real, max_tokens) / mean * (hits - k / e)
            total = statistic if total is None else total + statistic
    pooled = (total / batch).mean(dim=0)
    return torch.clamp(k / e + pooled - pooled.mean(), 0.0, 1.0)


def test_with_noise_multiplier_0_the_load_estimate_is_the_true_batch_load(tmp_path):
    model = tiny_moe("qwen3_moe", torch.float64)
    initial = copy.deepcopy(model)
    args = _args(  # a fixed batch: the first 8 rows, 7 of length 7 (over max_tokens) and one of 4 (padded)
        tmp_path,
        max_steps=1,
        per_device_train_batch_size=8,
        privacy_noise_multiplier=0.0,
        sampling_mode="sequential",
        router_aux_kwargs={"max_tokens": 6, "mean_tokens": 5.0},
    )
    trainer = DPTrainer(model, args, train_dataset=DATA)
    drawn = []
    batch_of = trainer.fetch_batch
    trainer.fetch_batch = lambda dataset, indices: (drawn.append(list(indices)), batch_of(dataset, indices))[1]
    trainer.train()
    indices = drawn[-1]  # the step's draw (the layerwise engine's check draws two examples first)
    lengths = {len(DATA[i]["input_ids"]) for i in indices}
    assert len(indices) == 8 and max(lengths) > 6 and min(lengths) < max(lengths)  # clipped weights and padding
    expected = _true_load(initial, [DATA[i] for i in indices], k=2, e=4, max_tokens=6, mean=5.0, batch=8.0)
    state = trainer.router_state
    assert state.step == 1
    torch.testing.assert_close(state.load, expected, rtol=0, atol=1e-12)
    assert float((state.load - 0.5).abs().max()) > 0.0  # the release moved the estimate off k/E
    assert state.imbalance == pytest.approx(float((expected - 0.5).abs().max()) / 0.5, rel=1e-9)


# -- checkpoints -----------------------------------------------------------------------------------------------------


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def test_a_resume_continues_bit_exactly_and_may_not_change_the_release(tmp_path):
    args = _args(tmp_path / "a", max_steps=4, save_strategy="steps", save_steps=2)
    full = DPTrainer(tiny_moe("qwen3_moe"), args, train_dataset=DATA)
    full.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    resumed = DPTrainer(tiny_moe("qwen3_moe"), _args(tmp_path / "b", max_steps=4), train_dataset=DATA)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    a, b = _weights(full), _weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(full.router_state.filtered, resumed.router_state.filtered)
    assert (full.router_state.step, full.router_state.noise_var) == (4, resumed.router_state.noise_var)
    assert resumed.router_state.step == 4 and full.router_state.key == resumed.router_state.key
    saved = json.loads((checkpoint / ckpt.DP_STATE).read_text())
    assert saved["router_release"]["ratio"] == 0.02 and saved["router_release"]["max_tokens"] == 6

    for kw, needle in (
        ({"router_aux_loss_coef": 0.0, "router_aux_kwargs": None}, "this run has it off"),
        ({"router_aux_kwargs": {"max_tokens": 6, "mean_tokens": 5.0, "ratio": 0.1}}, "change its settings"),
        ({"router_aux_kwargs": {"max_tokens": 8, "mean_tokens": 5.0}}, "change its settings"),
    ):
        trainer = DPTrainer(tiny_moe("qwen3_moe"), _args(tmp_path / "c", max_steps=4, **kw), train_dataset=DATA)
        with pytest.raises(ConfigurationError, match=needle):
            trainer.train(resume_from_checkpoint=str(checkpoint))

    plain = _args(
        tmp_path / "d",
        max_steps=1,
        save_strategy="steps",
        save_steps=1,
        router_aux_loss_coef=None,
        router_aux_kwargs=None,
    )
    DPTrainer(tiny_moe("qwen3_moe"), plain, train_dataset=DATA).train()
    switched_on = DPTrainer(tiny_moe("qwen3_moe"), _args(tmp_path / "e", max_steps=2), train_dataset=DATA)
    with pytest.raises(ConfigurationError, match="with the router release off"):
        switched_on.train(resume_from_checkpoint=str(tmp_path / "d" / "checkpoint-1"))


# -- the un-noised statistic stays inside the step ---------------------------------------------------------------------


def test_the_unnoised_statistic_reaches_no_log_metric_or_state(tmp_path, monkeypatch):
    sums, released, added = [], [], []
    step = RouterSetup.step

    def recording(self, release_fn, state, statistics, **kw):
        # an empty Poisson draw (probability 0.75^16 per step here) has no statistic: it releases zeros
        sums.append(None if statistics is None else statistics.detach().double().sum(dim=0).clone())
        released.append(step(self, release_fn, state, statistics, **kw))
        return released[-1]

    add = Run.add
    monkeypatch.setattr(RouterSetup, "step", recording)
    monkeypatch.setattr(Run, "add", lambda self, metrics: (added.append(metrics.aux), add(self, metrics))[1])
    args = _args(tmp_path, max_steps=3, save_strategy="steps", save_steps=3)
    trainer = DPTrainer(tiny_moe("qwen3_moe"), args, train_dataset=DATA)
    trainer.train()
    assert len(sums) == 3 and added == [None, None, None]
    rows = trainer.state.log_history
    configured = {  # computed from the arguments alone, before any data is read
        "learning_rate", "privacy_clipping_norm", "privacy_noise_std", "privacy_noise_multiplier", "privacy_epsilon",
        "privacy_delta", "epoch", "step", "nonfinite_loss_steps", "nonfinite_examples",
    }  # fmt: skip
    router_keys = {"router_aux_imbalance", "router_aux_noise_std"}
    step_keys = configured | router_keys | {
        "loss", "privacy_clip_rate",
        "grad_norm",  # the norm of the noised gradient: released, as the weights are
    }  # fmt: skip
    assert all(set(row) == step_keys for row in rows[:3])
    # the router's log values are post-processing of the noised release, exactly
    for row, state in zip(rows[:3], released, strict=True):
        assert row["router_aux_imbalance"] == pytest.approx(state.imbalance, rel=1e-6)
        assert row["router_aux_noise_std"] == pytest.approx(state.filtered_noise_std, rel=1e-6)
    # no other logged number is a coordinate of an un-noised sum. The sums are short rationals (token shares), so
    # they may equal a configured constant, a router value shown above to be released, or the clip rate (a count of
    # clipped examples over m, found before the router statistic exists) by coincidence; those are not compared.
    explained = configured | router_keys | {"privacy_clip_rate", "train_steps", "train_samples"}
    secret = {round(float(v), 12) for total in sums if total is not None for v in total.flatten()} - {0.0}
    logged = {
        round(float(v), 12) for row in rows for k, v in row.items() if isinstance(v, int | float) and k not in explained
    }
    assert logged and not secret & logged
    checkpoint = tmp_path / "checkpoint-3"
    text = (checkpoint / ckpt.DP_STATE).read_text() + (checkpoint / ckpt.TRAINER_STATE).read_text()
    assert "statistic" not in text and "router_state" not in text


def test_the_estimate_of_one_step_steers_the_routers_at_the_next(tmp_path):
    """The surrogate is value-neutral and its gradient vanishes while the estimate is ``k/E`` (the first step), so
    the first step equals a run without the release (noise multiplier 0, the same batches); from the second step the
    estimate of the first moves the routers' gradient, and the runs part."""
    runs = {}
    for steps in (1, 2):
        for release in (True, False):
            router = ROUTER if release else {"router_aux_loss_coef": None, "router_aux_kwargs": None}
            # one seed: both runs draw the same batches
            args = _args(
                tmp_path / f"{steps}{release}", max_steps=steps, privacy_noise_multiplier=0.0,
                sampling_mode="sequential", per_device_train_batch_size=8, privacy_noise_seed=0, **router,
            )  # fmt: skip
            trainer = DPTrainer(tiny_moe("qwen3_moe", torch.float64), args, train_dataset=DATA)
            trainer.train()
            runs[steps, release] = _weights(trainer)
    gates = [name for name in runs[1, True] if name.endswith("mlp.gate.weight")]
    assert gates
    for name, value in runs[1, True].items():
        torch.testing.assert_close(value, runs[1, False][name], rtol=0, atol=1e-12, msg=name)
    assert all(not torch.allclose(runs[2, True][g], runs[2, False][g], rtol=0, atol=1e-9) for g in gates)
