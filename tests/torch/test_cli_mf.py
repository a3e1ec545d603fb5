"""``opake privacy epsilon|calibrate --mechanism mf_*``: the CLI agrees with the core and refuses bad pairs."""

from __future__ import annotations

import json

import pytest

from opake_core import accounting as acc
from opake_core import mf, sampling
from opake_torch.cli import main


def _run(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip())


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


COMMON = ("--sample-rate", "0.1", "--steps", "64", "--delta", "1e-4", "--json")


def test_identity_with_poisson_equals_dp_sgd(capsys):
    mf_answer = _run(capsys, "privacy", "epsilon", "--mechanism", "mf_identity", "--noise-multiplier", "1.0", *COMMON)
    sgd_answer = _run(capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", *COMMON)
    assert mf_answer["epsilon"] == sgd_answer["epsilon"]
    assert mf_answer["sampler"] == "poisson" and mf_answer["mechanism"] == "mf_identity"


def test_band_mf_defaults_to_cyclic_poisson_and_matches_the_core(capsys):
    answer = _run(
        capsys, "privacy", "epsilon", "--mechanism", "mf_band", "--bands", "4", "--dataset-size", "1000",
        "--noise-multiplier", "1.0", *COMMON,
    )  # fmt: skip
    sampler = sampling.cyclic_poisson(dataset_size=1000, sample_rate=0.1, bands=4)
    process = acc.mf_process(mf.band_mf(4), sampler=sampler, noise_multiplier=1.0, n_steps=64)
    assert answer["sampler"] == "cyclic_poisson" and answer["bands"] == 4
    assert answer["epsilon"] == pytest.approx(acc.epsilon(process, delta=1e-4).value, rel=1e-9)


def test_calibrate_band_mf_and_monte_carlo_bsr(capsys):
    answer = _run(
        capsys, "privacy", "calibrate", "--mechanism", "mf_band", "--bands", "4", "--dataset-size", "1000",
        "--target-epsilon", "8", *COMMON,
    )  # fmt: skip
    assert answer["epsilon"] <= 8.0 and answer["accountant"] == "pld"
    answer = _run(
        capsys, "privacy", "epsilon", "--mechanism", "mf_bsr", "--bandwidth", "4", "--noise-multiplier", "1.0",
        "--mc-samples", "20000", "--sample-rate", "0.125", "--steps", "64", "--delta", "0.05", "--json",
    )  # fmt: skip
    assert answer["sampler"] == "balls_in_bins" and answer["mc_samples"] == 20000 and answer["bandwidth"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--mechanism", "mf_blt", "--sampler", "cyclic_poisson", "--dataset-size", "1000"), "balls_in_bins"),
        (("--mechanism", "mf_band", "--sampler", "poisson"), "cyclic_poisson"),
        (("--mechanism", "mf_identity", "--sampler", "b_min_sep"), "poisson"),
        (("--sampler", "balls_in_bins"), "mf_identity"),
        (("--mechanism", "mf_blt", "--bands", "4"), "--bands applies to --mechanism mf_band"),
        (("--mechanism", "mf_band", "--bands", "4"), "needs --dataset-size"),
        (("--mechanism", "mf_band", "--bands", "128", "--dataset-size", "10000"), "bands <= n_steps"),
        (("--mechanism", "mf_band", "--bands", "4", "--dataset-size", "100", "--sample-rate", "0.3"), "rate"),
        (("--mechanism", "mf_bsr", "--sample-rate", "0.3"), "1 / num_bins"),
        (("--mechanism", "mf_bsr", "--sample-rate", "0.125", "--steps", "60"), "multiple of num_bins"),
    ],
)
def test_refusals_name_the_fix(capsys, argv, message):
    base = {"--sample-rate": "0.1", "--steps": "64"}
    args = list(argv)
    for flag, value in base.items():
        if flag not in args:
            args += [flag, value]
    err = _refused(capsys, "privacy", "epsilon", "--noise-multiplier", "1.0", "--delta", "1e-5", *args)
    assert message in err


def test_steps_is_refused_for_a_horizon_mechanism(capsys):
    err = _refused(
        capsys, "privacy", "steps", "--mechanism", "mf_band", "--noise-multiplier", "1", "--target-epsilon", "1",
        "--sample-rate", "0.1", "--delta", "1e-3",
    )  # fmt: skip
    assert "whole horizon" in err
