"""From what an auditor sees to an audit report: canary scores, the guess sets planned from simulations of the claim,
and the lower bounds of :mod:`opake_core.auditing` next to the run's theoretical epsilon.

Input-space canaries are scored by their loss on the final model (black-box) or by the alignment of each update with
their gradient (white-box); Dirac canaries by the statistics of :mod:`opake_core.auditing.white_box_scores` on their
coordinates (every privatized update, or the final model only). A lower bound above the theoretical epsilon (beyond
the stated false-alarm rate ``1 - confidence``) means the mechanism leaks more than it claims.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.func import grad, vmap

from opake_core import random
from opake_core.auditing import (
    AuditResult,
    FDPAuditResult,
    audit_claim,
    fdp_audit,
    likelihood_ratio_scores,
    max_scores,
    one_run_audit,
    process_tradeoff,
    select_guess_set,
    simulate_dirac_observations,
    sum_scores,
)
from opake_core.errors import ConfigurationError
from opake_torch.auditing.canaries import DiracCanaries

__all__ = [
    "AuditReport",
    "CanaryAuditReport",
    "gradient_scores",
    "loss_scores",
    "planned_guess_sets",
]


def loss_scores(
    loss_fn: Callable[..., torch.Tensor], params: Any, inputs: torch.Tensor, labels: torch.Tensor
) -> np.ndarray:
    """Minus the per-example loss ``loss_fn(params, x, y)`` of every canary (higher = more likely trained on)."""
    with torch.no_grad():
        losses = vmap(loss_fn, in_dims=(None, 0, 0))(params, inputs, labels)
    return -losses.detach().double().cpu().numpy()


def gradient_scores(
    loss_fn: Callable[..., torch.Tensor],
    params_before: Any,
    params_after: Any,
    inputs: torch.Tensor,
    labels: torch.Tensor,
) -> np.ndarray:
    """White-box scores: the cosine between the parameter change and each canary's descent direction at the start.

    Training on a canary moves the parameters along ``-grad loss(canary)``, so included canaries score higher.
    """
    grads = vmap(grad(loss_fn), in_dims=(None, 0, 0))(params_before, inputs, labels)
    delta = {k: (params_after[k] - params_before[k]).detach().double() for k in params_before}
    dots = sum((-grads[k].double() * delta[k]).reshape(len(inputs), -1).sum(1) for k in delta)
    g_norm = torch.sqrt(sum(grads[k].double().square().reshape(len(inputs), -1).sum(1) for k in delta))
    d_norm = math.sqrt(sum(float(v.square().sum()) for v in delta.values())) or 1.0
    return (dots / (g_norm.clamp(min=1e-30) * d_norm)).cpu().numpy()


@dataclass(frozen=True)
class AuditReport:
    """An audit with input-space canaries: the lower bounds next to the run's theoretical epsilon, with the raw
    material.

    Attributes:
        result: the epsilon-point bound of :func:`opake_core.auditing.one_run.one_run_audit`.
        theoretical_epsilon: what the accountant reports for the run.
        scores: ``[m]`` canary scores.
        included: ``[m]`` coins.
        fdp: the f-DP bound of :func:`opake_core.auditing.fdp_test.fdp_audit` (Gaussian curves, the default guess
            sweep) at the same delta and confidence.
    """

    result: AuditResult
    theoretical_epsilon: float
    scores: np.ndarray
    included: np.ndarray
    fdp: FDPAuditResult | None = None

    @property
    def epsilon_lower_bound(self) -> float:
        """The epsilon-point bound (``result.epsilon``); the f-DP one is ``fdp.epsilon``."""
        return self.result.epsilon

    @property
    def consistent(self) -> bool:
        """Whether both lower bounds stay at or below the theoretical epsilon (each may exceed it with probability
        at most ``1 - confidence`` when the run is correct)."""
        fdp = self.fdp.epsilon if self.fdp is not None else 0.0
        return max(self.result.epsilon, fdp) <= self.theoretical_epsilon


DIRAC_SCORES = ("likelihood_ratio", "sum", "max")
SIMULATIONS = 8
"""Simulated runs of the claim that choose the guess set (:func:`~opake_core.auditing.fdp_test.select_guess_set`)."""


@dataclass(frozen=True)
class CanaryAuditReport:
    """A Dirac-canary audit.

    Attributes:
        fdp: the f-DP bound (Gaussian curves) of :func:`opake_core.auditing.fdp_test.fdp_audit`.
        steinke: the epsilon-point bound of :func:`opake_core.auditing.one_run.one_run_audit` on the same scores.
        theoretical_epsilon: what the accountant reports for the claimed mechanism at ``fdp.delta``.
        claim_rejected: whether the claimed mechanism's own curve (its PLD privacy profile) is rejected at
            ``fdp.confidence`` (None when not tested).
        scores: ``[m]``.
        included: ``[m]`` coins.
        observations: ``[T, m]`` privatized canary coordinates in units of the per-step sensitivity (all iterates),
            or None (final model).
        observe: ``"all"`` or ``"final"``.
        score: the score's name.
        claim: the claimed mechanism's :mod:`opake_core.accounting` process (its curve:
            :func:`opake_core.auditing.tradeoff_curves.process_tradeoff`).
        guess_sets: the ``(k_pos, k_neg)`` pairs tested (Bonferroni over them).
        guess_weights: their weights in the correction (set ``g`` at level ``(1 - confidence) w_g / sum(w)``).
        plan: what the simulations that choose guess sets model: ``{"steps", "sample_rate", "noise_multiplier"}``
            of a DP-SGD run equivalent to the claim (:func:`planned_guess_sets`).
    """

    fdp: FDPAuditResult
    steinke: AuditResult
    theoretical_epsilon: float
    claim_rejected: bool | None
    scores: np.ndarray
    included: np.ndarray
    observations: np.ndarray | None
    observe: str
    score: str
    claim: Any = None
    guess_sets: tuple[tuple[int, int], ...] = ()
    plan: dict[str, Any] | None = None
    guess_weights: tuple[float, ...] = ()

    @property
    def epsilon_lower_bound(self) -> float:
        """The f-DP lower bound on epsilon (``fdp.epsilon``)."""
        return self.fdp.epsilon

    @property
    def flagged(self) -> bool:
        """Whether the f-DP lower bound exceeds the theoretical epsilon: the run leaks more than it claims (a
        correct run is flagged with probability at most ``1 - fdp.confidence``)."""
        return self.fdp.flags(self.theoretical_epsilon)


def _check_observe(observe: str, score: str | None) -> str:
    if observe not in ("all", "final"):
        raise ConfigurationError(f"observe must be 'all' (every update) or 'final' (the final model), got {observe!r}.")
    if observe == "final":
        if score not in (None, "sum"):
            raise ConfigurationError(
                f"with observe='final' the score is the canary coordinate's total displacement (score=None or 'sum'), "
                f"got score={score!r}; per-step scores need observe='all'."
            )
        return "sum"
    score = "likelihood_ratio" if score is None else score
    if score not in DIRAC_SCORES:
        raise ConfigurationError(f"score must be one of {DIRAC_SCORES}, got {score!r}.")
    return score


def _dirac_scores(
    score: str, x: np.ndarray, *, noise_multiplier: float, sample_rate: float, signal: Any = 1.0, mask: Any = None
) -> np.ndarray:
    if score == "likelihood_ratio":
        return likelihood_ratio_scores(
            x, noise_multiplier=noise_multiplier, sample_rate=sample_rate, signal=signal, mask=mask
        )
    return sum_scores(x, mask=mask) if score == "sum" else max_scores(x, mask=mask)


GUESS_PLANS = ("tight", "robust")
ROBUST_WEIGHTS = (0.9, 0.1)
"""The level split of the "robust" plan: 90% for the tight set, 10% for the large "in"-only set."""


def planned_guess_sets(
    key: random.Key,
    *,
    plan: str,
    score: str,
    num_canaries: int,
    steps: int,
    sample_rate: float,
    noise_multiplier: float,
) -> tuple[list[tuple[int, int]], list[float]]:
    """The guess sets (and their weights in the Bonferroni correction) to test a run with, chosen from
    :data:`SIMULATIONS` simulated runs of the claim (DP-SGD with Poisson sampling and Dirac canaries). The choice
    uses public inputs only, so it costs no further correction.

    Args:
        key: the simulations' key.
        plan: ``"tight"``: the one set with the largest mean bound on runs of the claim (the tightest bound for a
            correct run); ``"robust"``: that set at 90% of the level and ``(m / 4, 0)``, a large "in"-only set, at
            10% (:data:`ROBUST_WEIGHTS`), which catches leaks that expose some canaries completely (an example left
            unclipped) and that the two-sided guesses dilute. Flag leaks with ``"robust"``.
        score: the score the real audit uses (``"likelihood_ratio"``, ``"sum"`` or ``"max"``).
        num_canaries: ``m``.
        steps: the claimed steps (for DP-FTRL: the rounds of one canary's group).
        sample_rate: the claimed rate (for DP-FTRL: the conditional rate within a group).
        noise_multiplier: the claimed multiplier (for DP-FTRL: that of one round).

    Returns:
        ``(guess_sets, weights)`` for :func:`opake_core.auditing.fdp_test.fdp_audit`.
    """
    if plan not in GUESS_PLANS:
        raise ConfigurationError(f"guess_plan must be one of {GUESS_PLANS}, got {plan!r}.")
    simulated = []
    for i in range(SIMULATIONS):
        x, included = simulate_dirac_observations(
            random.fold_in(key, "opake.audit.plan", i),
            num_canaries=num_canaries,
            steps=steps,
            sample_rate=sample_rate,
            noise_multiplier=noise_multiplier,
        )
        simulated.append(
            (_dirac_scores(score, x, noise_multiplier=noise_multiplier, sample_rate=sample_rate), included)
        )
    best = select_guess_set(simulated)
    if plan == "tight":
        return [best], [1.0]
    return [best, (max(1, num_canaries // 4), 0)], list(ROBUST_WEIGHTS)


def _finish(
    scores: np.ndarray,
    canaries: DiracCanaries,
    *,
    plan_key: random.Key,
    score: str,
    claim: Any,
    theoretical: float,
    delta: float,
    confidence: float,
    guess_sets: Sequence[tuple[int, int]] | None,
    guess_plan: str,
    simulation: dict[str, Any],
    claim_test: bool,
    observations: np.ndarray | None,
    observe: str,
) -> CanaryAuditReport:
    weights = None
    if guess_sets is None:
        guess_sets, weights = planned_guess_sets(
            plan_key, plan=guess_plan, score=score, num_canaries=len(canaries), **simulation
        )
    fdp = fdp_audit(
        scores, canaries.included, delta=delta, confidence=confidence, guess_sets=guess_sets, weights=weights
    )
    steinke = one_run_audit(scores, canaries.included, delta=delta, confidence=confidence)
    rejected = None
    if claim_test:
        test = audit_claim(
            scores,
            canaries.included,
            tradeoff=process_tradeoff(claim),
            confidence=confidence,
            guess_sets=guess_sets,
            weights=weights,
        )
        rejected = test.rejected
    return CanaryAuditReport(
        fdp,
        steinke,
        float(theoretical),
        rejected,
        scores,
        canaries.included,
        observations,
        observe,
        score,
        claim,
        tuple(tuple(g) for g in guess_sets),
        dict(simulation),
        tuple(weights) if weights is not None else (1.0,) * len(guess_sets),
    )
