"""One-run audits around the core step: train once with :func:`opake_core.step.dp_sgd` or
:func:`opake_core.step.dp_ftrl` (or a step under test) on the data plus the included canaries, observe, score, and
report the lower bounds next to the claim's epsilon."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from opake_core import accounting, mf, optim, random, sampling
from opake_core.auditing import fdp_audit, matrix_projections, one_run_audit
from opake_core.clipping.engine import Engine
from opake_core.errors import ConfigurationError
from opake_core.mf import MinSepParticipation
from opake_core.step import dp_ftrl, dp_sgd
from opake_torch.auditing.canaries import (
    CANARY_LEAF,
    Canaries,
    DiracCanaries,
    canary_rows,
    with_canary_block,
    with_dirac_canaries,
)
from opake_torch.auditing.dirac_engine import DiracGradients
from opake_torch.auditing.scoring import (
    AuditReport,
    CanaryAuditReport,
    _check_observe,
    _dirac_scores,
    _finish,
    gradient_scores,
    loss_scores,
)

__all__ = [
    "Observer",
    "audit_core_run",
    "audit_dirac_run",
]


def _alignment_over_steps(
    loss_fn: Callable[..., torch.Tensor], iterates: list[dict[str, torch.Tensor]], canaries: Canaries
) -> np.ndarray:
    """Sum over steps of the cosine between update ``t`` and each canary's descent direction at ``theta_t``."""
    total = np.zeros(len(canaries))
    for before, after in itertools.pairwise(iterates):
        total += gradient_scores(loss_fn, before, after, canaries.inputs, canaries.labels)
    return total


def audit_core_run(
    loss_fn: Callable[..., torch.Tensor],
    params: Any,
    data: tuple[torch.Tensor, torch.Tensor],
    canaries: Canaries,
    *,
    key: random.Key,
    noise_multiplier: float,
    clipping_norm: float,
    steps: int,
    sample_rate: float = 1.0,
    optimizer: Any = None,
    strategy: Any = None,
    delta: float = 1e-5,
    score: str = "loss",
    observe: str = "final",
    confidence: float = 0.95,
    k: int | Sequence[int] | None = None,
) -> AuditReport:
    """Train once on ``data`` plus the included input-space canaries with the core step, then audit.

    Args:
        loss_fn: ``loss_fn(params, x, y) -> scalar`` for one example.
        params: initial parameters (a dict of tensors).
        data: ``(inputs [n, ...], labels [n])``, always included.
        canaries: from :func:`~opake_torch.auditing.canaries.make_canaries`.
        key: the run's key (sampling and noise streams are folded from it).
        noise_multiplier: ``z``; 0 with ``clipping_norm=math.inf`` is a non-private run (theoretical epsilon inf).
        clipping_norm: per-example bound.
        steps: number of steps.
        sample_rate: Poisson rate (DP-SGD). With ``strategy`` every step uses the whole dataset.
        optimizer: an :mod:`opake_core.optim` optimizer (default SGD, lr 0.5; non-private runs need ``non_private``).
        strategy: a DP-FTRL strategy (e.g. ``opake_core.mf.band_mf(bands=4)``): correlated noise with the sensitivity
            of every example participating in every step (``MinSepParticipation(1)``), so the whole run is one
            Gaussian mechanism with multiplier ``z`` (theoretical epsilon at ``delta``).
        delta: the audit's delta.
        confidence: the confidence of both bounds.
        k: guess counts of the epsilon-point bound (see :func:`opake_core.auditing.one_run.one_run_audit`).
        score: ``"loss"`` (minus the final loss), ``"loss_drop"`` (the loss at the start minus the final loss) or
            ``"gradient"`` (alignment of the parameter change with the canary's descent direction).
        observe: ``"final"`` (only the final model) or ``"all"`` (every iterate; ``score="gradient"`` only: the
            alignments of the individual updates, summed).
    """
    if score not in ("loss", "loss_drop", "gradient"):
        raise ConfigurationError(f"score must be 'loss', 'loss_drop' or 'gradient', got {score!r}.")
    if observe not in ("final", "all"):
        raise ConfigurationError(f"observe must be 'final' or 'all', got {observe!r}.")
    if observe == "all" and score != "gradient":
        raise ConfigurationError(
            f"observe='all' scores the alignment of every update with the canary's gradient: use score='gradient' "
            f"(got score={score!r}), or observe='final' for loss scores."
        )
    x = torch.cat([data[0], canaries.inputs[torch.as_tensor(canaries.included)].to(data[0].dtype)])
    y = torch.cat([data[1], canaries.labels[torch.as_tensor(canaries.included)]])
    n = len(x)
    private = noise_multiplier > 0
    if optimizer is None:
        optimizer = optim.sgd(0.5, non_private=not private)
    start = dict(params)
    current, opt_state = dict(params), optimizer.init(params)
    iterates = [start]
    noise_key = random.fold_in(key, "opake.audit.noise")
    common = {"optimizer": optimizer, "clipping_norm": clipping_norm, "noise_multiplier": noise_multiplier}
    if strategy is None:
        sampler = sampling.poisson(dataset_size=n, sample_rate=sample_rate)
        step_fn, dp_state = dp_sgd(loss_fn, expected_batch_size=sampler.expected_batch_size, key=noise_key, **common)
        sampler_state, sampler_key = sampler.init(), random.fold_in(key, "opake.audit.sampler")
        for _ in range(steps):
            idx, sampler_state = sampler.sample(sampler_key, sampler_state)
            idx_t = torch.as_tensor(idx, dtype=torch.long)
            current, opt_state, dp_state, _ = step_fn(current, opt_state, dp_state, (x[idx_t], y[idx_t]))
            if observe == "all":
                iterates.append(current)
        theoretical = (
            accounting.epsilon(sampler.process(noise_multiplier, steps), delta=delta).value if private else math.inf
        )
    else:
        step_fn, dp_state = dp_ftrl(
            loss_fn,
            params=params,
            strategy=strategy,
            n_steps=steps,
            participation=MinSepParticipation(1),
            expected_batch_size=float(n),
            key=noise_key,
            **common,
        )
        for _ in range(steps):
            current, opt_state, dp_state, _ = step_fn(current, opt_state, dp_state, (x, y))
            if observe == "all":
                iterates.append(current)
        theoretical = (
            accounting.epsilon(accounting.gaussian(noise_multiplier), delta=delta).value if private else math.inf
        )
    if observe == "all":
        scores = _alignment_over_steps(loss_fn, iterates, canaries)
    elif score == "loss":
        scores = loss_scores(loss_fn, current, canaries.inputs, canaries.labels)
    elif score == "loss_drop":
        before = loss_scores(loss_fn, start, canaries.inputs, canaries.labels)
        scores = loss_scores(loss_fn, current, canaries.inputs, canaries.labels) - before
    else:
        scores = gradient_scores(loss_fn, start, current, canaries.inputs, canaries.labels)
    result = one_run_audit(scores, canaries.included, delta=delta, confidence=confidence, k=k)
    fdp = fdp_audit(scores, canaries.included, delta=delta, confidence=confidence)
    return AuditReport(result, float(theoretical), scores, canaries.included, fdp)


class Observer:
    """An optimizer that records what the all-iterates auditor sees: the privatized (noised) canary block of every
    step, before the optimizer transforms it. ``init`` and ``update`` are the wrapped optimizer's.

    Attributes:
        rows: one ``[m]`` float64 array per step.
    """

    def __init__(self, optimizer: Any, leaf: str = CANARY_LEAF) -> None:
        self.optimizer, self.leaf, self.rows = optimizer, leaf, []

    def init(self, params: Any) -> Any:
        return self.optimizer.init(params)

    def update(self, updates: Any, state: Any, *, params: Any = None) -> tuple[Any, Any]:
        self.rows.append(updates.value[self.leaf].detach().double().cpu().numpy().copy())
        return self.optimizer.update(updates, state, params=params)


def audit_dirac_run(
    loss_fn: Callable[..., torch.Tensor],
    params: dict[str, torch.Tensor],
    data: tuple[torch.Tensor, ...],
    canaries: DiracCanaries,
    *,
    key: random.Key,
    noise_multiplier: float,
    clipping_norm: float,
    steps: int,
    sample_rate: float,
    strategy: Any = None,
    optimizer: Any = None,
    delta: float = 1e-5,
    observe: str = "all",
    score: str | None = None,
    confidence: float = 0.95,
    guess_sets: Sequence[tuple[int, int]] | None = None,
    guess_plan: str = "robust",
    mechanism: Callable[..., tuple[Any, Any]] | None = None,
    claim_test: bool = False,
) -> CanaryAuditReport:
    """Train once with the core step on ``data`` plus Dirac canary slots, observe the canary block, audit.

    The claim is DP-SGD with Poisson sampling at rate ``sample_rate`` (or, with ``strategy``, DP-FTRL with cyclic
    Poisson sampling over the strategy's bands) with multiplier ``noise_multiplier`` for ``steps`` steps; its
    epsilon at ``delta`` is the theoretical epsilon. ``mechanism`` is the step under test (default: the library's
    ``dp_sgd`` or ``dp_ftrl`` with those arguments): a researcher who changes a mechanism passes theirs and keeps
    the claim.

    Args:
        loss_fn: ``loss_fn(params, *example) -> scalar`` for one real example (it never sees the canary block).
        params: initial parameters (a dict of tensors, without the canary block).
        data: ``(inputs [n, ...], labels [n], ...)``, always included.
        canaries: from :func:`~opake_torch.auditing.canaries.dirac_canaries` (``gradient_norm >= clipping_norm``).
        key: the run's key: sampler, noise and the simulations that choose the guess set are folded from it.
        noise_multiplier: the claimed ``z > 0``.
        clipping_norm: the per-example bound ``C``.
        steps: ``T``.
        sample_rate: the expected fraction of the ``n + m`` rows per step.
        strategy: a DP-FTRL strategy (``opake_core.mf.band_mf(bands=b)``), optimized for ``T``; None: DP-SGD.
        optimizer: an :mod:`opake_core.optim` optimizer (default ``sgd(0.1)``).
        delta: the delta of the theoretical epsilon and of the lower bound.
        observe: ``"all"`` (every privatized update: the white-box, all-iterates threat model) or ``"final"`` (the
            final model only: the canary coordinate's total displacement).
        score: with ``observe="all"``: ``"likelihood_ratio"`` (default, the Neyman-Pearson statistic of the
            claimed mechanism; DP-FTRL observations are decorrelated with the strategy matrix first), ``"sum"`` or
            ``"max"``.
        confidence: of every bound.
        guess_sets: ``(k_pos, k_neg)`` pairs to sweep (equal-weight Bonferroni); None: chosen in advance from
            simulations of the claimed mechanism, as ``guess_plan`` says
            (:func:`~opake_torch.auditing.scoring.planned_guess_sets`).
        guess_plan: ``"robust"`` (default) or ``"tight"`` (:func:`~opake_torch.auditing.scoring.planned_guess_sets`).
        mechanism: ``mechanism(loss, *, optimizer, expected_batch_size, key, engine) -> (step_fn, dp_state)``, the
            step under test; ``engine`` (a :class:`~opake_torch.auditing.dirac_engine.DiracGradients` engine) goes to
            its ``dp_sgd``, ``dp_ftrl`` or ``clipped_grad`` so that the canaries cost memory in proportion to the
            batch (ignoring it is correct, at a cost in proportion to the batch times the canaries).
        claim_test: also test the claimed mechanism's exact trade-off curve (its PLD profile, about a second).

    Returns:
        A :class:`~opake_torch.auditing.scoring.CanaryAuditReport`.
    """
    score = _check_observe(observe, score)
    if not canaries.gradient_norm >= clipping_norm:
        raise ConfigurationError(
            f"a Dirac canary's gradient_norm ({canaries.gradient_norm}) must be at least clipping_norm "
            f"({clipping_norm}), so that a correct run clips it to the bound; build the canaries with a larger norm."
        )
    z = float(noise_multiplier)
    if not z > 0:
        raise ConfigurationError(
            f"noise_multiplier must be > 0 for an audit against a claim, got {noise_multiplier!r}."
        )
    rows = canary_rows(data, canaries)
    n_rows = len(rows[0])
    loss = with_dirac_canaries(loss_fn, canaries)
    start = with_canary_block(params, canaries)
    observer = Observer(optimizer if optimizer is not None else optim.sgd(0.1))
    noise_key = random.fold_in(key, "opake.audit.noise")
    concrete = None
    if strategy is None:
        sampler = sampling.poisson(dataset_size=n_rows, sample_rate=sample_rate)
        claim = sampler.process(z, steps)
    else:
        concrete = mf.optimize(strategy, steps)
        bands = mf.band_count(concrete, steps)
        sampler = sampling.cyclic_poisson(dataset_size=n_rows, sample_rate=sample_rate, bands=bands)
        claim = accounting.mf_process(concrete, sampler=sampler, noise_multiplier=z, n_steps=steps)
    batch_size = sampler.expected_batch_size
    engine = Engine(gradients=DiracGradients(loss_fn, canaries))
    if mechanism is None:
        common = {"optimizer": observer, "expected_batch_size": batch_size, "key": noise_key, "engine": engine}
        if concrete is None:
            step_fn, dp_state = dp_sgd(loss, clipping_norm=clipping_norm, noise_multiplier=z, **common)
        else:
            step_fn, dp_state = dp_ftrl(
                loss,
                params=start,
                strategy=concrete,
                n_steps=steps,
                clipping_norm=clipping_norm,
                noise_multiplier=z,
                **common,
            )
    else:
        step_fn, dp_state = mechanism(
            loss, optimizer=observer, expected_batch_size=batch_size, key=noise_key, engine=engine
        )
    current, opt_state = start, observer.init(start)
    sampler_state, sampler_key = sampler.init(), random.fold_in(key, "opake.audit.sampler")
    for _ in range(steps):
        idx, sampler_state = sampler.sample(sampler_key, sampler_state)
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        current, opt_state, dp_state, _ = step_fn(current, opt_state, dp_state, tuple(t[idx_t] for t in rows))
    theoretical = accounting.epsilon(claim, delta=delta).value
    n_real = n_rows - len(canaries)
    if observe == "final":
        x = None
        scores = -(current[CANARY_LEAF] - start[CANARY_LEAF]).detach().double().cpu().numpy()
        simulation = {"steps": steps, "sample_rate": _claimed_rate(sampler), "noise_multiplier": z}
        if concrete is not None:
            simulation["steps"] = math.ceil(steps / sampler.bands)
    else:
        x = np.stack(observer.rows) / (clipping_norm / batch_size)
        if concrete is None:
            scores = _dirac_scores(score, x, noise_multiplier=z, sample_rate=sampler.sample_rate)
            simulation = {"steps": steps, "sample_rate": sampler.sample_rate, "noise_multiplier": z}
        else:
            projections, signal = matrix_projections(x, mf.materialize(concrete, steps))
            z1 = z * mf.sensitivity(concrete, steps) / float(np.linalg.norm(mf.coefficients(concrete, steps)))
            mask = _cyclic_mask(sampler, sampler_key, steps, n_real, len(canaries))
            q = sampler.conditional_rate
            scores = _dirac_scores(score, projections, noise_multiplier=z1, sample_rate=q, signal=signal, mask=mask)
            simulation = {"steps": math.ceil(steps / sampler.bands), "sample_rate": q, "noise_multiplier": z1}
    return _finish(
        scores,
        canaries,
        plan_key=random.fold_in(key, "opake.audit.plan"),
        score=score,
        claim=claim,
        theoretical=theoretical,
        delta=delta,
        confidence=confidence,
        guess_sets=guess_sets,
        guess_plan=guess_plan,
        simulation=simulation,
        claim_test=claim_test,
        observations=x,
        observe=observe,
    )


def _claimed_rate(sampler: Any) -> float:
    return sampler.conditional_rate if hasattr(sampler, "conditional_rate") else sampler.sample_rate


def _cyclic_mask(sampler: Any, key: random.Key, steps: int, n_real: int, m: int) -> np.ndarray:
    """``[T, m]``: whether canary slot ``j`` (row ``n_real + j``) belongs to the group that step ``t`` samples from."""
    group_of = np.full(n_real + m, -1, dtype=np.int64)
    for g in range(sampler.bands):
        group_of[sampler.group(key, g)] = g
    canary_groups = group_of[n_real:]
    return (np.arange(steps)[:, None] % sampler.bands) == canary_groups[None, :]
