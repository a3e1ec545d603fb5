"""``opake privacy epsilon|calibrate|steps`` and ``opake demo``: oracle values through ``main``, JSON output, errors,
plot, and every flag honoured (the answer equals the core accountant of the sampler it names) or refused."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import dp_accounting
import pytest
from cli_runs import cli_json, cli_refused
from dp_accounting import rdp

from opake_core import accounting as acc
from opake_torch import cli
from opake_torch.cli import build_parser, main

ORACLE = json.loads(
    (Path(__file__).parents[1] / "core" / "accounting" / "data" / "dpsgd_accounting_oracle.json").read_text()
)


# Every RDP row (cheap) and one PLD row (plus sigma=1, 1000 steps below); the API tests cover every PLD row.
CASES = [("rdp", r) for r in ORACLE["rows"]] + [("pld", r) for r in ORACLE["rows"] if r["steps"] == 100][-1:]


@pytest.mark.parametrize(
    ("name", "row"), CASES, ids=lambda v: v if isinstance(v, str) else f"s{v['sigma']}-T{v['steps']}"
)
def test_epsilon_reproduces_the_oracle(capsys, name, row):
    answer = cli_json(
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
    answer = cli_json(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps", "1000",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    assert answer["accountant"] == "pld"
    assert answer["epsilon"] == pytest.approx(1.828244, rel=1e-4)


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_calibrate_reproduces_the_oracle(capsys, name):
    case = ORACLE["calibration"][0]
    answer = cli_json(
        capsys, "privacy", "calibrate", "--target-epsilon", "8", "--sample-rate", "0.01", "--steps", "1000",
        "--delta", "1e-5", "--accountant", name, "--tolerance", "2e-5", "--json",
    )  # fmt: skip
    assert answer["noise_multiplier"] == pytest.approx(case[f"sigma_{name}"], rel=1e-4)
    assert answer["epsilon"] <= 8.0
    assert answer["target_epsilon"] == 8.0
    assert answer["accountant"] == name
    assert (answer["min"], answer["max"], answer["tolerance"]) == (0.11, 10.0, 2e-5)


def test_steps(capsys):
    answer = cli_json(
        capsys, "privacy", "steps", "--noise-multiplier", "1.0", "--sample-rate", "0.01",
        "--target-epsilon", "8",
        "--delta", "1e-5", "--accountant", "rdp", "--json",
    )  # fmt: skip
    steps = answer["steps"]
    assert answer["epsilon"] <= 8.0
    after = cli_json(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--sample-rate", "0.01", "--steps",
        str(steps + 1), "--delta", "1e-5", "--accountant", "rdp", "--json",
    )  # fmt: skip
    assert after["epsilon"] > 8.0


def test_defaults_from_dataset_size_and_epochs(capsys):
    answer = cli_json(
        capsys, "privacy", "epsilon", "--noise-multiplier", "2.0", "--batch-size", "100",
        "--dataset-size", "10000",
        "--epochs", "2", "--accountant", "rdp", "--json",
    )  # fmt: skip
    assert answer["sample_rate"] == 0.01
    assert answer["steps"] == 200
    assert answer["delta"] == pytest.approx(1 / 10000**1.1)


def test_nonprivate_epsilon_is_inf(capsys):
    answer = cli_json(
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
    assert needle in cli_refused(capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", *argv)


def test_k_out_of_t_uses_monte_carlo(capsys):
    answer = cli_json(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--steps", "8", "--delta", "1e-2",
        "--sampler", "k_out_of_t", "--k", "2", "--allocation", "block", "--mc-samples", "20000", "--json",
    )  # fmt: skip
    assert answer["accountant"] == "monte_carlo"
    assert answer["k"] == 2 and answer["allocation"] == "block"
    assert 0 < answer["epsilon"] < 10


def test_k_out_of_t_defaults_to_the_numerical_pld(capsys):
    answer = cli_json(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5",
        "--sampler", "k_out_of_t", "--k", "2", "--allocation", "block", "--json",
    )  # fmt: skip
    process = acc.k_out_of_t(acc.gaussian(1.0), k=2, t=100, allocation="block")
    assert (answer["accountant"], answer["epsilon"]) == ("pld", acc.epsilon(process, delta=1e-5).value)


def test_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "eps.png"
    cli_json(
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
    answer = cli_json(
        capsys, "privacy", "epsilon", "--noise-multiplier", "0.01", "--sample-rate", "0.01", "--steps", "1000",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    direct = rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(0.01)), 1000)
    assert answer["accountant"] == "rdp" and answer["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def test_fixed_size_batches_are_accounted_by_rdp_under_replace_one(capsys):
    answer = cli_json(
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


# -- every flag honoured or refused ------------------------------------------------------------------------------------

EPS = ["privacy", "epsilon", "--noise-multiplier", "1.0", "--delta", "1e-5", "--json"]


@pytest.mark.parametrize(
    ("flags", "sampler"),
    [(["--truncated-batch-size", "5"], "truncated_poisson"), (["--k", "2"], "k_out_of_t"),
     (["--allocation", "block"], "k_out_of_t"), (["--mc-samples", "1000"], "k_out_of_t")],
)  # fmt: skip
def test_a_flag_of_another_sampler_is_refused_not_ignored(capsys, flags, sampler):
    """Before, each of these printed the plain Poisson epsilon as if the flag had been applied."""
    err = cli_refused(capsys, *EPS, "--sample-rate", "0.01", "--steps", "100", *flags)
    assert flags[0] in err and sampler in err


def test_truncated_batch_size_gives_the_truncated_poisson_accountant(capsys):
    argv = [*EPS, "--batch-size", "10", "--dataset-size", "1000", "--steps", "8"]
    answer = cli_json(capsys, *argv, "--sampler", "truncated_poisson", "--truncated-batch-size", "12")
    step = acc.truncated_poisson(acc.gaussian(1.0), 0.01, dataset_size=1000, truncated_batch_size=12)
    direct = acc.epsilon(acc.repeat(step, 8), delta=1e-5).value  # PLD, the only accountant of truncation
    poisson = cli_json(capsys, *argv)["epsilon"]
    assert answer["epsilon"] == direct and answer["truncated_batch_size"] == 12
    assert answer["sampler"] == "truncated_poisson" and answer["epsilon"] != poisson


@pytest.mark.parametrize(("k", "allocation"), [("2", "block"), ("4", "block"), ("3", "total")])
def test_k_and_allocation_give_the_k_out_of_t_accountant(capsys, k, allocation):
    argv = ["privacy", "epsilon", "--noise-multiplier", "1.0", "--steps", "12", "--delta", "1e-2", "--json"]
    answer = cli_json(
        capsys, *argv, "--sampler", "k_out_of_t", "--k", k, "--allocation", allocation, "--mc-samples", "500"
    )
    process = acc.k_out_of_t(acc.gaussian(1.0), k=int(k), t=12, allocation=allocation)
    direct = acc.epsilon(process, delta=1e-2, accountant="monte_carlo", monte_carlo=acc.MonteCarlo(num_samples=500))
    assert (answer["epsilon"], answer["accountant"]) == (direct.value, direct.accountant)
    assert (answer["k"], answer["allocation"], answer["mc_samples"]) == (int(k), allocation, 500)


def test_k_out_of_t_takes_no_sample_rate(capsys):
    """k-out-of-t has no rate: each example takes part in exactly k of the t steps. Before, --sample-rate was required,
    ignored and printed."""
    argv = [*EPS, "--steps", "8", "--sampler", "k_out_of_t", "--k", "2", "--allocation", "block"]
    for extra in (["--sample-rate", "0.25"], ["--batch-size", "4", "--dataset-size", "16"]):
        assert "do not apply to --sampler k_out_of_t" in cli_refused(capsys, *argv, *extra)


def test_mc_samples_zero_is_refused(capsys):
    """Before, 0 silently meant the default 1,000,000."""
    argv = [*EPS, "--steps", "8", "--sampler", "k_out_of_t", "--k", "2", "--allocation", "block"]
    assert "--mc-samples" in cli_refused(capsys, *argv, "--mc-samples", "0")


def _pairs() -> list[tuple[str, str]]:
    gaussian = [("gaussian", s) for s in ("poisson", "truncated_poisson", "k_out_of_t", "fixed_size")]
    return gaussian + [(m, s) for m, samplers in acc.COMPATIBLE_SAMPLERS.items() for s in samplers]


@pytest.mark.parametrize(("mechanism", "sampler"), _pairs())
def test_mc_samples_is_read_exactly_where_a_monte_carlo_accountant_runs(capsys, mechanism, sampler):
    """Accepted only where the core accounts the run by Monte Carlo (its answer says so), refused where it does not."""
    argv = ["privacy", "epsilon", "--noise-multiplier", "1.0", "--steps", "16", "--delta", "1e-3", "--json",
            "--mechanism", mechanism, "--sampler", sampler]  # fmt: skip
    if sampler == "k_out_of_t":
        argv += ["--k", "2", "--allocation", "block"]
    elif sampler == "fixed_size":
        argv += ["--batch-size", "4", "--dataset-size", "64"]
    else:
        argv += ["--sample-rate", "0.0625", "--dataset-size", "64"]
    if sampler == "truncated_poisson":
        argv += ["--truncated-batch-size", "6"]
    try:
        code = main([*argv, "--mc-samples", "300"])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    if code == 0:
        answer = json.loads(out)
        assert answer["mc_samples"] == 300 and answer["accountant"] in ("monte_carlo", "analytic_gaussian"), answer
    else:
        assert code == 2 and "--mc-samples applies to the Monte Carlo accountant" in err
        assert cli_json(capsys, *argv)["accountant"] in ("pld", "rdp")  # the core's choice: no Monte Carlo part


def test_mc_samples_sets_the_monte_carlo_count(capsys):
    argv = ["privacy", "epsilon", "--noise-multiplier", "0.8", "--steps", "8", "--delta", "1e-2", "--json",
            "--sampler", "k_out_of_t", "--k", "2", "--allocation", "total"]  # fmt: skip
    process = acc.k_out_of_t(acc.gaussian(0.8), k=2, t=8, allocation="total")
    for samples in (200, 5000):
        answer = cli_json(capsys, *argv, "--mc-samples", str(samples))
        mc = acc.MonteCarlo(num_samples=samples)
        direct = acc.epsilon(process, delta=1e-2, accountant="monte_carlo", monte_carlo=mc).value
        assert answer["epsilon"] == direct and answer["mc_samples"] == samples


def test_a_monte_carlo_run_beyond_the_draw_budget_is_refused_at_once(capsys):
    """N = 10**7 gives delta = 2e-8 and a default of 4.7e9 samples: before, numpy failed to allocate 35 GiB."""
    err = cli_refused(capsys, "privacy", "epsilon", "--noise-multiplier", "1", "--steps", "100", "--sample-rate",
                      "0.01", "--mechanism", "mf_blt", "--dataset-size", str(10**7))  # fmt: skip
    assert "Monte Carlo accountant would draw" in err


def test_allow_large_delta_needs_an_explicit_delta(capsys):
    err = cli_refused(capsys, "privacy", "epsilon", "--noise-multiplier", "1", "--batch-size", "8", "--dataset-size",
                   "64", "--steps", "10", "--allow-large-delta")  # fmt: skip
    assert "--allow-large-delta applies to an explicit --delta" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["epsilon", "--noise-multiplier", "1e308", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
        ["epsilon", "--noise-multiplier", "1e-300", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
        # dp-accounting's RDP answered epsilon = 0 here: a non-private run reported as perfectly private
        ["epsilon", "--noise-multiplier", "1e-160", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5",
         "--accountant", "rdp"],
        ["epsilon", "--noise-multiplier", "nan", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"],
        ["calibrate", "--target-epsilon", "3", "--max", "1e308", "--sample-rate", "0.01", "--steps", "100",
         "--delta", "1e-5"],
        ["calibrate", "--target-epsilon", "3", "--tolerance", "1e-300", "--sample-rate", "0.01", "--steps", "100",
         "--delta", "1e-5"],
        ["steps", "--noise-multiplier", "1e308", "--target-epsilon", "3", "--sample-rate", "0.01", "--delta", "1e-5"],
        ["steps", "--noise-multiplier", "1", "--target-epsilon", "inf", "--sample-rate", "0.01", "--delta", "1e-5"],
    ],
)  # fmt: skip
def test_extreme_numbers_are_usage_errors(capsys, argv):
    flag = next(a for a, v in itertools.pairwise(argv) if v in ("1e308", "1e-300", "1e-160", "nan", "inf"))
    assert f"argument {flag}" in cli_refused(capsys, "privacy", *argv)


def test_a_noise_multiplier_at_the_limits_answers(capsys):
    argv = ["--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--accountant", "rdp"]
    for sigma in ("1e-6", "1e6"):
        answer = cli_json(capsys, "privacy", "epsilon", "--noise-multiplier", sigma, *argv, "--json")
        direct = rdp.RdpAccountant()
        direct.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(float(sigma))), 100)
        assert answer["epsilon"] == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def test_an_unwritable_plot_is_refused_before_any_accounting(capsys, tmp_path):
    argv = [
        "privacy",
        "epsilon",
        "--noise-multiplier",
        "1",
        "--sample-rate",
        "0.01",
        "--steps",
        "100",
        "--delta",
        "1e-5",
    ]
    assert "argument --plot" in cli_refused(capsys, *argv, "--plot", str(tmp_path / "missing" / "eps.png"))
    assert "is a folder" in cli_refused(capsys, *argv, "--plot", str(tmp_path))


def test_a_write_that_fails_late_exits_1_without_a_traceback(capsys, monkeypatch, tmp_path):
    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(cli, "_plot", denied)
    argv = ["privacy", "epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "100", "--delta",
            "1e-5", "--accountant", "rdp", "--plot", str(tmp_path / "eps.png")]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("opake: error:") and "Permission denied" in err and "Traceback" not in err


@pytest.mark.parametrize("epochs", ["nan", "inf", "-inf", "0", "-1", "1e9"])
def test_demo_refuses_bad_epochs_before_creating_anything(capsys, tmp_path, epochs):
    out = tmp_path / "demo"
    assert "argument --epochs" in cli_refused(capsys, "demo", "--epochs", epochs, "--output-dir", str(out))
    assert not out.exists()


def test_demo_refuses_an_unwritable_output_dir(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "argument --output-dir" in cli_refused(capsys, "demo", "--output-dir", str(blocker / "demo"))
    assert "argument --target-epsilon" in cli_refused(capsys, "demo", "--target-epsilon", "nan")


def test_demo_passes_its_flags_to_thecli_json(capsys, monkeypatch, tmp_path):
    from opake_torch import demo

    seen = {}

    def fake_run(config, output_dir):
        seen.update(config=config, output_dir=output_dir)
        private = {"final_epsilon": 1.0, "delta": 1e-3, "exposures": [1.0]}
        return {"private": private, "non_private": {**private, "final_epsilon": math.inf}}

    monkeypatch.setattr(demo, "run", fake_run)
    assert main(["demo", "--epochs", "2.5", "--target-epsilon", "5", "--output-dir", str(tmp_path / "d")]) == 0
    assert (seen["config"].epochs, seen["config"].target_epsilon) == (2.5, 5.0)
    assert seen["output_dir"] == tmp_path / "d"


def test_privacy_unit_user_accounts_over_users(capsys):
    # 5000 users, 50 expected a step: dp-accounting's Poisson-subsampled Gaussian at q = 50 / 5000
    args = ("privacy", "epsilon", "--noise-multiplier", "1.0", "--batch-size", "50", "--dataset-size", "5000",
            "--steps", "300", "--json")  # fmt: skip
    out = cli_json(capsys, *args, "--privacy-unit", "user", "--max-rows-per-user", "8")
    event = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0))
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event, 300)
    assert out["privacy_unit"] == "user" and out["max_rows_per_user"] == 8
    assert out["delta"] == pytest.approx(1 / 5000**1.1)
    assert out["epsilon"] == pytest.approx(direct.get_epsilon(out["delta"]), rel=1e-6)
    assert cli_json(capsys, *args)["privacy_unit"] == "record"
    assert "--max-rows-per-user applies to --privacy-unit user" in cli_refused(
        capsys, *args, "--max-rows-per-user", "8"
    )
