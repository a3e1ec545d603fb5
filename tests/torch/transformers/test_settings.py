"""The arguments split by effect: ``args.privacy`` (what the plan reads and a resume keeps), ``args.compute`` (how a
step computes), the clipping rule built once, and the two compute knobs ``per_example_row_multiple`` and
``layerwise_ghost_advantage``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opake_core.clipping import AdaptiveRule
from opake_core.errors import CheckpointError, ConfigurationError
from opake_core.tree import PerGroup
from opake_torch.transformers import TrainingArguments, privacy, resume
from opake_torch.transformers.compute_settings import ComputeSettings
from opake_torch.transformers.privacy_settings import PrivacySettings

FIXED = {"privacy_noise_multiplier": 1.0, "max_steps": 4, "per_device_train_batch_size": 4, "use_cpu": True}
# Compute flags away from their defaults, in a combination the rules accept on the CPU (tf32 would switch the process's
# TF32 on a GPU; compilation and CUDA graphs exclude checkpointing and each other).
COMPUTE = {
    "microbatch_size": 2, "per_example_gradients": "vmap", "per_example_row_multiple": 4,
    "layerwise_ghost_advantage": 2.5, "bf16": True, "bf16_full_eval": True,
    "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "use_compat_patches": False, "use_performance_kernels": True, "performance_kernels_config": {"swiglu": False},
}  # fmt: skip


def test_privacy_settings_are_frozen_and_the_same_whatever_the_compute_flags():
    plain, tuned = TrainingArguments(**FIXED), TrainingArguments(**FIXED, **COMPUTE)
    assert isinstance(plain.privacy, PrivacySettings) and isinstance(tuned.compute, ComputeSettings)
    assert plain.privacy == tuned.privacy
    assert plain.compute != tuned.compute
    assert {name: getattr(tuned.compute, name) for name in COMPUTE} == COMPUTE
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuned.privacy.privacy_noise_multiplier = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuned.compute.microbatch_size = 4
    # one privacy setting changed: the values differ, and so do the plans they make
    other = TrainingArguments(**{**FIXED, "per_device_train_batch_size": 8}, **COMPUTE)
    assert other.privacy != tuned.privacy and other.compute == tuned.compute
    assert privacy.build_plan(other, 40).sample_rate == 2 * privacy.build_plan(tuned, 40).sample_rate


def test_the_settings_hold_the_resolved_values_and_share_no_dict_with_the_arguments():
    args = TrainingArguments(**FIXED, sampling_kwargs="truncated_batch_size=8", privacy_accounting=None)
    assert args.privacy.sampling_mode == args.sampling_mode == "poisson"  # "auto" resolved
    assert args.privacy.sampling_kwargs == args.sampling_kwargs == {"truncated_batch_size": 8}
    assert args.privacy.privacy_accounting is True and args.compute.torch_compile_backend is None
    args.sampling_kwargs["truncated_batch_size"] = 1  # in place: the frozen value keeps its own copy
    assert args.privacy.sampling_kwargs == {"truncated_batch_size": 8}
    assert dataclasses.replace(args.privacy) == args.privacy  # resolving a resolved value changes nothing


def test_the_plan_reads_only_the_privacy_settings():
    """``build_plan`` of the arguments, of their privacy settings alone, and of an object that has nothing but the
    settings and a rank, are the same plan."""
    args = TrainingArguments(**FIXED, **COMPUTE)
    plans = [
        privacy.build_plan(args, 40),
        privacy.build_plan(args.privacy, 40),
        privacy.build_plan(SimpleNamespace(privacy=args.privacy, process_index=0), 40),
    ]
    keys = ("noise_multiplier", "sample_rate", "total_steps", "delta", "expected_batch_size", "clipping", "release")
    assert len({tuple(getattr(plan, k) for k in keys) for plan in plans}) == 1


def _horizon(**kwargs):
    """A DP-FTRL run (its resume is checked against the checkpoint's settings), with a fixed multiplier."""
    return TrainingArguments(**{**FIXED, "privacy_noise_mechanism": "mf_band", **kwargs},
                             privacy_noise_mechanism_kwargs={"bands": 2})  # fmt: skip


def test_the_resume_comparison_uses_exactly_the_privacy_settings():
    """A horizon resume compares the saved record with ``resume_fields(args.privacy, plan)`` and the saved world size
    with ``args.privacy.world_size``: an object holding only the privacy settings is compared like the arguments, a
    changed compute flag passes, and a changed privacy setting is refused."""
    args = _horizon()
    plan = privacy.build_plan(args, 40)
    saved = {"world_size": 1, **privacy.resume_fields(args.privacy, plan)}
    folder = Path("checkpoint-2")
    resume.check_same_run(SimpleNamespace(privacy=args.privacy), saved, plan, folder)  # reads nothing else
    tuned = _horizon(**COMPUTE)
    assert privacy.resume_fields(tuned.privacy, privacy.build_plan(tuned, 40)) == privacy.resume_fields(args, plan)
    resume.check_same_run(tuned, saved, privacy.build_plan(tuned, 40), folder)
    for change in ({"clipping_norm": 2.0}, {"privacy_noise_multiplier": 2.0}, {"max_steps": 6}):
        changed = _horizon(**change)
        with pytest.raises(CheckpointError, match="another run configuration"):
            resume.check_same_run(changed, saved, privacy.build_plan(changed, 40), folder)


def test_another_world_size_is_another_privacy_setting(monkeypatch):
    """A per-step run may resume on another world size (as a new segment, :func:`resume.resume`); a horizon run,
    whose cyclic sampling partitions the data by rank, may not."""
    horizon = {
        "privacy_noise_mechanism": "mf_band",
        "sampling_mode": "cyclic_poisson",
        "privacy_noise_mechanism_kwargs": {"bands": 2},
    }
    for extra, refused in (({}, False), (horizon, True)):
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        args = TrainingArguments(**FIXED, **extra)
        plan = privacy.build_plan(args, 40)
        saved = {"world_size": 1, **privacy.resume_fields(args, plan)}
        monkeypatch.setenv("WORLD_SIZE", "2")
        ddp = SimpleNamespace(privacy=TrainingArguments(**FIXED, **extra).privacy)
        assert ddp.privacy.world_size == 2 and ddp.privacy.train_batch_size == 8 and ddp.privacy != args.privacy
        if refused:
            with pytest.raises(CheckpointError, match="world size 1, this run has 2"):
                resume.check_same_run(ddp, saved, plan, Path("checkpoint-2"))
        else:
            resume.check_same_run(ddp, saved, plan, Path("checkpoint-2"))


def test_assigning_a_field_rebuilds_its_settings_or_refuses():
    args = TrainingArguments(**FIXED)
    args.privacy_noise_multiplier = 2
    assert args.privacy.privacy_noise_multiplier == args.privacy_noise_multiplier == 2.0
    args.cuda_graphs = 3
    args.microbatch_size = 4
    assert (args.compute.cuda_graphs, args.compute.microbatch_size) == (3, 4)
    before = (args.privacy, args.compute)
    with pytest.raises(ConfigurationError, match="privacy_noise_multiplier"):
        args.privacy_noise_multiplier = -1.0
    with pytest.raises(ConfigurationError, match="microbatch_size must be in"):
        args.microbatch_size = 5  # above per_device_train_batch_size=4: the rule across the two values
    with pytest.raises(ConfigurationError, match="microbatch_size must be in"):
        args.per_device_train_batch_size = 1  # the same rule, from the other side, once a microbatch is set
    with pytest.raises(ConfigurationError, match="per_example_row_multiple"):
        args.per_example_row_multiple = 0
    assert (args.privacy, args.compute) == before  # every refused assignment left the arguments as they were
    assert (args.privacy_noise_multiplier, args.microbatch_size, args.per_example_row_multiple) == (2.0, 4, 1)


@pytest.mark.parametrize("value", [0, -1, 1.5, 4.0, True, "4", None, 2**31])
def test_per_example_row_multiple_is_a_count_of_at_least_one(value):
    with pytest.raises(ConfigurationError, match=r"per_example_row_multiple must be in \[1, 2\*\*31 - 1\]"):
        TrainingArguments(**FIXED, per_example_row_multiple=value)


@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, True, "2", None, 1e7])
def test_layerwise_ghost_advantage_is_finite_and_positive(value):
    with pytest.raises(ConfigurationError, match=r"layerwise_ghost_advantage must be .*\(0, 1e\+06\]"):
        TrainingArguments(**FIXED, layerwise_ghost_advantage=value)


def test_the_two_compute_knobs_default_to_one_and_keep_their_values():
    args = TrainingArguments(**FIXED)
    assert (args.per_example_row_multiple, args.layerwise_ghost_advantage) == (1, 1.0)
    args = TrainingArguments(**FIXED, per_example_row_multiple=8, layerwise_ghost_advantage=3)
    assert (args.compute.per_example_row_multiple, args.compute.layerwise_ghost_advantage) == (8, 3.0)
    assert type(args.compute.layerwise_ghost_advantage) is float
    assert args.to_dict()["per_example_row_multiple"] == 8 and args.privacy == TrainingArguments(**FIXED).privacy


def test_the_clipping_rule_is_the_plans():
    """The plan holds the rule it was validated with; the step's rule for the parameters is that rule (a per-group
    bound applied to them)."""
    adaptive = TrainingArguments(**FIXED, clipping_mode="adaptive", clipping_kwargs={"target_quantile": 0.7})
    plan = privacy.build_plan(adaptive, 40)
    assert isinstance(plan.clipping, AdaptiveRule) and plan.clipping.target_quantile == 0.7
    params = {"embed.weight": torch.zeros(2), "head.weight": torch.zeros(2)}
    assert plan.clipping_for(params) is plan.clipping
    grouped = TrainingArguments(**FIXED, clipping_norm={"embed": 0.5, "fallback": 2.0})
    rule = privacy.build_plan(grouped, 40).clipping_for(params)
    assert isinstance(rule, PerGroup) and rule == privacy.clipping_rule(grouped, params)


def test_a_run_builds_its_clipping_rule_once(tmp_path, monkeypatch):
    from tiny_hf import tiny_model, token_data

    from opake_torch.transformers import DPTrainer

    built = []
    rule = privacy.adaptive
    monkeypatch.setattr(privacy, "adaptive", lambda *a, **k: built.append(1) or rule(*a, **k))
    args = TrainingArguments(
        str(tmp_path), **{**FIXED, "max_steps": 2}, clipping_mode="adaptive", save_strategy="no",
        report_to="none", disable_tqdm=True, privacy_noise_seed=0,
    )  # fmt: skip
    DPTrainer(tiny_model("llama"), args, train_dataset=token_data(16)).train()
    assert len(built) == 1
