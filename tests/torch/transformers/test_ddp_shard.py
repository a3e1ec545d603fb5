"""``TrainingArguments(ddp_shard=...)``: how data-parallel ranks draw a step's sample, and what the plan accounts.

One process (``WORLD_SIZE`` set, no launch): the plan each rank would build. The DDP run itself is compared with one
process on the union batch in tests/torch/distributed/test_ddp_trainer.py.
"""

from __future__ import annotations

import pytest

from opake_core import accounting as acc
from opake_core import sampling
from opake_core.errors import ConfigurationError
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers.privacy import build_plan

N = 200


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 4,
        "max_steps": 5,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
    }
    return TrainingArguments(str(tmp_path), **{**base, **kw})


def test_global_under_ddp_is_parallel_poisson_accounted_as_a_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    args = _args(tmp_path, ddp_shard="global")
    assert args.privacy.ddp_shard == "global" and _args(tmp_path).privacy.ddp_shard == "per_rank"
    plan = build_plan(args, N)
    rate = 4 / N  # per_device_train_batch_size / N, for every rank
    assert plan.sampler == sampling.poisson(dataset_size=N, sample_rate=rate, world_size=3, rank=2, sharding="global")
    assert plan.release == acc.poisson_group(acc.gaussian(1.0), rate, group_size=3)
    assert plan.expected_batch_size == pytest.approx(12.0) and plan.sample_rate == pytest.approx(12 / N)
    per_rank = build_plan(_args(tmp_path), N)
    assert per_rank.release == acc.poisson(acc.gaussian(1.0), 12 / N) and per_rank.expected_batch_size == 12.0


def test_a_target_epsilon_calibrates_the_group(tmp_path, monkeypatch):
    """With the default search range, in about 10 s: RDP of the dominating Poisson step sizes the grid of the small
    multipliers the search probes and gives it a first guess (before, the probe at 0.11 alone took 40 s)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    delta = 1e-5
    args = _args(tmp_path, ddp_shard="global", privacy_noise_multiplier=None, privacy_target_epsilon=2.0,
                 privacy_target_delta=delta, max_steps=20)  # fmt: skip
    plan = build_plan(args, N)
    assert plan.calibration_source == "calibrated"
    group = lambda z: acc.repeat(acc.poisson_group(acc.gaussian(z), 4 / N, group_size=2), 20)  # noqa: E731
    assert acc.epsilon(group(plan.noise_multiplier), delta=delta).value <= 2.0
    assert acc.epsilon(group(plan.noise_multiplier * 0.99), delta=delta).value > 2.0  # the tolerance is 1e-3


def test_one_process_runs_the_plain_sampler(tmp_path):
    """With one rank the two modes are one sampler (a group of one is the Poisson step): accepted, not refused, so
    the same arguments run on one GPU and on many."""
    plan = build_plan(_args(tmp_path, ddp_shard="global"), N)
    assert plan.sampler == sampling.poisson(dataset_size=N, sample_rate=4 / N)
    assert plan.release == build_plan(_args(tmp_path), N).release


@pytest.mark.parametrize(
    ("extra", "seen"),
    [
        ({"sampling_mode": "fixed_size"}, "sampling_mode='fixed_size'"),
        (
            {"privacy_noise_mechanism": "mf_band", "privacy_noise_mechanism_kwargs": {"bands": 2}},
            "sampling_mode='cyclic_poisson'",
        ),
        ({"privacy_noise_mechanism": "mf_identity", "sampling_mode": "poisson"}, "privacy_noise_mechanism="),
        ({"sampling_kwargs": {"truncated_batch_size": 8}}, "truncated_batch_size"),
        ({"clipping_mode": "adaptive"}, "clipping_mode='adaptive'"),
        (
            {"privacy_unit": "user", "privacy_user_column": "user", "privacy_max_rows_per_user": 2},
            "privacy_unit='user'",
        ),
    ],
)
def test_global_refuses_what_has_no_accountant(tmp_path, extra, seen):
    with pytest.raises(ConfigurationError, match=rf"ddp_shard='global'.*{seen}"):
        _args(tmp_path, ddp_shard="global", **extra)


def test_an_unknown_shard_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match=r"ddp_shard must be one of \['per_rank', 'global'\], got 'all'"):
        _args(tmp_path, ddp_shard="all")


def test_global_needs_only_one_ranks_batch_to_fit_the_dataset(tmp_path, monkeypatch):
    """3 ranks of 4 over 10 records: the cluster's expected batch (12) exceeds N, which the strided shards of one
    draw at rate 12 / N cannot serve; each rank's own draw at 4 / N can, so only 4 <= N is needed under global."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    plan = build_plan(_args(tmp_path, ddp_shard="global"), 10)
    assert plan.sampler == sampling.poisson(dataset_size=10, sample_rate=0.4, world_size=3, rank=1, sharding="global")
    assert plan.release == acc.poisson_group(acc.gaussian(1.0), 0.4, group_size=3)
    assert plan.expected_batch_size == pytest.approx(12.0)  # the normalizer: the expected draws of the step
    with pytest.raises(ConfigurationError, match="the expected batch 12 exceeds the dataset size 10"):
        build_plan(_args(tmp_path), 10)
    with pytest.raises(ConfigurationError, match="the expected batch of a rank 4 exceeds the dataset size 3"):
        build_plan(_args(tmp_path, ddp_shard="global"), 3)
