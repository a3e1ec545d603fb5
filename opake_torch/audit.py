"""The training side of one-run privacy audits: canaries, runs, observations, scores.

The statistics live in the core: :mod:`opake_core.audit` (Steinke, Nasr and Jagielski 2023, an epsilon point) and
:mod:`opake_core.fdp_audit` (Mahloujifar, Melis and Chaudhuri 2025, Gaussian trade-off curves). An audit:

1. draws a fair coin per canary (:func:`opake_core.audit.coin_flips`) and puts the heads in the training data;
2. trains once (a core DP-SGD or DP-FTRL loop, or a :class:`~opake_torch.transformers.DPTrainer`);
3. scores every canary from what the threat model lets the auditor see;
4. turns the scores into lower bounds and reports them next to the theoretical epsilon of the run.

Two kinds of canaries and two threat models (Nasr et al., "Tight Auditing of Differentially Private Machine
Learning", USENIX Security 2023):

* input-space canaries (:func:`make_canaries`): examples with random inputs and random labels, scored by their loss on
  the final model (black-box; :func:`audit_core_run`, :func:`audit_trainer`) or by the alignment of each update with
  their gradient (white-box, every update);
* Dirac gradient canaries (:func:`dirac_canaries`): canary ``j``'s gradient is ``gradient_norm * e_j`` on a parameter
  block that the real loss never touches (:data:`CANARY_LEAF`), so each canary has a coordinate of its own and the
  canaries do not interfere. Slots of excluded canaries stay in the data with a zero gradient (the zero-out
  neighbour, which for Poisson sampling is the same as removing the example), so the data set, and with it the
  sampler, does not depend on the coins. :func:`audit_dirac_run` (the core step) and :func:`audit_trainer_dirac`
  (``DPTrainer``) observe either every privatized update (all iterates) or only the final model. The core step's
  engine, :class:`DiracGradients`, writes the canaries' per-example gradients down instead of materializing them,
  so a step costs in proportion to the batch, not the batch times the canaries.

A lower bound above the theoretical epsilon (beyond the stated false-alarm rate ``1 - confidence``) means the
mechanism leaks more than it claims. A correct private run gives a bound below its epsilon; a non-private run on
memorizable canaries gives a clearly positive one.

Scope: the Dirac canaries see only their own block, and the audit tests the mechanism against the claim it is given.
Noise missing on the real parameters, or an accountant that counts other steps than the ones that ran, passes it;
:mod:`opake_torch.audit_scope` checks both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import torch
from torch.func import grad, vmap

from opake_core import accounting, mf, optim, random, sampling
from opake_core.audit import AuditResult, coin_flips, one_run_audit
from opake_core.clipping.engine import VMAP, Engine
from opake_core.clipping.engine import example_grad as opake_example_grad
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.fdp_audit import (
    FDPAuditResult,
    audit_claim,
    fdp_audit,
    likelihood_ratio_scores,
    matrix_projections,
    max_scores,
    process_tradeoff,
    select_guess_set,
    simulate_dirac_observations,
    sum_scores,
)
from opake_core.mf import MinSepParticipation
from opake_core.step import dp_ftrl, dp_sgd

__all__ = [
    "CANARY_FIELD",
    "CANARY_LEAF",
    "CANARY_WEIGHT",
    "AuditReport",
    "Canaries",
    "CanaryAuditReport",
    "DiracCanaries",
    "DiracGradients",
    "Observer",
    "audit_core_run",
    "audit_dirac_run",
    "audit_trainer",
    "audit_trainer_dirac",
    "canary_rows",
    "dirac_canaries",
    "gradient_scores",
    "loss_scores",
    "make_canaries",
    "planned_guess_sets",
    "with_canary_block",
    "with_dirac_canaries",
]

CANARY_STREAM = "opake.audit.canaries"


@dataclass(frozen=True)
class Canaries:
    """Canary examples and their coins.

    Attributes:
        inputs: ``[m, ...]`` float tensor.
        labels: ``[m]`` int64 tensor.
        included: ``[m]`` bool array, the coins (True = in the training set).
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    included: np.ndarray

    def __len__(self) -> int:
        return len(self.included)


def make_canaries(
    *, key: random.Key, num_canaries: int, num_features: int, num_classes: int, scale: float = 1.0
) -> Canaries:
    """Memorizable canaries: Gaussian inputs (std ``scale``) with uniformly random labels, and their coins.

    Inputs and labels come from ``fold_in(key, CANARY_STREAM)``, the coins from
    :func:`opake_core.audit.coin_flips` with the same ``key``.
    """
    for name, value in (("num_canaries", num_canaries), ("num_features", num_features), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}.")
    gen = random.numpy_generator(random.fold_in(key, CANARY_STREAM))
    inputs = torch.as_tensor(gen.normal(0.0, scale, (num_canaries, num_features)), dtype=torch.float32)
    labels = torch.as_tensor(gen.integers(0, num_classes, num_canaries), dtype=torch.long)
    return Canaries(inputs, labels, coin_flips(key, num_canaries))


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
        result: the epsilon-point bound of :func:`opake_core.audit.one_run_audit`.
        theoretical_epsilon: what the accountant reports for the run.
        scores: ``[m]`` canary scores.
        included: ``[m]`` coins.
        fdp: the f-DP bound of :func:`opake_core.fdp_audit.fdp_audit` (Gaussian curves, the default guess sweep) at
            the same delta and confidence.
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
        canaries: from :func:`make_canaries`.
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
        k: guess counts of the epsilon-point bound (see :func:`opake_core.audit.one_run_audit`).
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


def audit_trainer(
    make_trainer: Callable[[list[Any]], Any],
    train_dataset: Sequence[Any],
    canaries: Sequence[Any],
    *,
    key: random.Key,
    delta: float | None = None,
    confidence: float = 0.95,
    k: int | Sequence[int] | None = None,
) -> AuditReport:
    """Run the one-run audit around a :class:`~opake_torch.transformers.DPTrainer` with input-space canaries.

    Args:
        make_trainer: ``dataset -> DPTrainer`` (build it with ``privacy_accounting=True`` so that the theoretical
            epsilon is reported; a non-private run reports inf).
        train_dataset: the examples always included (a sequence of dicts).
        canaries: candidate examples (dicts like the training rows); each is included with probability 1/2.
        key: drives the coins (:func:`opake_core.audit.coin_flips`).
        delta: the audit's delta; defaults to the delta the trainer resolved.
        confidence: see :func:`opake_core.audit.one_run_audit`.
        k: see :func:`opake_core.audit.one_run_audit`.

    Scores are minus each canary's per-example loss under the trained model (``trainer.compute_per_example_loss``,
    so a custom objective is scored by its own loss): the black-box, final-model threat model.
    """
    canaries = list(canaries)
    if len(canaries) < 2:
        raise ConfigurationError(f"the audit needs at least 2 canaries, got {len(canaries)}; use hundreds.")
    included = coin_flips(key, len(canaries))
    dataset = list(train_dataset) + [c for c, inc in zip(canaries, included, strict=True) if inc]
    trainer = make_trainer(dataset)
    output = trainer.train()
    params = {name: p.detach() for name, p in trainer.model.named_parameters() if p.requires_grad}
    batch = trainer._batch(canaries, np.arange(len(canaries)))
    with torch.no_grad():
        losses = vmap(trainer.compute_per_example_loss, in_dims=(None, 0))(params, batch)
    scores = -losses.detach().double().cpu().numpy()
    resolved_delta = trainer.state.privacy_resolved_delta if delta is None else delta
    theoretical = output.metrics.get("privacy_epsilon")
    if theoretical is None:
        theoretical = math.inf if trainer.state.privacy_resolved_noise_multiplier == 0 else math.nan
    result = one_run_audit(scores, included, delta=float(resolved_delta), confidence=confidence, k=k)
    fdp = fdp_audit(scores, included, delta=float(resolved_delta), confidence=confidence)
    return AuditReport(result, float(theoretical), scores, included, fdp)


# -- Dirac gradient canaries -------------------------------------------------------------------------------------------

CANARY_LEAF = "opake_audit_canaries"
"""The name of the parameter block of Dirac canaries: ``[m]`` coordinates, one per canary, that real data never
touch."""
CANARY_WEIGHT = f"{CANARY_LEAF}.weight"
"""The trainable name of the canary block in a :func:`audit_trainer_dirac` run: an ``nn.Embedding`` of ``m + 1``
rows of width 1 on the model (row ``j`` is canary ``j``; row ``m``, the padding index, takes the other rows)."""
CANARY_FIELD = "opake_canary"
"""The dataset column (trainer) or last example tensor (core step) that marks a row: :data:`REAL_ROW` for a real
example, :data:`EMPTY_SLOT` for an excluded canary's slot, ``j >= 0`` for included canary ``j``."""
REAL_ROW = -1
EMPTY_SLOT = -2
DIRAC_SCORES = ("likelihood_ratio", "sum", "max")
SIMULATIONS = 8
"""Simulated runs of the claim that choose the guess set (:func:`~opake_core.fdp_audit.select_guess_set`)."""


@dataclass(frozen=True)
class DiracCanaries:
    """Dirac gradient canaries: canary ``j``'s gradient is ``gradient_norm * e_j`` on :data:`CANARY_LEAF`.

    Attributes:
        included: ``[m]`` bool, the coins.
        gradient_norm: the L2 norm of a canary's gradient before clipping (at least the clipping bound, so that a
            correct run clips it to exactly the bound; a much larger norm makes a skipped clip visible).
    """

    included: np.ndarray
    gradient_norm: float

    def __len__(self) -> int:
        return len(self.included)

    @property
    def slots(self) -> np.ndarray:
        """``[m]`` int64: ``j`` for included canary ``j``, :data:`EMPTY_SLOT` for an excluded one."""
        return np.where(self.included, np.arange(len(self.included)), EMPTY_SLOT).astype(np.int64)


def dirac_canaries(*, key: random.Key, num_canaries: int, gradient_norm: float) -> DiracCanaries:
    """``num_canaries`` Dirac gradient canaries with coins from :func:`opake_core.audit.coin_flips` (same ``key``)."""
    if isinstance(num_canaries, bool) or not isinstance(num_canaries, int) or num_canaries < 2:
        raise ConfigurationError(f"num_canaries must be an int >= 2, got {num_canaries!r}; use 1,000 or more.")
    if isinstance(gradient_norm, bool) or not isinstance(gradient_norm, int | float) or not gradient_norm > 0:
        raise ConfigurationError(f"gradient_norm must be a positive number, got {gradient_norm!r}.")
    return DiracCanaries(coin_flips(key, num_canaries), float(gradient_norm))


def with_canary_block(params: dict[str, torch.Tensor], canaries: DiracCanaries) -> dict[str, torch.Tensor]:
    """``params`` plus the zero-initialized canary block ``[m]`` under :data:`CANARY_LEAF` (dtype and device of the
    first parameter)."""
    if not isinstance(params, dict) or not params:
        raise InputTypeError(f"params must be a non-empty dict of tensors, got {type(params).__name__}.")
    if CANARY_LEAF in params:
        raise ConfigurationError(f"params already hold {CANARY_LEAF!r}; pass the parameters without the canary block.")
    first = next(iter(params.values()))
    return {**params, CANARY_LEAF: torch.zeros(len(canaries), dtype=first.dtype, device=first.device)}


def with_dirac_canaries(loss_fn: Callable[..., torch.Tensor], canaries: DiracCanaries) -> Callable[..., torch.Tensor]:
    """The per-example loss with Dirac canaries: ``loss(params, *example, slot)``.

    ``slot`` (an int64 scalar, the last element of an example) is :data:`REAL_ROW` for a real example, whose loss is
    ``loss_fn(params, *example)`` and whose gradient on the canary block is zero; :data:`EMPTY_SLOT` for an excluded
    canary (loss and gradient zero); ``j`` for included canary ``j``, whose loss is ``gradient_norm *
    params[CANARY_LEAF][j]`` (gradient ``gradient_norm * e_j``, zero elsewhere). Runs under ``vmap(grad)``.
    """
    m, scale = len(canaries), canaries.gradient_norm

    def loss(params: dict[str, torch.Tensor], *example: torch.Tensor) -> torch.Tensor:
        *inputs, slot = example
        real = loss_fn(params, *inputs)
        block = params[CANARY_LEAF]
        hit = (torch.arange(m, device=block.device) == slot).to(block.dtype)
        return torch.where(slot == REAL_ROW, real, torch.zeros_like(real)) + scale * (block * hit).sum()

    return loss


@dataclass(frozen=True)
class DiracGradients:
    """The ``gradients`` of an :class:`~opake_core.clipping.Engine` for the loss of :func:`with_dirac_canaries`
    (``Engine(gradients=DiracGradients(loss_fn, canaries))``): the real leaves' per-example gradients come from
    ``inner`` on the real rows' loss (``loss_fn``, zero on canary slots), and the canary block's are written down,
    ``gradient_norm * e_j`` for included canary ``j`` and zero for every other row, instead of being materialized
    ``[rows, m]`` by ``vmap(grad)``. The clipping rule, the scaled sum and everything after them are the library's
    own; the clipped sum equals the default engine's (the canary coordinates bit for bit), at a cost that grows with
    the batch, not with the batch times the number of canaries.

    Args:
        loss_fn: ``loss_fn(params, *example)`` for one real example, as given to :func:`with_dirac_canaries`.
        canaries: the canaries of that loss.
        inner: the engine's ``gradients`` for the real leaves (default: ``vmap(grad)``).
    """

    loss_fn: Callable[..., torch.Tensor]
    canaries: DiracCanaries
    inner: Callable[..., tuple[Any, Any]] = VMAP.gradients

    def __call__(self, example_grad: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]) -> Any:
        params, *batch, slots = args
        if not isinstance(params, dict) or CANARY_LEAF not in params or batch_argnums != tuple(range(1, len(args))):
            raise ConfigurationError(
                "DiracGradients serves the loss of with_dirac_canaries: loss(params, *example, slot) with the "
                f"parameters (a dict holding {CANARY_LEAF!r}) first and every other argument batched."
            )
        real = {k: v for k, v in params.items() if k != CANARY_LEAF}
        real_grad = opake_example_grad(_real_rows_loss(self.loss_fn), 0, False)
        grads, values = self.inner(real_grad, (real, *batch, slots), batch_argnums)
        block = params[CANARY_LEAF]
        leaves = optree.tree_leaves(params)
        position = next(i for i, leaf in enumerate(leaves) if leaf is block)
        included = slots >= 0
        norm = self.canaries.gradient_norm
        values = values + torch.where(included, norm * block[slots.clamp(min=0)], 0.0).to(values.dtype)
        return _WithCanaryBlock(grads, position, slots, norm), values


def _real_rows_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(params: dict[str, torch.Tensor], *example: torch.Tensor) -> torch.Tensor:
        *inputs, slot = example
        real = loss_fn(params, *inputs)
        return torch.where(slot == REAL_ROW, real, torch.zeros_like(real))

    return loss


class _WithCanaryBlock:
    """The real leaves' per-example gradients with the canary block inserted at leaf ``position``: row ``i``'s
    canary gradient is ``norm * e_{slot_i}`` for an included canary's row (``slot_i >= 0``), zero otherwise."""

    def __init__(self, real: Any, position: int, slots: torch.Tensor, norm: float) -> None:
        self.real, self.position, self.slots, self.norm = real, position, slots, norm

    def squared_norms(self) -> torch.Tensor:
        rows = self.real.squared_norms()
        canary = torch.where(self.slots >= 0, self.norm**2, 0.0).to(torch.float64)
        return torch.cat([rows[: self.position], canary[None], rows[self.position :]])

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        k = self.position
        block = sums[k]
        self.real.add_scaled({d: _without_row(s, k) for d, s in scales.items()}, sums[:k] + sums[k + 1 :])
        scale = scales[block.dtype][k]
        norm = torch.full_like(scale, self.norm)  # the canary's gradient entry in the sum's dtype, then scaled
        contribution = torch.where(self.slots >= 0, norm * scale, 0.0)  # a row holds one canary at most
        block.index_add_(0, self.slots.clamp(min=0), contribution)


def _without_row(rows: torch.Tensor, k: int) -> torch.Tensor:
    """``[L, m]`` scales without row ``k`` (still a stride-0 view when all rows are one)."""
    if not rows.stride(0):
        return rows[0].expand(rows.shape[0] - 1, -1)
    return torch.cat([rows[:k], rows[k + 1 :]])


def canary_rows(data: tuple[torch.Tensor, ...], canaries: DiracCanaries) -> tuple[torch.Tensor, ...]:
    """The training set of a Dirac audit: the real rows, then one slot per canary (the inputs of real row 0, whose
    loss is masked), with the slot column appended: ``(*data, slots [n + m])``."""
    if not isinstance(data, tuple) or not data or not all(isinstance(t, torch.Tensor) for t in data):
        raise InputTypeError("data must be a tuple of per-example tensors [n, ...] (inputs, labels, ...).")
    n, m = len(data[0]), len(canaries)
    if n < 1 or any(len(t) != n for t in data):
        raise ConfigurationError(f"data tensors must share a non-zero first dimension, got {[len(t) for t in data]}.")
    filled = tuple(torch.cat([t, t[:1].expand(m, *t.shape[1:])]) for t in data)
    slots = torch.cat([torch.full((n,), REAL_ROW, dtype=torch.long), torch.as_tensor(canaries.slots)])
    return (*filled, slots)


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


@dataclass(frozen=True)
class CanaryAuditReport:
    """A Dirac-canary audit.

    Attributes:
        fdp: the f-DP bound (Gaussian curves) of :func:`opake_core.fdp_audit.fdp_audit`.
        steinke: the epsilon-point bound of :func:`opake_core.audit.one_run_audit` on the same scores.
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
            :func:`opake_core.fdp_audit.process_tradeoff`).
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
        ``(guess_sets, weights)`` for :func:`opake_core.fdp_audit.fdp_audit`.
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
        canaries: from :func:`dirac_canaries` (``gradient_norm >= clipping_norm``).
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
            simulations of the claimed mechanism, as ``guess_plan`` says (:func:`planned_guess_sets`).
        guess_plan: ``"robust"`` (default) or ``"tight"`` (:func:`planned_guess_sets`).
        mechanism: ``mechanism(loss, *, optimizer, expected_batch_size, key, engine) -> (step_fn, dp_state)``, the
            step under test; ``engine`` (a :class:`DiracGradients` engine) goes to its ``dp_sgd``, ``dp_ftrl`` or
            ``clipped_grad`` so that the canaries cost memory in proportion to the batch (ignoring it is correct,
            at a cost in proportion to the batch times the canaries).
        claim_test: also test the claimed mechanism's exact trade-off curve (its PLD profile, about a second).

    Returns:
        A :class:`CanaryAuditReport`.
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


class _CanaryRows(Sequence):
    """The trainer's data set for a Dirac audit: the real rows (marked :data:`REAL_ROW`), then one slot per canary
    (a copy of real row 0, marked with its slot)."""

    def __init__(self, base: Sequence[Any], slots: np.ndarray) -> None:
        self.base, self.slots = base, slots

    def __len__(self) -> int:
        return len(self.base) + len(self.slots)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < len(self.base):
            return {**self.base[i], CANARY_FIELD: REAL_ROW}
        return {**self.base[0], CANARY_FIELD: int(self.slots[i - len(self.base)])}


def _canary_embedding(model: torch.nn.Module, num_canaries: int) -> None:
    """The zero canary block of a trainer audit, registered on ``model`` (dtype of its first parameter): an
    embedding, so that the layerwise engine serves it like any other layer."""
    first = next(model.parameters())
    block = torch.nn.Embedding(num_canaries + 1, 1, padding_idx=num_canaries, dtype=first.dtype)
    torch.nn.init.zeros_(block.weight)
    model.add_module(CANARY_LEAF, block)


def _recorder(trainer: Any, m: int) -> Any:
    """A callback that keeps the canary block of ``trainer``'s iterate before every step (``before[t]``, float64)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.before: list[np.ndarray] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.before.append(_canary_values(trainer.trainable_params[CANARY_WEIGHT], m))

    return Recorder()


def _canary_values(weight: torch.Tensor, m: int) -> np.ndarray:
    return weight[:m, 0].detach().double().cpu().numpy().copy()


def _dirac_trainer_class(base: type, canaries: DiracCanaries) -> type:
    """A subclass of ``base`` whose losses add the Dirac canaries' (``gradient_norm`` times the canary's entry of
    the block, looked up through the block's embedding so that both engines see a supported layer) and whose
    batches keep their column. The batched loss carries them, unless ``base`` overrides only the per-example loss
    (then that one does, and the run uses ``vmap(grad)`` as it would without the audit)."""
    from opake_torch.transformers import DPTrainer

    m, scale = len(canaries), canaries.gradient_norm

    def with_canaries(owner: Any, params: dict[str, torch.Tensor], real: torch.Tensor, slot: torch.Tensor) -> Any:
        block = owner.model.get_submodule(CANARY_LEAF)
        rows = torch.where(slot >= 0, slot, m)  # row m: the padding index, no gradient
        entry = torch.func.functional_call(block, {"weight": params[CANARY_WEIGHT]}, (rows,)).reshape(slot.shape)
        return torch.where(slot == REAL_ROW, real, torch.zeros_like(real)) + scale * entry.to(real.dtype)

    def compute_batch_losses(self: Any, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> Any:
        batch = dict(batch)
        slot = batch.pop(CANARY_FIELD)
        return with_canaries(self, params, super(trainer, self).compute_batch_losses(params, batch), slot)

    def compute_per_example_loss(self: Any, params: dict[str, torch.Tensor], example: dict[str, torch.Tensor]) -> Any:
        example = dict(example)
        slot = example.pop(CANARY_FIELD)
        return with_canaries(self, params, super(trainer, self).compute_per_example_loss(params, example), slot)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        if self.dataset_columns is not None:  # remove_unused_columns keeps the model's inputs only
            self.dataset_columns = self.dataset_columns | {CANARY_FIELD}

    own_example_loss = base.compute_per_example_loss is not DPTrainer.compute_per_example_loss
    own_batch_loss = base.compute_batch_losses is not DPTrainer.compute_batch_losses
    methods: dict[str, Any] = {"__init__": __init__}
    if own_batch_loss or not own_example_loss:
        methods["compute_batch_losses"] = compute_batch_losses
    if own_example_loss:  # it does not reach the batched loss above
        methods["compute_per_example_loss"] = compute_per_example_loss
    trainer = type("DiracCanaryTrainer", (base,), methods)
    return trainer


def audit_trainer_dirac(
    model: torch.nn.Module,
    args: Any,
    train_dataset: Sequence[dict[str, Any]],
    *,
    key: random.Key,
    num_canaries: int = 1000,
    gradient_norm: float | None = None,
    observe: str = "all",
    score: str | None = None,
    trainer_class: type | None = None,
    confidence: float = 0.95,
    guess_sets: Sequence[tuple[int, int]] | None = None,
    guess_plan: str = "robust",
    claim_test: bool = False,
    **trainer_kwargs: Any,
) -> CanaryAuditReport:
    """Audit a :class:`~opake_torch.transformers.DPTrainer` run (DP-SGD, Poisson sampling) with Dirac canaries.

    The model gains the canary block (a zero ``nn.Embedding`` :data:`CANARY_LEAF` of ``num_canaries + 1`` rows of
    width 1, trainable name :data:`CANARY_WEIGHT`); the data set gains one row per canary slot (a copy of row 0 whose
    own loss is masked) and the column :data:`CANARY_FIELD`; the trainer is a subclass of ``trainer_class`` whose
    batched loss adds the canaries' (its per-example loss where ``trainer_class`` defines only that), so that the
    run uses the per-example gradient engine it would use without the audit (the layerwise engine where the model
    allows it).
    With ``observe="all"`` the auditor reads the canary block before every step and after the last one and recovers
    each step's privatized gradient from ``theta_{t+1} - theta_t = -lr_t (g_t + weight_decay theta_t)``, which needs
    ``args.optim="sgd"``; ``observe="final"`` reads the final block only (any optimizer).

    Args:
        model: a model ``DPTrainer`` accepts (it is modified: the block is registered on it).
        args: :class:`~opake_torch.transformers.TrainingArguments` with a fixed ``clipping_norm`` and the Gaussian
            mechanism with Poisson sampling.
        train_dataset: the real rows (dicts).
        key: drives the coins and the simulations that choose the guess set.
        num_canaries: ``m``.
        gradient_norm: a canary's gradient norm before clipping (default: the clipping bound).
        observe: see :func:`audit_dirac_run`.
        score: see :func:`audit_dirac_run`.
        confidence: see :func:`audit_dirac_run`.
        guess_sets: see :func:`audit_dirac_run`.
        guess_plan: see :func:`audit_dirac_run`.
        claim_test: see :func:`audit_dirac_run`.
        trainer_class: ``DPTrainer`` (default) or a subclass of it.
        **trainer_kwargs: more arguments of the trainer (``data_collator`` must keep the :data:`CANARY_FIELD`
            column).
    """
    from opake_torch.transformers import DPTrainer  # the audit imports the Hugging Face stack only when used
    from opake_torch.transformers.optimizer import build_schedule

    score = _check_observe(observe, score)
    trainer_class = DPTrainer if trainer_class is None else trainer_class
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, DPTrainer)):
        raise InputTypeError(f"trainer_class must be DPTrainer or a subclass, got {trainer_class!r}.")
    bound = args.clipping_norm
    if isinstance(bound, bool) or not isinstance(bound, int | float) or args.clipping_mode not in (None, "fixed"):
        raise ConfigurationError(
            f"a Dirac audit needs one fixed clipping bound, got clipping_norm={bound!r} with clipping_mode="
            f"{args.clipping_mode!r}; set a number and the default clipping mode."
        )
    if observe == "all" and args.optim != "sgd":
        raise ConfigurationError(
            f"observe='all' recovers each privatized gradient from consecutive iterates, which needs optim='sgd', "
            f"got optim={args.optim!r}; use optim='sgd', or observe='final'."
        )
    gradient_norm = float(bound) if gradient_norm is None else gradient_norm
    canaries = dirac_canaries(key=key, num_canaries=num_canaries, gradient_norm=gradient_norm)
    if not canaries.gradient_norm >= bound:
        raise ConfigurationError(f"gradient_norm ({gradient_norm}) must be at least clipping_norm ({bound}).")
    if hasattr(model, CANARY_LEAF):
        raise ConfigurationError(f"the model already has {CANARY_LEAF!r}; audit a fresh model.")
    _canary_embedding(model, num_canaries)
    trainer_cls = _dirac_trainer_class(trainer_class, canaries)
    trainer = trainer_cls(model, args, train_dataset=_CanaryRows(list(train_dataset), canaries.slots), **trainer_kwargs)
    recorder = _recorder(trainer, num_canaries)
    trainer.add_callback(recorder)
    output = trainer.train()
    plan = trainer.privacy_plan
    if plan is None or plan.strategy is not None or dict(plan.sampler.config).get("sampler") != "poisson":
        raise ConfigurationError(
            "audit_trainer_dirac audits DP-SGD with Poisson sampling; for DP-FTRL use audit_dirac_run with the core "
            "step."
        )
    final = _canary_values(trainer.model.get_submodule(CANARY_LEAF).weight, num_canaries)
    theoretical = output.metrics.get("privacy_epsilon", math.nan)
    z, q, steps = plan.noise_multiplier, plan.sample_rate, len(recorder.before)
    if observe == "final":
        x = None
        scores = -(final - recorder.before[0]) if recorder.before else np.zeros(num_canaries)
    else:
        schedule = build_schedule(args, plan.total_steps)
        iterates = [*recorder.before, final]
        x = np.stack(
            [
                -(after - before) / float(schedule(t)) - args.weight_decay * before
                for t, (before, after) in enumerate(itertools.pairwise(iterates))
            ]
        ) / (bound / plan.expected_batch_size)
        scores = _dirac_scores(score, x, noise_multiplier=z, sample_rate=q)
    return _finish(
        scores,
        canaries,
        plan_key=random.fold_in(key, "opake.audit.plan"),
        score=score,
        claim=plan.sampler.process(z, steps),
        theoretical=theoretical,
        delta=plan.delta,
        confidence=confidence,
        guess_sets=guess_sets,
        guess_plan=guess_plan,
        simulation={"steps": steps, "sample_rate": q, "noise_multiplier": z},
        claim_test=claim_test,
        observations=x,
        observe=observe,
    )
