"""``opake privacy calibrate`` for every budget kind and parameter, and ``opake privacy epsilon``'s f-DP and delta
answers: each against the core (``accounting.calibrate``, ``advantage``, ``beta``, ``bayes_risk``, ``delta``) on the
process built by hand, and against the mu-GDP closed forms where the run is a plain Gaussian; the refusals; the JSON
keys; and the default ``--target-epsilon`` answer, unchanged."""

from __future__ import annotations

import math

import pytest
from cli_runs import cli_json, cli_line, cli_refused
from scipy.stats import norm

from opake_core import accounting as acc
from opake_core import mf, sampling
from opake_core.accounting.mf_monte_carlo import default_monte_carlo
from opake_core.errors import ConfigurationError


def _run(capsys, *argv: str) -> dict:
    return cli_json(capsys, *argv, "--json")


def _gdp(mu: float) -> dict:
    """The exact answers of one Gaussian release with noise multiplier ``1 / mu`` (Dong, Roth and Su 2022; Balle and
    Wang 2018, Theorem 8 for delta)."""
    g = 0.7 / 0.3
    return {
        "advantage": 2 * norm.cdf(mu / 2) - 1,
        "beta_0.05": norm.cdf(norm.ppf(0.95) - mu),
        "bayes_0.3": 0.3 * norm.cdf(math.log(g) / mu - mu / 2) + 0.7 * norm.cdf(-math.log(g) / mu - mu / 2),
        "delta_1": norm.cdf(mu / 2 - 1 / mu) - math.e * norm.cdf(-mu / 2 - 1 / mu),
    }


# -- opake privacy epsilon --advantage / --beta-at-alpha / --bayes-risk-at-prior / --delta-at-epsilon ------------------

SAMPLED = (
    "privacy",
    "epsilon",
    "--noise-multiplier",
    "2.0",
    "--sample-rate",
    "0.1",
    "--steps",
    "10",
    "--delta",
    "1e-5",
)


def test_epsilon_answers_the_core_on_the_same_process(capsys):
    answer = _run(capsys, *SAMPLED, "--advantage", "--bayes-risk-at-prior", "0.3", "--delta-at-epsilon", "1")
    process = acc.repeat(acc.poisson(acc.gaussian(2.0), 0.1), 10)
    assert answer["advantage"] == acc.advantage(process).value
    assert answer["bayes_risk_at_prior"] == {"prior": 0.3, "bayes_risk": acc.bayes_risk(process, prior=0.3).value}
    assert answer["delta_at_epsilon"] == {"epsilon": 1.0, "delta": acc.delta(process, epsilon=1.0).value,
                                          "accountant": "pld"}  # fmt: skip
    assert answer["epsilon"] == acc.epsilon(process, delta=1e-5).value == _run(capsys, *SAMPLED)["epsilon"]
    assert list(answer)[:4] == ["epsilon", "advantage", "bayes_risk_at_prior", "delta_at_epsilon"]
    line = cli_line(capsys, *SAMPLED, "--advantage", "--delta-at-epsilon", "1")
    assert line.startswith(f"epsilon = {answer['epsilon']:.6g}, advantage = {answer['advantage']:.6g}, delta = ")
    assert " at epsilon 1  (" in line


def test_epsilon_answers_match_the_gaussian_closed_forms(capsys):
    """Four unsampled releases at multiplier 4 are one at 2: 1/2-GDP. The f-DP answers are bounds on the safe side
    (advantage above, beta and Bayes risk below) within the PLD's discretization; delta is dp-accounting's PLD."""
    answer = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "4", "--sample-rate", "1", "--steps", "4", "--delta",
        "1e-5", "--advantage", "--beta-at-alpha", "0.05", "--bayes-risk-at-prior", "0.3", "--delta-at-epsilon", "1",
    )  # fmt: skip
    exact = _gdp(0.5)
    assert exact["advantage"] <= answer["advantage"] < exact["advantage"] + 1e-3
    assert answer["beta_at_alpha"]["alpha"] == 0.05
    assert exact["beta_0.05"] - 1e-3 < answer["beta_at_alpha"]["beta"] <= exact["beta_0.05"]
    assert exact["bayes_0.3"] - 1e-3 < answer["bayes_risk_at_prior"]["bayes_risk"] <= exact["bayes_0.3"]
    assert answer["delta_at_epsilon"]["delta"] == pytest.approx(exact["delta_1"], rel=1e-3)
    assert answer["delta_at_epsilon"]["delta"] >= exact["delta_1"]


def test_delta_at_epsilon_uses_the_runs_accountant(capsys):
    """RDP for fixed-size batches; Monte Carlo DP-FTRL with the samples its epsilon drew (the default count)."""
    fixed = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1", "--sampler", "fixed_size", "--batch-size", "10",
        "--dataset-size", "1000", "--steps", "16", "--delta", "1e-5", "--delta-at-epsilon", "2",
    )  # fmt: skip
    process = acc.repeat(acc.without_replacement(acc.gaussian(1.0), dataset_size=1000, sample_size=10), 16)
    direct = acc.delta(process, epsilon=2.0)
    assert fixed["delta_at_epsilon"] == {"epsilon": 2.0, "delta": direct.value, "accountant": "rdp"}
    blt = _run(
        capsys, "privacy", "epsilon", "--noise-multiplier", "1", "--mechanism", "mf_blt", "--sample-rate", "0.0625",
        "--steps", "16", "--delta", "1e-3", "--delta-at-epsilon", "1",
    )  # fmt: skip
    sampler = sampling.balls_in_bins(dataset_size=1, num_bins=16)
    process = acc.mf_process(mf.optimize(mf.blt(10), 16), sampler=sampler, noise_multiplier=1.0, n_steps=16)
    direct = acc.delta(process, epsilon=1.0, monte_carlo=default_monte_carlo(1e-3))
    assert blt["mc_samples"] == default_monte_carlo(1e-3).num_samples
    assert blt["delta_at_epsilon"] == {"epsilon": 1.0, "delta": direct.value, "accountant": direct.accountant}


@pytest.mark.parametrize(
    ("argv", "flag", "needle", "core"),
    [
        (["--sampler", "fixed_size", "--batch-size", "10", "--dataset-size", "10000", "--steps", "16"], "--advantage",
         "--sampler fixed_size", lambda: acc.advantage(acc.without_replacement(acc.gaussian(1.0), dataset_size=10000,
                                                                               sample_size=10))),
        (["--mechanism", "mf_blt", "--sample-rate", "0.0625", "--steps", "16", "--mc-samples", "300"],
         "--beta-at-alpha=0.1", "Monte Carlo only", lambda: acc.beta(acc.mf_process(
             mf.optimize(mf.blt(10), 16), sampler=sampling.balls_in_bins(dataset_size=1, num_bins=16),
             noise_multiplier=1.0, n_steps=16), alpha=0.1)),
        (["--sample-rate", "0.1", "--steps", "16", "--accountant", "rdp"], "--bayes-risk-at-prior=0.5",
         "--accountant rdp", lambda: acc.Budget.bayes_risk(0.4, prior=0.5).query(acc.gaussian(1.0), accountant="rdp")),
        (["--sampler", "k_out_of_t", "--k", "2", "--allocation", "block", "--steps", "8", "--mc-samples", "300"],
         "--advantage", "--mc-samples", lambda: acc.Budget.advantage(0.1).query(
             acc.k_out_of_t(acc.gaussian(1.0), k=2, t=8, allocation="block"), accountant="monte_carlo")),
    ],
)  # fmt: skip
def test_fdp_answers_are_refused_where_the_core_has_no_profile(capsys, argv, flag, needle, core):
    with pytest.raises(ConfigurationError):
        core()
    err = cli_refused(capsys, "privacy", "epsilon", "--noise-multiplier", "1", "--delta", "1e-5", *argv, flag)
    assert flag.split("=")[0] in err and needle in err and "PLD privacy profile" in err


# -- opake privacy calibrate --target-* --parameter -----------------------------------------------------------------

# The keys of the --target-epsilon answer before any other budget existed, in their order.
DEFAULT_KEYS = ["noise_multiplier", "epsilon", "target_epsilon", "sample_rate", "batch_size", "dataset_size", "steps",
                "epochs", "sampler", "delta", "accountant", "privacy_unit", "min", "max", "tolerance"]  # fmt: skip
CAL = ("privacy", "calibrate")


def test_the_default_target_epsilon_answer_is_unchanged(capsys):
    argv = (*CAL, "--target-epsilon", "8", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5",
            "--accountant", "rdp")  # fmt: skip
    answer = _run(capsys, *argv)
    run = lambda z: acc.repeat(acc.poisson(acc.gaussian(z), 0.01), 1000)  # noqa: E731
    direct = acc.calibrate_noise_multiplier(run, target_epsilon=8.0, delta=1e-5, accountant="rdp")
    assert list(answer) == DEFAULT_KEYS
    assert (answer["noise_multiplier"], answer["epsilon"]) == (direct.value, direct.epsilon)
    assert (answer["min"], answer["max"], answer["tolerance"], answer["target_epsilon"]) == (0.11, 10.0, 1e-3, 8.0)
    line = cli_line(capsys, *argv)
    assert line.startswith(f"noise_multiplier = {direct.value:.6g}  (epsilon=") and "budget=" not in line


def _generic_keys(answer: dict, parameter: str) -> None:
    assert list(answer)[:4] == [parameter, "achieved", "budget", "parameter"] and answer["parameter"] == parameter
    assert list(answer)[-3:] == ["min", "max", "tolerance"] and "accountant" in answer


def test_target_delta_by_sample_rate(capsys):
    answer = _run(
        capsys, *CAL, "--target-delta", "1e-6", "--at-epsilon", "2", "--parameter", "sample_rate",
        "--noise-multiplier", "1", "--steps", "1000", "--accountant", "rdp", "--tolerance", "0.01",
    )  # fmt: skip
    run = lambda q: acc.repeat(acc.poisson(acc.gaussian(1.0), q), 1000)  # noqa: E731
    budget = acc.Budget.delta(1e-6, epsilon=2.0)
    direct = acc.calibrate(run, budget=budget, parameter="sample_rate", tolerance=0.01, accountant="rdp")
    _generic_keys(answer, "sample_rate")
    assert (answer["sample_rate"], answer["achieved"]) == (direct.value, direct.achieved)
    assert acc.delta(run(answer["sample_rate"]), epsilon=2.0, accountant="rdp").value <= 1e-6
    assert answer["budget"] == str(budget) == "delta <= 1e-06 at epsilon 2"
    assert (answer["noise_multiplier"], answer["steps"], answer["delta"]) == (1.0, 1000, None)
    assert (answer["min"], answer["max"], answer["tolerance"]) == (1e-9, 1.0, 0.01)


def test_target_advantage_by_steps(capsys):
    """Unsampled releases at multiplier 4: n of them are sqrt(n)/4-GDP, advantage 2 Phi(sqrt(n)/8) - 1: 0.197 at 4
    steps, 0.220 at 5, so 4 is the most steps within 0.2."""
    answer = _run(
        capsys, *CAL, "--target-advantage", "0.2", "--parameter", "steps", "--noise-multiplier", "4",
        "--sample-rate", "1",
    )  # fmt: skip
    run = lambda n: acc.repeat(acc.poisson(acc.gaussian(4.0), 1.0), n)  # noqa: E731
    direct = acc.calibrate(run, budget=acc.Budget.advantage(0.2), parameter="steps")
    _generic_keys(answer, "steps")
    assert answer["steps"] == direct.value == 4 and answer["achieved"] == acc.advantage(run(4)).value
    assert acc.advantage(run(5)).value > 0.2 >= answer["achieved"] >= _gdp(0.5)["advantage"]
    assert answer["budget"] == "advantage <= 0.2" and answer["epochs"] == 4.0 and answer["tolerance"] is None


def test_target_beta_by_noise_multiplier(capsys):
    """One release: the least multiplier whose beta at alpha 0.05 is at least 0.9, within the relative tolerance, and
    below the exact Gaussian curve at that multiplier (a lower bound)."""
    answer = _run(
        capsys, *CAL, "--target-beta", "0.9", "--at-alpha", "0.05", "--sample-rate", "1", "--steps", "1",
        "--tolerance", "0.01",
    )  # fmt: skip
    z = answer["noise_multiplier"]
    direct = acc.beta(acc.repeat(acc.poisson(acc.gaussian(z), 1.0), 1), alpha=0.05).value
    _generic_keys(answer, "noise_multiplier")
    assert answer["achieved"] == direct and 0.9 <= direct <= 0.9 / 0.99
    assert direct <= norm.cdf(norm.ppf(0.95) - 1 / z) < direct + 1e-3
    assert answer["budget"] == "beta >= 0.9 at alpha 0.05"


def test_target_bayes_risk_by_noise_multiplier(capsys):
    answer = _run(capsys, *CAL, "--target-bayes-risk", "0.45", "--prior", "0.5", "--sample-rate", "1", "--steps", "2")
    run = lambda z: acc.repeat(acc.poisson(acc.gaussian(z), 1.0), 2)  # noqa: E731
    direct = acc.calibrate(run, budget=acc.Budget.bayes_risk(0.45, prior=0.5), parameter="noise_multiplier")
    _generic_keys(answer, "noise_multiplier")
    assert (answer["noise_multiplier"], answer["achieved"]) == (direct.value, direct.achieved)
    assert 0.45 <= acc.bayes_risk(run(direct.value), prior=0.5).value
    assert answer["budget"] == "Bayes risk >= 0.45 at prior 0.5"


def test_target_epsilon_by_steps_equals_calibrate_steps(capsys):
    argv = (*CAL, "--target-epsilon", "2", "--parameter", "steps", "--noise-multiplier", "1", "--sample-rate", "0.01",
            "--delta", "1e-5", "--accountant", "rdp")  # fmt: skip
    answer = _run(capsys, *argv)
    step = acc.poisson(acc.gaussian(1.0), 0.01)
    direct = acc.calibrate_steps(step, target_epsilon=2.0, delta=1e-5, accountant="rdp")
    _generic_keys(answer, "steps")
    assert (answer["steps"], answer["achieved"]) == (direct.value, direct.epsilon)
    assert answer["delta"] == 1e-5 and answer["budget"] == "epsilon <= 2 at delta 1e-05"
    assert cli_line(capsys, *argv).startswith(f"steps = {direct.value}  (achieved=")


def test_band_mf_sample_rate_searches_up_to_the_cyclic_groups(capsys):
    """cyclic_poisson over 4 bands of 250 takes each example of the active group at rate 4 q: q <= 1/4 by default."""
    answer = _run(
        capsys, *CAL, "--target-epsilon", "4", "--delta", "1e-5", "--mechanism", "mf_band", "--bands", "4",
        "--dataset-size", "1000", "--parameter", "sample_rate", "--noise-multiplier", "1", "--steps", "32",
        "--tolerance", "0.01", "--accountant", "rdp",
    )  # fmt: skip
    strategy = mf.optimize(mf.band_mf(4), 32)

    def run(q: float) -> acc.Process:
        sampler = sampling.cyclic_poisson(dataset_size=1000, sample_rate=q, bands=4)
        return acc.mf_process(strategy, sampler=sampler, noise_multiplier=1.0, n_steps=32)

    direct = acc.calibrate(run, budget=acc.Budget.epsilon(4.0, delta=1e-5), parameter="sample_rate", max=0.25,
                           tolerance=0.01, accountant="rdp")  # fmt: skip
    assert answer["max"] == 0.25 and (answer["sample_rate"], answer["achieved"]) == (direct.value, direct.achieved)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--target-epsilon", "2", "--target-delta", "1e-6"], "not allowed with argument --target-epsilon"),
        (["--target-advantage", "0.1", "--target-beta", "0.9"], "not allowed with argument --target-advantage"),
        ([], "one of the arguments --target-epsilon --target-delta"),
        (["--target-delta", "1e-6"], "--target-delta needs --at-epsilon"),
        (["--target-beta", "0.9"], "--target-beta needs --at-alpha"),
        (["--target-bayes-risk", "0.4"], "--target-bayes-risk needs --prior"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--at-alpha", "0.1"], "--at-alpha is the point of --target-beta"),
        (["--target-delta", "1e-6", "--at-epsilon", "1", "--prior", "0.5"], "--prior is the point of"),
        (["--target-advantage", "0.1", "--delta", "1e-5"], "--target-advantage does not read it"),
        (["--target-advantage", "0.1", "--allow-large-delta"], "--allow-large-delta applies to"),
        (["--target-bayes-risk", "0.6", "--prior", "0.5"], "argument --target-bayes-risk"),
        (["--target-advantage", "1"], "argument --target-advantage"),
        (["--target-delta", "0.05", "--at-epsilon", "1", "--dataset-size", "64"], "1/N"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--noise-multiplier", "1"], "--noise-multiplier is what"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "steps"], "add --noise-multiplier"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "sample_rate", "--noise-multiplier", "1",
          "--sample-rate", "0.01"], "--sample-rate is what --parameter sample_rate searches"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "sample_rate", "--noise-multiplier", "1",
          "--epochs", "2"], "--epochs counts steps"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "sample_rate", "--noise-multiplier", "1",
          "--sampler", "fixed_size", "--batch-size", "10", "--dataset-size", "1000"], "--batch-size gives the rate"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "sample_rate", "--noise-multiplier", "1",
          "--sampler", "k_out_of_t", "--k", "2", "--allocation", "block", "--steps", "8"], "has none"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "steps", "--noise-multiplier", "1",
          "--steps", "100"], "--steps gives the steps"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "steps", "--noise-multiplier", "1",
          "--mechanism", "mf_band", "--dataset-size", "1000"], "accounted for its whole horizon"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "steps", "--noise-multiplier", "1",
          "--tolerance", "0.01"], "steps are exact"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--parameter", "steps", "--noise-multiplier", "1",
          "--max", "2.5"], "--max must be"),
        (["--target-epsilon", "2", "--delta", "1e-5", "--max", "2e6"], "--max must be"),
        (["--target-advantage", "0.1", "--plot", "eps.png"], "--plot draws epsilon"),
        (["--target-delta", "1e-6", "--at-epsilon", "1", "--mechanism", "mf_blt"], "by Monte Carlo"),
        (["--target-beta", "0.9", "--at-alpha", "0.1", "--accountant", "rdp"], "--target-beta reads the run's PLD"),
        (["--target-advantage", "0.1", "--sampler", "fixed_size", "--batch-size", "10", "--dataset-size", "1000"],
         "--sampler fixed_size is accounted by RDP"),
    ],
)  # fmt: skip
def test_calibrate_refuses_with_the_flag_and_the_fix(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    parameter = argv[argv.index("--parameter") + 1] if "--parameter" in argv else None
    if parameter != "sample_rate" and not {"--sample-rate", "--batch-size", "k_out_of_t"} & set(argv):
        argv = [*argv, "--sample-rate", "0.01"]
    if parameter != "steps" and not {"--steps", "--epochs"} & set(argv):
        argv = [*argv, "--steps", "100"]
    assert needle in cli_refused(capsys, *CAL, *argv)
