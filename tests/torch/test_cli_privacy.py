"""``opake privacy epsilon|calibrate|steps``: oracle values through ``main``, JSON output, errors, plot."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import rdp

from opake_torch.cli import build_parser, main

ORACLE = json.loads(
    (Path(__file__).parents[1] / "core" / "accounting" / "data" / "dpsgd_accounting_oracle.json").read_text()
)


def _run(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return json.loads(out[0])


# Every RDP row (cheap) and one PLD row (plus sigma=1, 1000 steps below); the API tests cover every PLD row.
CASES = [("rdp", r) for r in ORACLE["rows"]] + [("pld", r) for r in ORACLE["rows"] if r["steps"] == 100][-1:]


@pytest.mark.parametrize(
    ("name", "row"), CASES, ids=lambda v: v if isinstance(v, str) else f"s{v['sigma']}-T{v['steps']}"
)
def test_epsilon_reproduces_the_oracle(capsys, name, row):
    answer = _run(
        capsys,
        "privacy", "epsilon", "--noise-multiplier", str(row["sigma"]), "--sample-rate", str(row["q"]),
        "--steps", str(row["steps"]), "--delta", "1e-5", "--accountant", name, "--json",
    )  # fmt: skip
    assert answer["epsilon"] == pytest.approx(row[f"eps_{name}"], rel=1e-4)
    assert answer["accountant"] == name
    assert answer["noise_multiplier"] == row["sigma"]
    assert answer["sample_rate"] == row["q"]
    assert answer["steps"] == row["steps"]
    assert answer["delta"] == 1e-5
    assert answer["sampler"] == "poisson"


def test_default_accountant_is_pld(capsys):
    answer = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "1000",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    assert answer["accountant"] == "pld"
    assert answer["epsilon"] == pytest.approx(1.828244, rel=1e-4)


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_calibrate_reproduces_the_oracle(capsys, name):
    case = ORACLE["calibration"][0]
    answer = _run(
        capsys, "privacy", "calibrate", "--target-epsilon", "8", "--sample-rate", "0.01", "--steps", "1000",
        "--delta", "1e-5", "--accountant", name, "--tolerance", "2e-5", "--json",
    )  # fmt: skip
    assert answer["noise_multiplier"] == pytest.approx(case[f"sigma_{name}"], rel=1e-4)
    assert answer["epsilon"] <= 8.0
    assert answer["target_epsilon"] == 8.0
    assert answer["accountant"] == name
    assert (answer["min"], answer["max"], answer["tolerance"]) == (0.11, 10.0, 2e-5)


def test_steps(capsys):
    answer = _run(
        capsys, "privacy", "steps", "--noise-multiplier", "1.0", "--sample-rate", "0.01",
        "--target-epsilon", "8",
        "--delta", "1e-5", "--accountant", "rdp", "--json",
    )  # fmt: skip
    steps = answer["steps"]
    assert answer["epsilon"] <= 8.0
    after = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps",
        str(steps + 1), "--delta", "1e-5", "--accountant", "rdp", "--json",
    )  # fmt: skip
    assert after["epsilon"] > 8.0


def test_defaults_from_dataset_size_and_epochs(capsys):
    answer = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "2.0", "--batch-size", "100",
        "--dataset-size", "10000",
        "--epochs", "2", "--accountant", "rdp", "--json",
    )  # fmt: skip
    assert answer["sample_rate"] == 0.01
    assert answer["steps"] == 200
    assert answer["delta"] == pytest.approx(1 / 10000**1.1)


def test_nonprivate_epsilon_is_inf(capsys):
    answer = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "0", "--sample-rate", "0.01", "--steps", "10",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    assert answer["epsilon"] == float("inf")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--sample-rate", "1.5", "--steps", "10", "--delta", "1e-5"], "1.5"),
        (["--sample-rate", "nan", "--steps", "10", "--delta", "1e-5"], "nan"),
        (["--sample-rate", "0.01", "--steps", "-5", "--delta", "1e-5"], "-5"),
        (["--sample-rate", "0.01", "--steps", "10", "--delta", "1.5"], "delta"),
        (["--sample-rate", "0.01", "--steps", "10"], "--delta"),
        (["--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5", "--sampler", "k_out_of_t"], "--k"),
        (["--batch-size", "8", "--dataset-size", "64", "--steps", "10", "--delta", "0.5"], "1/N"),
        (["--sample-rate", "1", "--steps", "2000000", "--delta", "1e-5"], "--accountant rdp"),
    ],
)
def test_bad_input_exits_with_a_message(capsys, argv, needle):
    assert main(["privacy", "epsilon", "--noise-multiplier", "1.0", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_k_out_of_t_uses_monte_carlo(capsys):
    answer = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--steps", "8", "--delta", "1e-2",
        "--sampler", "k_out_of_t", "--k", "2", "--allocation", "block", "--mc-samples", "20000",
        "--sample-rate", "0.25", "--json",
    )  # fmt: skip
    assert answer["accountant"] == "monte_carlo"
    assert answer["k"] == 2 and answer["allocation"] == "block"
    assert 0 < answer["epsilon"] < 10


def test_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "eps.png"
    _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "100",
        "--delta", "1e-5", "--accountant", "rdp", "--json", "--plot", str(path),
    )  # fmt: skip
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parser_has_room_for_more_commands():
    parser = build_parser()
    args = parser.parse_args(["privacy", "epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "1"])
    assert callable(args.run)


def test_a_large_delta_needs_the_explicit_override(capsys):
    argv = ["privacy", "epsilon", "--noise-multiplier", "1", "--batch-size", "8", "--dataset-size", "64", "--steps",
            "10", "--delta", "0.05", "--json"]  # fmt: skip
    assert main(argv) == 2
    with pytest.warns(UserWarning, match="1/N"):
        assert main([*argv, "--allow-large-delta"]) == 0
    assert json.loads(capsys.readouterr().out)["delta"] == 0.05


def test_a_tiny_multiplier_answers_at_once(capsys):
    """0.01 noise: epsilon is in the millions, beyond any PLD grid, so RDP answers and says so (queries.py)."""
    answer = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "0.01", "--sample-rate", "0.01", "--steps", "1000",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    direct = rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.01)), 1000)
    assert answer["accountant"] == "rdp" and answer["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def test_fixed_size_batches_are_accounted_by_rdp_under_replace_one(capsys):
    answer = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "2.0", "--sampler", "fixed_size", "--batch-size", "50",
        "--dataset-size", "5000", "--steps", "300", "--delta", "1e-5", "--json",
    )  # fmt: skip
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(5000, 50, dp_accounting.GaussianDpEvent(1.0))
    accountant.compose(event, 300)
    assert answer["accountant"] == "rdp" and answer["sampler"] == "fixed_size"
    assert answer["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert main(["privacy", "epsilon", "--noise-multiplier", "2", "--sampler", "fixed_size", "--sample-rate", "0.01",
                 "--steps", "3", "--delta", "1e-5"]) != 0  # fmt: skip
    assert "needs --batch-size and --dataset-size" in capsys.readouterr().err
