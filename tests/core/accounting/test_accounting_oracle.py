"""Every row of the dp-accounting oracle, through the public API and against dp-accounting called directly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from opake_core import accounting as acc

ORACLE = json.loads((Path(__file__).parent / "data" / "dpsgd_accounting_oracle.json").read_text())
ROWS = ORACLE["rows"]
DELTA = ORACLE["delta"]


def _run(sigma: float, q: float, steps: int) -> acc.Process:
    return acc.repeat(acc.poisson(acc.gaussian(sigma), q), steps)


def _direct(name: str, sigma: float, q: float, steps: int) -> float:
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4) if name == "pld" else rdp.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"s{r['sigma']}-T{r['steps']}")
@pytest.mark.parametrize("name", ["pld", "rdp"])
def test_oracle_rows(row, name):
    result = acc.epsilon(_run(row["sigma"], row["q"], row["steps"]), delta=DELTA, accountant=name)
    assert result.accountant == name
    assert result.value == pytest.approx(row[f"eps_{name}"], rel=1e-4)


# Direct cross-check on every row for RDP (cheap) and on one PLD row (the oracle test covers every PLD row).
DIRECT = [("rdp", r) for r in ROWS] + [("pld", r) for r in ROWS if r["steps"] == 1000 and r["sigma"] == 2.0]


@pytest.mark.parametrize(
    ("name", "row"), DIRECT, ids=lambda v: v if isinstance(v, str) else f"s{v['sigma']}-T{v['steps']}"
)
def test_rows_match_dp_accounting_called_directly(name, row):
    ours = acc.epsilon(_run(row["sigma"], row["q"], row["steps"]), delta=DELTA, accountant=name).value
    assert ours == pytest.approx(_direct(name, row["sigma"], row["q"], row["steps"]), rel=1e-12)


def test_default_accountant_is_pld():
    row = ROWS[0]
    result = acc.epsilon(_run(row["sigma"], row["q"], row["steps"]), delta=DELTA)
    assert result.accountant == "pld"
    assert float(result) == pytest.approx(row["eps_pld"], rel=1e-4)


@pytest.mark.parametrize("name", ["pld", "rdp"])
def test_oracle_calibration(name):
    case = ORACLE["calibration"][0]
    found = acc.calibrate_noise_multiplier(
        lambda s: _run(s, case["q"], case["steps"]),
        target_epsilon=case["target_epsilon"],
        delta=case["delta"],
        tolerance=2e-5,
        accountant=name,
    )
    assert found.accountant == name
    assert found.value == pytest.approx(case[f"sigma_{name}"], rel=1e-4)
    assert found.epsilon <= case["target_epsilon"]


def test_rdp_calibration_matches_dp_accounting_calibrate():
    case = ORACLE["calibration"][0]
    direct = dp_accounting.calibrate_dp_mechanism(
        rdp.RdpAccountant,
        lambda s: dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(case["q"], dp_accounting.GaussianDpEvent(s)), case["steps"]
        ),
        case["target_epsilon"],
        case["delta"],
    )
    ours = acc.calibrate_noise_multiplier(
        lambda s: _run(s, case["q"], case["steps"]),
        target_epsilon=case["target_epsilon"],
        delta=case["delta"],
        tolerance=1e-7,
        accountant="rdp",
    )
    assert ours.value == pytest.approx(direct, rel=1e-4)
    assert math.isfinite(ours.epsilon)
