"""Privacy accounting on dp-accounting: processes, queries, calibration, JSON.

Build a process (``poisson(gaussian(1.0), 0.01)``, ``repeat(step, 1000)``, ``compose(a, b)``), then ask
``epsilon(process, delta=1e-5)`` or ``delta(process, epsilon=8.0)``, for DP-SGD and DP-FTRL processes alike; each
answer says which accountant produced it (PLD by default, RDP on request, Monte Carlo where dp-accounting has no
event). ``calibrate(make_process, budget=Budget.delta(1e-6, epsilon=2.0), parameter="sample_rate")`` finds the
least private value of a parameter that meets a budget. See ``docs/accounting.md``.
"""

from opake_core.accounting.budget import BUDGET_KINDS, Budget, check_delta
from opake_core.accounting.calibration import (
    DEFAULT_RANGES,
    PARAMETERS,
    Calibrated,
    calibrate,
    calibrate_noise_multiplier,
    calibrate_steps,
    stop_step,
)
from opake_core.accounting.fdp import advantage, bayes_risk, beta
from opake_core.accounting.ledger import Ledger
from opake_core.accounting.mf import COMPATIBLE_SAMPLERS, MFProcess, mf_process, sampler_participation
from opake_core.accounting.mf_monte_carlo import BallsInBinsMF, BMinSepMF
from opake_core.accounting.processes import (
    AdaptiveClipping,
    Compose,
    Gaussian,
    Poisson,
    PoissonGroup,
    Process,
    RandomAllocation,
    Repeat,
    TruncatedPoisson,
    WithoutReplacement,
    adaptive_clipping,
    compose,
    contains_without_replacement,
    gaussian,
    is_nonprivate,
    k_out_of_t,
    poisson,
    poisson_group,
    random_allocation,
    repeat,
    to_dp_event,
    truncated_poisson,
    without_replacement,
)
from opake_core.accounting.queries import ACCOUNTANTS, Result, default_adjacency, delta, epsilon
from opake_core.accounting.random_allocation import MonteCarlo
from opake_core.accounting.router_release import moe_aux, moe_aux_multiplier
from opake_core.accounting.serialization import from_json, library_versions, to_json

__all__ = [
    "ACCOUNTANTS",
    "BUDGET_KINDS",
    "COMPATIBLE_SAMPLERS",
    "DEFAULT_RANGES",
    "PARAMETERS",
    "AdaptiveClipping",
    "BMinSepMF",
    "BallsInBinsMF",
    "Budget",
    "Calibrated",
    "Compose",
    "Gaussian",
    "Ledger",
    "MFProcess",
    "MonteCarlo",
    "Poisson",
    "PoissonGroup",
    "Process",
    "RandomAllocation",
    "Repeat",
    "Result",
    "TruncatedPoisson",
    "WithoutReplacement",
    "adaptive_clipping",
    "advantage",
    "bayes_risk",
    "beta",
    "calibrate",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "check_delta",
    "compose",
    "contains_without_replacement",
    "default_adjacency",
    "delta",
    "epsilon",
    "from_json",
    "gaussian",
    "is_nonprivate",
    "k_out_of_t",
    "library_versions",
    "mf_process",
    "moe_aux",
    "moe_aux_multiplier",
    "poisson",
    "poisson_group",
    "random_allocation",
    "repeat",
    "sampler_participation",
    "stop_step",
    "to_dp_event",
    "to_json",
    "truncated_poisson",
    "without_replacement",
]
