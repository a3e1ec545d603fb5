"""DPTrainer under torchrun (2 Gloo processes) against a single process that sees the union of the ranks' batches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_hf import tiny_model, tiny_moe, token_data

sys.path.insert(0, str(Path(__file__).parent))

from _launch import launch

from opake_core import accounting as acc
from opake_core import sampling
from opake_core.errors import ConfigurationError, StateError
from opake_core.sampling.state import SamplerState
from opake_torch import distributed
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.privacy import build_plan
from opake_torch.transformers.run_state import ledger_result

DATA = token_data(40)
STEPS, PER_DEVICE = 5, 2


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": PER_DEVICE * 2,  # one process, the cluster batch of 2 ranks
        "max_steps": STEPS,
        "privacy_noise_multiplier": 1.0,
        "privacy_accounting": True,
        "use_cpu": True,
        "disable_tqdm": True,
        "learning_rate": 0.05,
        "lr_scheduler": "constant",
        "optim": "sgd",
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 42,  # the ranks' keys, replayed by the single process
    }
    return TrainingArguments(str(tmp_path / "single"), **{**base, **kw})


def _mf(kind):
    if kind == "adaptive":
        return {"clipping_mode": "adaptive"}
    if kind == "fixed":
        return {"sampling_mode": "fixed_size"}
    if kind != "mf":
        return {}
    return {
        "privacy_noise_mechanism": "mf_band",
        "privacy_noise_mechanism_kwargs": {"bands": 2},
        "sampling_mode": "cyclic_poisson",
    }


def _rank_samplers(kind, rate):
    if kind == "mf":
        return [
            sampling.cyclic_poisson(dataset_size=40, sample_rate=rate, bands=2, world_size=2, rank=r) for r in (0, 1)
        ]
    if kind == "fixed":
        return [sampling.fixed_size(dataset_size=40, batch_size=2 * PER_DEVICE, world_size=2, rank=r) for r in (0, 1)]
    return [sampling.poisson(dataset_size=40, sample_rate=rate, world_size=2, rank=r) for r in (0, 1)]


def _single_process(tmp_path, kind):
    """Parameters of a one-process run fed, at every step, the union of the two ranks' draws (same per-rank keys)."""
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, **_mf(kind)), train_dataset=DATA)
    run = trainer._start(None)
    step_fn = run.step
    samplers = _rank_samplers(kind, run.plan.sample_rate)
    states = [s.init() for s in samplers]
    sizes = []
    for _ in range(STEPS):
        parts = []
        for r, sampler in enumerate(samplers):
            idx, states[r] = sampler.sample(run.keys.sampler, states[r])
            parts.append(idx)
        sizes.append([len(p) for p in parts])
        batch = trainer.fetch_batch(DATA, np.sort(np.concatenate(parts)))
        run.params, run.opt_state, run.dp_state, _ = step_fn(run.params, run.opt_state, run.dp_state, (batch,))
        if not run.plan.horizon:
            run.ledger = run.ledger.record(run.plan.release)
    return run.params, ledger_result(run.ledger, run.plan.delta).value, sizes


@pytest.mark.parametrize("kind", ["sgd", "mf", "adaptive", "fixed"])
def test_ddp_trainer_equals_single_process(tmp_path, kind):
    """Adaptive clipping: the clipped counts and batch sizes are summed across ranks before the noisy count, so the
    bound follows the cluster batch exactly as a single process on the union batch. Fixed-size batches: every rank
    takes its half of the same global draw, exactly ``PER_DEVICE`` rows per rank and step."""
    ranks = launch(f"trainer_{kind}", tmp_path / "ddp", DDP_TEST_BATCH=str(PER_DEVICE))
    expected, epsilon, sizes = _single_process(tmp_path, kind)
    for name in expected:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        torch.testing.assert_close(ranks[0]["params"][name], expected[name], rtol=0, atol=1e-6)
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] == epsilon  # cluster-wide rate on every rank
    assert ranks[0]["writes"] == [str(tmp_path / "ddp" / "run" / "checkpoint-5")] and ranks[1]["writes"] == []
    assert sorted(p.name for p in (tmp_path / "ddp" / "run").iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-5"
    ]
    if kind == "sgd":
        assert any(0 in step for step in sizes), sizes  # some rank had an empty local batch and still stepped
    if kind == "fixed":
        assert sizes == [[PER_DEVICE, PER_DEVICE]] * STEPS


def test_ddp_global_shard_is_one_process_on_the_union_with_repeats_accounted_as_a_group(tmp_path):
    """ddp_shard="global": each of the 2 ranks draws the whole dataset at per_device_train_batch_size / N. The
    weights equal those of one process fed, at every step, the two draws concatenated (a record drawn by both ranks
    is in it twice) and normalized by the same expected union batch; the epsilon is that of a group of 2 under
    Poisson sampling at the per-rank rate, computed here from the accounting process directly, and exceeds that of
    the strided shards at the same union batch."""
    per_device = 8  # q_r = 0.2: some record is drawn by both ranks within the 5 steps (checked below)
    ranks = launch("trainer_global", tmp_path / "ddp", DDP_TEST_BATCH=str(per_device))
    single = DPTrainer(
        tiny_model("llama"), _args(tmp_path, per_device_train_batch_size=2 * per_device), train_dataset=DATA
    )
    run = single._start(None)
    assert run.plan.expected_batch_size == 2 * per_device  # the union's normalizer is the single process's
    rate = per_device / len(DATA)
    shards = [
        sampling.poisson(dataset_size=len(DATA), sample_rate=rate, world_size=2, rank=r, sharding="global")
        for r in (0, 1)
    ]
    states, repeats = [s.init() for s in shards], 0
    for _ in range(STEPS):
        parts = []
        for r, shard in enumerate(shards):
            idx, states[r] = shard.sample(run.keys.sampler, states[r])
            parts.append(idx)
        repeats += len(np.intersect1d(*parts))
        batch = single.fetch_batch(DATA, np.sort(np.concatenate(parts)))
        run.params, run.opt_state, run.dp_state, _ = run.step(run.params, run.opt_state, run.dp_state, (batch,))
    assert repeats > 0
    for name, value in run.params.items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=1e-6)
    delta = 1 / len(DATA) ** 1.1
    group = acc.repeat(acc.poisson_group(acc.gaussian(1.0), rate, group_size=2), STEPS)
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] == pytest.approx(acc.epsilon(group, delta=delta).value, rel=1e-9)
    strided = acc.repeat(acc.poisson(acc.gaussian(1.0), 2 * rate), STEPS)
    assert ranks[0]["epsilon"] > acc.epsilon(strided, delta=delta).value
    record = json.loads((tmp_path / "ddp" / "run" / "checkpoint-5" / "accountant.json").read_text())
    assert record["ddp_shard"] == "global" and record["expected_batch_size"] == 2 * per_device


def test_ddp_router_release_equals_single_process_on_the_union_batch(tmp_path, monkeypatch):
    """The MoE router release under DDP: each rank sums its examples' load statistics, the sum is reduced across
    ranks and noised once, so the trained weights and the released load estimate equal those of one process whose
    sampler draws the union of the two ranks' batches (the whole trainer loop, router steering included)."""
    router = {"router_aux_loss_coef": 0.1, "router_aux_kwargs": {"max_tokens": 6, "mean_tokens": 5.0}}
    ranks = launch("trainer_moe", tmp_path / "ddp", DDP_TEST_BATCH=str(PER_DEVICE))
    single = DPTrainer(tiny_moe("qwen3_moe"), _args(tmp_path, logging_steps=1, **router), train_dataset=DATA)
    rate = 2 * PER_DEVICE / len(DATA)
    shards = _rank_samplers("sgd", rate)

    def union(self, key, state):
        parts = [s.sample_rank(key, SamplerState(state.step, s.config), r)[0] for r, s in enumerate(shards)]
        return np.sort(np.concatenate(parts)), SamplerState(state.step + 1, state.config)

    monkeypatch.setattr(sampling.Poisson, "sample", union)
    output = single.train()
    for name, value in single.model.named_parameters():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        torch.testing.assert_close(ranks[0]["params"][name], value.detach(), rtol=0, atol=1e-6, msg=name)
    filtered, step, noise_var = ranks[0]["router"]
    assert torch.equal(filtered, ranks[1]["router"][0]) and step == STEPS
    torch.testing.assert_close(filtered, single._router_state.filtered, rtol=0, atol=1e-9)
    assert noise_var == single._router_state.noise_var > 0
    assert ranks[0]["epsilon"] == output.metrics["privacy_epsilon"]


def test_ddp_refuses_what_it_cannot_synchronize(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match="auto_find_microbatch_size"):
        DPTrainer(tiny_model("llama"), _args(tmp_path, auto_find_microbatch_size=True), train_dataset=DATA)
    with pytest.raises(ConfigurationError, match="not supported under DDP"):
        build_plan(_args(tmp_path, sampling_mode="sequential", privacy_noise_multiplier=0.0), len(DATA))
    plan = build_plan(_args(tmp_path, per_device_train_batch_size=PER_DEVICE), len(DATA))
    assert isinstance(plan.sampler, sampling.Poisson) and plan.sample_rate == 2 * PER_DEVICE / len(DATA)
    assert (plan.sampler.world_size, plan.sampler.rank) == (2, 0)
    truncated = _args(tmp_path, per_device_train_batch_size=PER_DEVICE, sampling_kwargs={"truncated_batch_size": 4})
    with pytest.raises(ConfigurationError, match=r"truncated Poisson.*world_size=2.*truncated_batch_size"):
        build_plan(truncated, len(DATA))


def test_resumed_sampler_state_keeps_this_ranks_configuration():
    rank0, rank1 = _rank_samplers("mf", 0.1)
    saved = SamplerState(3, rank0.init().config).to_json()
    assert distributed.local_sampler_state(saved, rank1.init()) == SamplerState(3, rank1.init().config)
    other = sampling.cyclic_poisson(dataset_size=40, sample_rate=0.1, bands=4, world_size=2, rank=1)
    with pytest.raises(StateError):
        distributed.local_sampler_state(saved, other.init())


def test_ddp_resume_is_identical_and_another_world_size_is_a_new_segment(tmp_path):
    """On the same world size the resume is bit-exact. One process resuming the 2-rank checkpoint draws other
    batches, so it continues with new keys: the saved steps stay charged and the new ones are composed after them."""
    ranks = launch("resume", tmp_path, timeout=170, DDP_TEST_BATCH=str(PER_DEVICE))
    for rank in ranks:
        for name, value in rank["full"].items():
            assert torch.equal(value, rank["resumed"][name]), name
        assert rank["epsilons"][0] == rank["epsilons"][1]
    single = DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=DATA)
    output = single.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))
    assert single.state.global_step == STEPS and single.ledger.releases == STEPS
    assert output.metrics["privacy_epsilon"] == ledger_result(single.ledger, single.privacy_plan.delta).value
    assert not all(torch.equal(v, ranks[0]["full"][k]) for k, v in single.model.named_parameters())  # new keys
