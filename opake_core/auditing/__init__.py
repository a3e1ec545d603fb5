"""Privacy auditing: statistics that test a training run against its privacy claim.

Modules, one idea each:

- :mod:`~opake_core.auditing.one_run`: the one-run epsilon lower bound of Steinke, Nasr and Jagielski (2023), and
  the canaries' coins and guesses;
- :mod:`~opake_core.auditing.tradeoff_curves`: f-DP trade-off curves (Gaussian, from a privacy profile, claimed by
  an accounting process);
- :mod:`~opake_core.auditing.fdp_test`: the one-run f-DP test of Mahloujifar, Melis and Chaudhuri (2025) and the
  audits from canary scores;
- :mod:`~opake_core.auditing.white_box_scores`: canary scores from white-box observations;
- :mod:`~opake_core.auditing.noise_scale`: the per-leaf test of the noise against the claimed standard deviation;
- :mod:`~opake_core.auditing.accounting_check`: the accountant's releases against the steps that ran.

Everything here is a pure function on numbers; the training side lives in :mod:`opake_torch.auditing`.
"""

from opake_core.auditing.accounting_check import AccountingReport, check_accounting, claimed_releases
from opake_core.auditing.fdp_test import (
    MU_MAX,
    ClaimTest,
    FDPAuditResult,
    audit_claim,
    default_guess_sets,
    fdp_audit,
    mu_lower_bound,
    rejects,
    select_guess_set,
)
from opake_core.auditing.noise_scale import (
    LeafNoise,
    NoiseScaleReport,
    claimed_std,
    leaf_noise_test,
    min_coordinates,
    sum_squares,
    whiten,
)
from opake_core.auditing.one_run import (
    AuditResult,
    coin_flips,
    count_correct,
    epsilon_lower_bound,
    guesses,
    one_run_audit,
    p_value,
)
from opake_core.auditing.tradeoff_curves import (
    gaussian_delta,
    gaussian_epsilon,
    gaussian_mu,
    gaussian_tradeoff,
    process_tradeoff,
    profile_tradeoff,
)
from opake_core.auditing.white_box_scores import (
    likelihood_ratio_scores,
    matrix_projections,
    max_scores,
    simulate_dirac_observations,
    sum_scores,
)

__all__ = [
    "MU_MAX",
    "AccountingReport",
    "AuditResult",
    "ClaimTest",
    "FDPAuditResult",
    "LeafNoise",
    "NoiseScaleReport",
    "audit_claim",
    "check_accounting",
    "claimed_releases",
    "claimed_std",
    "coin_flips",
    "count_correct",
    "default_guess_sets",
    "epsilon_lower_bound",
    "fdp_audit",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "gaussian_tradeoff",
    "guesses",
    "leaf_noise_test",
    "likelihood_ratio_scores",
    "matrix_projections",
    "max_scores",
    "min_coordinates",
    "mu_lower_bound",
    "one_run_audit",
    "p_value",
    "process_tradeoff",
    "profile_tradeoff",
    "rejects",
    "select_guess_set",
    "simulate_dirac_observations",
    "sum_scores",
    "sum_squares",
    "whiten",
]
