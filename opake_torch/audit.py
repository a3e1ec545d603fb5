"""The training side of the one-run privacy audit (Steinke, Nasr and Jagielski 2023): canaries, runs, scores.

The statistics live in :mod:`opake_core.audit`; this module trains. An audit:

1. draws a fair coin per canary (:func:`opake_core.audit.coin_flips`) and adds the heads to the training data;
2. trains once (a core DP-SGD or DP-FTRL loop, :func:`audit_core_run`, or a :class:`DPTrainer`, :func:`audit_trainer`);
3. scores every canary with the trained model: minus its loss (:func:`loss_scores`, black-box) or the alignment of
   the parameter change with the canary's own descent direction (:func:`gradient_scores`, white-box);
4. turns the scores into an epsilon lower bound (:func:`opake_core.audit.one_run_audit`) and reports it next to the
   theoretical epsilon of the run.

A lower bound above the theoretical epsilon (beyond the stated false-alarm rate ``1 - confidence``) means the
mechanism leaks more than it claims. A correct private run gives a bound far below its epsilon; a non-private run on
memorizable canaries (random points with random labels) gives a clearly positive one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.func import grad, vmap

from opake_core import accounting, optim, random, sampling
from opake_core.audit import AuditResult, coin_flips, one_run_audit
from opake_core.errors import ConfigurationError
from opake_core.mf import MinSepParticipation
from opake_core.step import dp_ftrl, dp_sgd

__all__ = [
    "AuditReport",
    "Canaries",
    "audit_core_run",
    "audit_trainer",
    "gradient_scores",
    "loss_scores",
    "make_canaries",
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
    """An audit: the lower bound (``result``) next to the run's theoretical epsilon, with the raw material."""

    result: AuditResult
    theoretical_epsilon: float
    scores: np.ndarray
    included: np.ndarray

    @property
    def epsilon_lower_bound(self) -> float:
        return self.result.epsilon

    @property
    def consistent(self) -> bool:
        """Whether the lower bound stays at or below the theoretical epsilon."""
        return self.result.epsilon <= self.theoretical_epsilon


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
    confidence: float = 0.95,
    k: int | Sequence[int] | None = None,
) -> AuditReport:
    """Train once on ``data`` plus the included canaries with the core step, then audit.

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
        delta, score, confidence, k: the audit's delta, ``"loss"`` or ``"gradient"`` scores, confidence and guess
            counts (see :func:`opake_core.audit.one_run_audit`).
    """
    if score not in ("loss", "gradient"):
        raise ConfigurationError(f"score must be 'loss' or 'gradient', got {score!r}.")
    x = torch.cat([data[0], canaries.inputs[torch.as_tensor(canaries.included)].to(data[0].dtype)])
    y = torch.cat([data[1], canaries.labels[torch.as_tensor(canaries.included)]])
    n = len(x)
    private = noise_multiplier > 0
    if optimizer is None:
        optimizer = optim.sgd(0.5, non_private=not private)
    start = dict(params)
    current, opt_state = dict(params), optimizer.init(params)
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
        theoretical = (
            accounting.epsilon(accounting.gaussian(noise_multiplier), delta=delta).value if private else math.inf
        )
    if score == "loss":
        scores = loss_scores(loss_fn, current, canaries.inputs, canaries.labels)
    else:
        scores = gradient_scores(loss_fn, start, current, canaries.inputs, canaries.labels)
    result = one_run_audit(scores, canaries.included, delta=delta, confidence=confidence, k=k)
    return AuditReport(result, float(theoretical), scores, canaries.included)


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
    """Run the one-run audit around a :class:`~opake_torch.transformers.DPTrainer`.

    Args:
        make_trainer: ``dataset -> DPTrainer`` (build it with ``privacy_accounting=True`` so that the theoretical
            epsilon is reported; a non-private run reports inf).
        train_dataset: the examples always included (a sequence of dicts).
        canaries: candidate examples (dicts like the training rows); each is included with probability 1/2.
        key: drives the coins (:func:`opake_core.audit.coin_flips`).
        delta: the audit's delta; defaults to the delta the trainer resolved.
        confidence, k: see :func:`opake_core.audit.one_run_audit`.

    Scores are minus each canary's per-example loss under the trained model (``trainer.compute_per_example_loss``,
    so a custom objective is scored by its own loss).
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
    return AuditReport(result, float(theoretical), scores, included)
