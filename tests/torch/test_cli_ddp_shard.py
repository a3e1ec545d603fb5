"""``opake privacy ... --ddp-shard global --world-size W``: the trainer's parallel Poisson sampling, accounted by the
core's group accountant (the answer equals it), with epochs counted over the W draws of a step; the flags are refused
where they do not apply."""

from __future__ import annotations

import json

import pytest

from opake_core import accounting as acc
from opake_torch.cli import main

GLOBAL = ("--ddp-shard", "global", "--world-size", "2")


def _run(capsys, *argv: str) -> dict:
    assert main(["privacy", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _refused(capsys, *argv: str) -> str:
    assert main(["privacy", *argv]) == 2
    return capsys.readouterr().err


def test_epsilon_is_the_group_accountant_of_one_ranks_rate(capsys):
    """One rank's batch 4 of N = 400 (q = 0.01), 2 epochs: a step draws 2 q N records, so 100 steps."""
    answer = _run(capsys, "epsilon", "--noise-multiplier", "1", "--batch-size", "4", "--dataset-size", "400",
                  "--epochs", "2", "--delta", "1e-5", *GLOBAL)  # fmt: skip
    assert answer["steps"] == 100 and answer["sample_rate"] == 0.01
    assert answer["ddp_shard"] == "global" and answer["world_size"] == 2
    group = acc.repeat(acc.poisson_group(acc.gaussian(1.0), 0.01, group_size=2), 100)
    assert answer["epsilon"] == acc.epsilon(group, delta=1e-5).value
    plain = acc.epsilon(acc.repeat(acc.poisson(acc.gaussian(1.0), 0.01), 200), delta=1e-5).value
    assert answer["epsilon"] > plain  # not the strided shards' account of the same records at rate 2q, 1/(2q) steps


def test_a_rank_batch_may_exceed_the_share_of_the_dataset(capsys):
    """3 ranks of 4 over 10 records: each rank's draw fits the dataset (the trainer accepts it under global)."""
    argv = ("epsilon", "--noise-multiplier", "2", "--batch-size", "4", "--dataset-size", "10", "--steps", "3")
    answer = _run(capsys, *argv, "--delta", "1e-3", "--ddp-shard", "global", "--world-size", "3")
    group = acc.repeat(acc.poisson_group(acc.gaussian(2.0), 0.4, group_size=3), 3)
    assert answer["epsilon"] == acc.epsilon(group, delta=1e-3).value


def test_steps_counts_epochs_over_the_ranks(capsys):
    answer = _run(capsys, "steps", "--noise-multiplier", "4", "--sample-rate", "0.01", "--target-epsilon", "2",
                  "--delta", "1e-5", "--accountant", "rdp", *GLOBAL)  # fmt: skip
    steps = answer["steps"]
    group = lambda n: acc.repeat(acc.poisson_group(acc.gaussian(4.0), 0.01, group_size=2), n)  # noqa: E731
    assert acc.epsilon(group(steps), delta=1e-5, accountant="rdp").value <= 2.0
    assert acc.epsilon(group(steps + 1), delta=1e-5, accountant="rdp").value > 2.0
    assert answer["epochs"] == pytest.approx(steps * 0.01 * 2)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--world-size", "2"), "--world-size applies to --ddp-shard global"),
        (("--ddp-shard", "global"), "--ddp-shard global needs --world-size"),
        ((*GLOBAL, "--sampler", "fixed_size", "--batch-size", "4", "--dataset-size", "400"), "--sampler fixed_size"),
        (
            (*GLOBAL, "--sampler", "truncated_poisson", "--truncated-batch-size", "8", "--dataset-size", "400"),
            "--sampler truncated_poisson",
        ),
        ((*GLOBAL, "--mechanism", "mf_identity"), "--mechanism mf_identity"),
        ((*GLOBAL, "--privacy-unit", "user"), "--privacy-unit user"),
        (("--ddp-shard", "all"), "invalid choice: 'all'"),
    ],
)
def test_the_flags_are_refused_where_they_do_not_apply(capsys, flags, needle):
    argv = ["epsilon", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5", *flags]
    if "--batch-size" not in flags and "--dataset-size" not in flags:
        argv += ["--sample-rate", "0.01"]
    try:
        err = _refused(capsys, *argv)
    except SystemExit as exc:  # argparse's usage error
        assert exc.code == 2
        err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
