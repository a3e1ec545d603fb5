"""Helpers to unit-test a DP mechanism from your own pytest suite.

Each check returns a small frozen report with a ``passed`` flag; each ``assert_*`` twin raises ``AssertionError`` with
a readable message (and returns the report when it passes).

* Neighbouring batches: :func:`remove_one`, :func:`add_one`, :func:`replace_one`, :func:`extreme_examples` and
  :func:`neighbours` (random and adversarial neighbours of a batch).
* :func:`check_sensitivity`: with randomness fixed, the released value moves by at most its declared sensitivity
  between neighbouring batches (``sensitivity`` for add/remove, twice that for replace-one). Distances are computed in
  float64. The relative slack covers float rounding only: ``rtol = max(1e-6, 4 * (B + 2) * eps)`` with ``eps`` the
  machine epsilon of the narrowest released dtype and ``B`` the batch size (1e-6 for float64 releases).
* :func:`check_noise`: the noise has the stated standard deviation and is Gaussian: a two-sided chi-square test on
  the sum of squares (the RMS-ratio test) and a Kolmogorov-Smirnov test against ``N(0, std^2)``, each at false-alarm
  rate ``alpha`` (default 1e-3, so at most 2e-3 together). :func:`min_noise_samples` is the sample size at which the
  RMS test detects a 3% scale error with probability 0.999; fewer samples are refused.
* :func:`check_fresh_noise`: noise drawn at different steps (and for different leaves) is uncorrelated, which catches
  a reused key. Pairwise correlation test, Bonferroni-corrected to a total false-alarm rate ``alpha``.
* :func:`check_replay`: the same inputs (key and state included) give bit-identical outputs, and the call does not
  modify its tensor inputs.
* :func:`matches_torch_optimizer`: an optimizer's updates against a ``torch.optim`` class's on the same gradients.
* :func:`check_sampling_rate`: a sampler's empirical inclusion rate against the rate its accountant assumes (exact
  two-sided binomial test at ``alpha``; exact for independent samplers, conservative for samplers whose inclusions
  are negatively correlated or fixed per epoch).

Everything here is pure: no files, no global RNG (randomness comes from :mod:`opake_core.random` keys).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import optree
import torch
from scipy import stats

from opake_core import accounting as acc
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.random import Key, fold_in, numpy_generator
from opake_core.tree import NAMESPACE, Clipped, Noised, PerGroup

__all__ = [
    "FreshNoiseReport",
    "Neighbour",
    "NoiseReport",
    "ReplayReport",
    "SamplingReport",
    "SensitivityReport",
    "accounted_rate",
    "add_one",
    "assert_fresh_noise",
    "assert_noise",
    "assert_replay",
    "assert_sampling_rate",
    "assert_sensitivity",
    "check_fresh_noise",
    "check_noise",
    "check_replay",
    "check_sampling_rate",
    "check_sensitivity",
    "example_at",
    "extreme_examples",
    "matches_torch_optimizer",
    "min_noise_samples",
    "neighbours",
    "noise_draws",
    "process_rate",
    "remove_one",
    "replace_one",
]

TAG = "opake.testing.neighbours"
EXTREME_SCALES = (1e6, 1e3, -1.0, -1e3, 1e-6, 0.0)


# -- neighbouring batches -----------------------------------------------------------------------------------------


def batch_size(batch: Any) -> int:
    """The common leading dimension of the tensors of ``batch``."""
    sizes = {leaf.shape[0] for leaf in optree.tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim()}
    if len(sizes) != 1:
        raise ConfigurationError(f"a batch needs one common leading dimension over its tensors, got {sorted(sizes)}.")
    return sizes.pop()


def example_at(batch: Any, index: int) -> Any:
    """Example ``index`` of ``batch`` (its tensors without the batch dimension).

    Example:

        >>> import torch
        >>> from opake_core import testing
        >>> testing.example_at((torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 1])), 1)
        (tensor([3., 4.]), tensor(1))
    """
    return optree.tree_map(lambda x: x[index] if isinstance(x, torch.Tensor) else x, batch)


def remove_one(batch: Any, index: int) -> Any:
    """``batch`` without example ``index``.

    Example:

        >>> import torch
        >>> from opake_core import testing
        >>> testing.remove_one((torch.tensor([10.0, 20.0, 30.0]),), 1)
        (tensor([10., 30.]),)
    """
    size = batch_size(batch)
    if not 0 <= index < size:
        raise ConfigurationError(f"index must be in [0, {size}), got {index}.")
    keep = torch.tensor([i for i in range(size) if i != index], dtype=torch.long)
    return optree.tree_map(lambda x: x[keep.to(x.device)] if isinstance(x, torch.Tensor) else x, batch)


def add_one(batch: Any, example: Any) -> Any:
    """``batch`` with ``example`` (same tree, no batch dimension) appended.

    Example:

        >>> import torch
        >>> from opake_core import testing
        >>> testing.add_one((torch.tensor([10.0, 20.0]),), (torch.tensor(99.0),))
        (tensor([10., 20., 99.]),)
    """
    return optree.tree_map(
        lambda x, e: torch.cat([x, e.to(x.dtype)[None]]) if isinstance(x, torch.Tensor) else x, batch, example
    )


def replace_one(batch: Any, index: int, example: Any) -> Any:
    """``batch`` with example ``index`` replaced by ``example``.

    Example:

        >>> import torch
        >>> from opake_core import testing
        >>> testing.replace_one((torch.tensor([10.0, 20.0]),), 0, (torch.tensor(-1.0),))
        (tensor([-1., 20.]),)
    """
    size = batch_size(batch)
    if not 0 <= index < size:
        raise ConfigurationError(f"index must be in [0, {size}), got {index}.")

    def put(x: Any, e: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return torch.cat([x[:index], e.to(x.dtype)[None], x[index + 1 :]])

    return optree.tree_map(put, batch, example)


def extreme_examples(example: Any, *, scales: Sequence[float] = EXTREME_SCALES) -> list[Any]:
    """NaN-free extreme variants of ``example``: its floating-point tensors multiplied by each of ``scales``.

    The defaults give huge (1e6, 1e3, -1e3), negated, tiny (1e-6) and zero variants; integer tensors (labels, token
    ids) are kept. Results that would overflow the tensor's dtype are skipped.

    Example: the label (an integer tensor) stays as it is.

        >>> import torch
        >>> from opake_core import testing
        >>> variants = testing.extreme_examples((torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor(3)))
        >>> [v[0][0].item() for v in variants], {v[1].item() for v in variants}
        ([1000000.0, 1000.0, -1.0, -1000.0, 1e-06, 0.0], {3})
    """
    out = []
    for scale in scales:
        variant = optree.tree_map(
            lambda x, s=scale: x * s if isinstance(x, torch.Tensor) and x.is_floating_point() else x, example
        )
        finite = all(
            bool(torch.isfinite(leaf).all())
            for leaf in optree.tree_leaves(variant)
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
        )
        if finite:
            out.append(variant)
    return out


@dataclass(frozen=True)
class Neighbour:
    """A neighbouring batch: ``kind`` is "add", "remove" or "replace"; ``index`` the example removed or replaced."""

    kind: str
    index: int | None
    batch: Any
    label: str


def neighbours(
    batch: Any,
    *,
    key: Key,
    count: int = 16,
    pool: Sequence[Any] = (),
    adversarial: bool = True,
    kinds: Sequence[str] = ("add", "remove", "replace"),
) -> list[Neighbour]:
    """Neighbours of ``batch``: ``count`` random ones plus, with ``adversarial``, systematic extreme ones.

    Random neighbours remove a random example, add an example drawn from ``pool`` (or an extreme variant of a batch
    example when the pool is empty), or replace one. Adversarial neighbours remove every example in turn and add or
    replace with every extreme variant (:func:`extreme_examples`) of the first and last examples and of ``pool``.

    Example: 4 random neighbours of a 3-example batch, then the adversarial ones (3 removals, and an addition and a
    replacement for each of the 12 extreme variants of the first and last examples).

        >>> import torch
        >>> from opake_core import random, testing
        >>> found = testing.neighbours((torch.ones(3, 2),), key=random.key(0), count=4)
        >>> len(found), sorted({n.kind for n in found})
        (31, ['add', 'remove', 'replace'])
    """
    for kind in kinds:
        if kind not in ("add", "remove", "replace"):
            raise ConfigurationError(f"kinds must be among 'add', 'remove', 'replace', got {kind!r}.")
    size = batch_size(batch)
    candidates = list(pool)
    for i in sorted({0, size - 1}) if size else []:
        candidates.extend(extreme_examples(example_at(batch, i)))
    if not candidates:
        raise ConfigurationError("an empty batch has no example to add: pass pool=[example, ...].")
    gen = numpy_generator(fold_in(key, TAG))
    out: list[Neighbour] = []
    usable = [k for k in kinds if size or k == "add"]
    for n in range(count):
        kind = usable[int(gen.integers(len(usable)))]
        index = int(gen.integers(size)) if kind != "add" else None
        extra = candidates[int(gen.integers(len(candidates)))]
        nb = (
            add_one(batch, extra)
            if kind == "add"
            else remove_one(batch, index)
            if kind == "remove"
            else replace_one(batch, index, extra)
        )
        out.append(Neighbour(kind, index, nb, f"random #{n}: {kind} {index if index is not None else ''}".strip()))
    if adversarial:
        if "remove" in kinds:
            out.extend(Neighbour("remove", i, remove_one(batch, i), f"remove example {i}") for i in range(size))
        for c, extra in enumerate(candidates):
            if "add" in kinds:
                out.append(Neighbour("add", None, add_one(batch, extra), f"add extreme candidate {c}"))
            if "replace" in kinds and size:
                out.append(Neighbour("replace", 0, replace_one(batch, 0, extra), f"replace 0 by extreme candidate {c}"))
    return out


# -- sensitivity --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SensitivityReport:
    """Result of :func:`check_sensitivity`.

    Attributes:
        max_ratio: the largest observed ``distance / allowed distance`` (allowed: the sensitivity for add/remove,
            twice it for replace; per group and jointly for per-group sensitivities).
        worst_case: a description of the neighbour that reached ``max_ratio``.
        passed: ``max_ratio <= 1 + rtol``.
        sensitivity: the declared (joint) sensitivity.
        trials: the number of neighbours compared.
        rtol: the float-rounding slack used.
    """

    max_ratio: float
    worst_case: str
    passed: bool
    sensitivity: float
    trials: int
    rtol: float


def _release(out: Any) -> tuple[Any, float | PerGroup | None]:
    if isinstance(out, Clipped):
        return out.value, out.sensitivity
    return out, None


def _leaves64(tree: Any) -> list[torch.Tensor]:
    leaves = optree.tree_leaves(tree, namespace=NAMESPACE)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(f"a release must be a tree of tensors, got a {type(leaf).__name__} leaf.")
    return [leaf.detach().to(torch.float64) for leaf in leaves]


def _narrowest_eps(tree: Any) -> float:
    leaves = [x for x in optree.tree_leaves(tree, namespace=NAMESPACE) if isinstance(x, torch.Tensor)]
    return max((torch.finfo(x.dtype).eps for x in leaves if x.is_floating_point()), default=0.0)


def _distances(
    a: list[torch.Tensor], b: list[torch.Tensor], sensitivity: float | PerGroup
) -> list[tuple[str, float, float]]:
    """``(what, distance, allowed)`` for the joint release and, with per-group sensitivities, every group."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        raise ConfigurationError("the releases of neighbouring batches have different structures or shapes.")
    sq = [float(((x - y) ** 2).sum()) for x, y in zip(a, b, strict=True)]
    if not all(math.isfinite(s) for s in sq):
        return [("joint (non-finite release)", math.inf, 0.0)]
    if not isinstance(sensitivity, PerGroup):
        return [("joint", math.sqrt(sum(sq)), float(sensitivity))]
    groups = [g for _, g in sensitivity.groups]
    if len(groups) != len(sq):
        raise ConfigurationError(
            f"the per-group sensitivity covers {len(groups)} leaves but the release has {len(sq)}."
        )
    out = [("joint", math.sqrt(sum(sq)), sensitivity.effective)]
    for name, bound in sensitivity.values:
        out.append((f"group {name!r}", math.sqrt(sum(s for s, g in zip(sq, groups, strict=True) if g == name)), bound))
    return out


def check_sensitivity(
    release_fn: Callable[[Any], Any],
    batch: Any,
    *,
    key: Key,
    sensitivity: float | PerGroup | None = None,
    count: int = 32,
    pool: Sequence[Any] = (),
    extra: Sequence[Any] = (),
    adversarial: bool = True,
    kinds: Sequence[str] = ("add", "remove", "replace"),
    rtol: float | None = None,
) -> SensitivityReport:
    """Check that ``release_fn`` moves by at most its sensitivity between neighbouring batches.

    Args:
        release_fn: ``batch -> release`` with every source of randomness fixed inside (a fixed key, or noise
            multiplier 0): a :class:`~opake_core.tree.Clipped` (its ``sensitivity`` is the declared one) or a tree of
            tensors with ``sensitivity`` given. Use float64 parameters where the mechanism allows it. To check a whole
            step, return ``(params_before - params_after) / lr`` of an SGD step with noise multiplier 0.
        batch: the reference batch (a tuple or tree of tensors ``[B, ...]``); it may be empty if ``pool`` is given.
        key: drives the random neighbours.
        sensitivity: the declared add/remove sensitivity when ``release_fn`` does not return a ``Clipped``.
        count: number of random neighbours; ``adversarial`` adds the systematic extreme ones (see :func:`neighbours`).
        pool: examples that may be added (or replace one).
        extra: further neighbouring batches of your own (treated as add/remove neighbours).
        kinds: which neighbour relations to test.
        rtol: relative slack for float rounding; default ``max(1e-6, 4 * (B + 2) * eps)`` (module docstring).

    Example: the clipped sum passes; a sum that forgot to clip but declares the same sensitivity does not.

        >>> import torch
        >>> from opake_core import Clipped, clipped_grad, random, testing
        >>> grad_fn, state = clipped_grad(lambda w, x: x @ w, clipping_norm=1.0, normalize_by=4.0)
        >>> release = lambda batch: grad_fn(torch.zeros(3, dtype=torch.float64), *batch, state=state)[0]
        >>> batch = (torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),)
        >>> report = testing.check_sensitivity(release, batch, key=random.key(0), count=4)
        >>> report.passed, report.sensitivity, round(report.max_ratio, 6)
        (True, 0.25, 1.0)
        >>> unclipped = lambda batch: Clipped(batch[0].sum(dim=0) / 4, 0.25)
        >>> testing.check_sensitivity(unclipped, batch, key=random.key(0), count=4).passed
        False
    """
    reference = release_fn(batch)
    ref_value, declared = _release(reference)
    if sensitivity is None:
        if declared is None:
            raise ConfigurationError(
                "release_fn returned a plain tree: pass sensitivity=<declared L2 sensitivity>, or return the Clipped."
            )
        sensitivity = declared
    ref = _leaves64(ref_value)
    size = batch_size(batch)
    if rtol is None:
        rtol = max(1e-6, 4 * (size + 2) * _narrowest_eps(ref_value))
    cases = neighbours(batch, key=key, count=count, pool=pool, adversarial=adversarial, kinds=kinds)
    cases += [Neighbour("add", None, b, f"extra batch {i}") for i, b in enumerate(extra)]
    worst, worst_case = 0.0, "no neighbour"
    for case in cases:
        value, declared_nb = _release(release_fn(case.batch))
        if declared_nb is not None and declared_nb != sensitivity:
            return SensitivityReport(
                math.inf, f"{case.label}: declared sensitivity changed to {declared_nb}", False, 0.0, len(cases), rtol
            )
        factor = 2.0 if case.kind == "replace" else 1.0
        for what, distance, allowed in _distances(ref, _leaves64(value), sensitivity):
            bound = factor * allowed
            ratio = distance / bound if bound > 0 else (0.0 if distance == 0 else math.inf)
            if ratio > worst or (math.isnan(ratio) and not math.isnan(worst)):
                worst = ratio if not math.isnan(ratio) else math.inf
                worst_case = f"{case.label}: {what} moved {distance:.6g}, allowed {bound:.6g}"
    joint = sensitivity.effective if isinstance(sensitivity, PerGroup) else float(sensitivity)
    return SensitivityReport(worst, worst_case, worst <= 1 + rtol, joint, len(cases), rtol)


def assert_sensitivity(release_fn: Callable[[Any], Any], batch: Any, **kwargs: Any) -> SensitivityReport:
    """:func:`check_sensitivity`, raising ``AssertionError`` when it fails.

    Example: in a pytest suite, one line per mechanism.

        >>> import torch
        >>> from opake_core import Clipped, random, testing
        >>> unclipped = lambda batch: Clipped(batch[0].sum(dim=0), 1.0)
        >>> try:
        ...     testing.assert_sensitivity(unclipped, (torch.ones(2, 3),), key=random.key(0), count=2)
        ... except AssertionError as error:
        ...     print(str(error)[:40])
        sensitivity violated: the release moved
    """
    report = check_sensitivity(release_fn, batch, **kwargs)
    if not report.passed:
        raise AssertionError(
            f"sensitivity violated: the release moved {report.max_ratio:.6g} times its declared bound "
            f"(sensitivity {report.sensitivity:.6g}, slack {report.rtol:.1e}) over {report.trials} neighbours; "
            f"worst: {report.worst_case}."
        )
    return report


# -- noise --------------------------------------------------------------------------------------------------------


def min_noise_samples(*, scale_error: float = 0.03, alpha: float = 1e-3, power: float = 0.999) -> int:
    """Samples needed by the RMS-ratio test to detect a relative std error ``scale_error`` (either sign).

    Normal approximation on ``log(s^2)`` (standard deviation ``sqrt(2 / n)``): ``n = 2 * ((z_{1-alpha/2} +
    z_{power}) / (2 * log(1 - scale_error)))^2``, rounded up. The defaults give 21,943.

    Example:

        >>> from opake_core import testing
        >>> testing.min_noise_samples(), testing.min_noise_samples(scale_error=0.1)
        (21943, 1834)
    """
    if not 0 < scale_error < 1 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ConfigurationError(
            f"scale_error, alpha and power must be in (0, 1), got {scale_error!r}, {alpha!r}, {power!r}."
        )
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return math.ceil(2 * (z / abs(2 * math.log1p(-scale_error))) ** 2)


@dataclass(frozen=True)
class NoiseReport:
    """Result of :func:`check_noise`: sample size, expected and empirical std, both p-values and the verdict."""

    num_samples: int
    expected_std: float
    empirical_std: float
    std_ratio: float
    rms_p_value: float
    ks_p_value: float
    alpha: float
    passed: bool


def _flat64(samples: Any) -> np.ndarray:
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().to(torch.float64).cpu().numpy()
    elif isinstance(samples, list | tuple):
        return np.concatenate([_flat64(s) for s in samples]) if samples else np.zeros(0)
    return np.asarray(samples, dtype=np.float64).ravel()


def check_noise(samples: Any, *, std: float, alpha: float = 1e-3, min_samples: int | None = None) -> NoiseReport:
    """Test that ``samples`` (noise only: release minus the clean value) are ``N(0, std^2)``.

    RMS-ratio test: ``sum(x^2) / std^2 ~ chi2(n)``, two-sided at ``alpha``. KS test against ``N(0, std^2)`` at
    ``alpha``. ``n`` must be at least ``min_samples`` (default :func:`min_noise_samples` at this ``alpha``).

    Example: the Gaussian mechanism's noise at multiplier 2 on sensitivity 0.5 has std 1; a claimed std 5% off is
    caught.

        >>> from opake_core import gaussian_noise, random, testing
        >>> noise_fn, state = gaussian_noise(noise_multiplier=2.0, key=random.key(0))
        >>> draws, outputs, state = testing.noise_draws(noise_fn, state, size=25_000, sensitivity=0.5)
        >>> outputs[0].noise_std, testing.check_noise(draws, std=1.0).passed
        (1.0, True)
        >>> testing.check_noise(draws, std=1.05).passed
        False
    """
    x = _flat64(samples)
    if not std > 0 or not math.isfinite(std):
        raise ConfigurationError(f"std must be positive and finite, got {std!r}.")
    if not 0 < alpha < 1:
        raise ConfigurationError(f"alpha must be in (0, 1), got {alpha!r}.")
    needed = min_noise_samples(alpha=alpha) if min_samples is None else min_samples
    if x.size < needed:
        raise ConfigurationError(
            f"check_noise needs at least {needed} samples to detect a 3% scale error at alpha={alpha}, got {x.size}; "
            "draw noise for a larger tensor or several steps."
        )
    if not np.all(np.isfinite(x)):
        return NoiseReport(x.size, std, math.nan, math.nan, 0.0, 0.0, alpha, False)
    chi2 = float(np.sum(x * x)) / std**2
    rms_p = float(min(1.0, 2 * min(stats.chi2.cdf(chi2, x.size), stats.chi2.sf(chi2, x.size))))
    ks_p = float(stats.kstest(x / std, "norm").pvalue)
    empirical = math.sqrt(chi2 / x.size) * std
    return NoiseReport(x.size, std, empirical, empirical / std, rms_p, ks_p, alpha, rms_p >= alpha and ks_p >= alpha)


def assert_noise(samples: Any, **kwargs: Any) -> NoiseReport:
    """:func:`check_noise`, raising ``AssertionError`` when it fails.

    Example:

        >>> from opake_core import gaussian_noise, random, testing
        >>> noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(0))
        >>> draws, _, _ = testing.noise_draws(noise_fn, state, size=25_000)
        >>> report = testing.assert_noise(draws, std=1.0)
        >>> report.passed, abs(report.std_ratio - 1) < 0.03
        (True, True)
    """
    r = check_noise(samples, **kwargs)
    if not r.passed:
        raise AssertionError(
            f"noise is not N(0, {r.expected_std:.6g}^2): empirical std {r.empirical_std:.6g} "
            f"(ratio {r.std_ratio:.4f}), "
            f"RMS-test p={r.rms_p_value:.3g}, KS p={r.ks_p_value:.3g}, alpha={r.alpha} over {r.num_samples} samples."
        )
    return r


def noise_draws(
    noise_fn: Callable[[Clipped, Any], tuple[Noised, Any]],
    state: Any,
    *,
    size: int,
    steps: int = 1,
    leaves: int = 1,
    sensitivity: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[list[np.ndarray], list[Noised], Any]:
    """Run a noise mechanism ``steps`` times on zero trees of ``leaves`` leaves of ``size`` entries.

    Returns ``(draws, noised, state)``: ``draws`` holds one flat float64 array per (step, leaf), in that order (the
    noise itself, since the input is zero), ``noised`` the mechanism's outputs (with their declared ``noise_std``).

    Example:

        >>> from opake_core import gaussian_noise, random, testing
        >>> noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(0))
        >>> draws, outputs, state = testing.noise_draws(noise_fn, state, size=100, steps=3, leaves=2)
        >>> len(draws), draws[0].shape, len(outputs), state.step
        (6, (100,), 3, 3)
    """
    tree = {f"leaf{i}": torch.zeros(size, dtype=dtype) for i in range(leaves)}
    draws, outputs = [], []
    for _ in range(steps):
        out, state = noise_fn(Clipped(tree, sensitivity), state)
        outputs.append(out)
        draws.extend(leaf.detach().to(torch.float64).numpy().ravel() for leaf in optree.tree_leaves(out.value))
    return draws, outputs, state


@dataclass(frozen=True)
class FreshNoiseReport:
    """Result of :func:`check_fresh_noise`: the largest absolute correlation over pairs, its corrected p-value."""

    num_draws: int
    max_abs_correlation: float
    worst_pair: tuple[int, int]
    p_value: float
    alpha: float
    passed: bool


def check_fresh_noise(draws: Sequence[Any], *, alpha: float = 1e-3) -> FreshNoiseReport:
    """Test that noise draws (steps, leaves) are pairwise uncorrelated: a reused key gives correlation 1.

    Each pair of equal-length draws is tested with Fisher's z (``atanh(r) * sqrt(n - 3) ~ N(0, 1)`` under
    independence), two-sided, Bonferroni-corrected over the pairs: total false-alarm rate at most ``alpha``.

    Example: successive steps draw fresh noise; running the same state twice (a reused key) repeats it.

        >>> from opake_core import gaussian_noise, random, testing
        >>> noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(0))
        >>> draws, _, _ = testing.noise_draws(noise_fn, state, size=1_000, steps=3, leaves=2)
        >>> testing.check_fresh_noise(draws).passed
        True
        >>> again, _, _ = testing.noise_draws(noise_fn, state, size=1_000)
        >>> report = testing.check_fresh_noise([draws[0], again[0]])
        >>> report.passed, report.max_abs_correlation
        (False, 1.0)
    """
    arrays = [_flat64(d) for d in draws]
    pairs = [(i, j) for i, j in itertools.combinations(range(len(arrays)), 2) if arrays[i].size == arrays[j].size]
    if not pairs:
        raise ConfigurationError("check_fresh_noise needs at least two draws of the same length.")
    worst, worst_pair, worst_p = 0.0, pairs[0], 1.0
    for i, j in pairs:
        a, b = arrays[i], arrays[j]
        if a.size < 10:
            raise ConfigurationError(f"each draw needs at least 10 values, got {a.size}.")
        r = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else 1.0
        r = max(-1.0, min(1.0, r))
        p = 0.0 if abs(r) >= 1 - 1e-12 else float(2 * stats.norm.sf(abs(math.atanh(r)) * math.sqrt(a.size - 3)))
        p = min(1.0, p * len(pairs))
        if abs(r) >= worst:
            worst, worst_pair, worst_p = abs(r), (i, j), p
    return FreshNoiseReport(len(arrays), worst, worst_pair, worst_p, alpha, worst_p >= alpha)


def assert_fresh_noise(draws: Sequence[Any], **kwargs: Any) -> FreshNoiseReport:
    """:func:`check_fresh_noise`, raising ``AssertionError`` when it fails.

    Example:

        >>> import numpy as np
        >>> from opake_core import testing
        >>> draw = np.random.default_rng(0).standard_normal(1_000)
        >>> try:
        ...     testing.assert_fresh_noise([draw, draw])
        ... except AssertionError as error:
        ...     print(str(error)[:45])
        noise draws (0, 1) are correlated (1.0000, co
    """
    r = check_fresh_noise(draws, **kwargs)
    if not r.passed:
        raise AssertionError(
            f"noise draws {r.worst_pair} are correlated ({r.max_abs_correlation:.4f}, corrected p={r.p_value:.3g}): "
            "a key is reused across steps or leaves; fold the step and leaf index into the key."
        )
    return r


# -- replay -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayReport:
    """Result of :func:`check_replay`: ``mismatches`` names the output leaves that differ, ``mutated`` the inputs."""

    identical: bool
    mismatches: tuple[str, ...]
    mutated: tuple[str, ...]
    passed: bool


def _flat_with_paths(tree: Any) -> list[tuple[str, Any]]:
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [(".".join(str(p) for p in path) or "<root>", leaf) for path, leaf in zip(paths, leaves, strict=True)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def check_replay(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ReplayReport:
    """Call ``fn(*args, **kwargs)`` twice and compare the outputs bit for bit; also check the inputs were not modified.

    States and outputs are compared leaf by leaf (optree, ``"opake"`` namespace); pass the key and the state as
    arguments so that the replay really has the same inputs.

    Example: a mechanism keyed by its state replays; one that draws from the global random state does not, and one
    that writes into its input is caught too.

        >>> import torch
        >>> from opake_core import Clipped, gaussian_noise, random, testing
        >>> noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(0))
        >>> testing.check_replay(noise_fn, Clipped({"w": torch.zeros(3)}, 1.0), state).passed
        True
        >>> testing.check_replay(lambda x: x + torch.randn(3), torch.zeros(3)).identical
        False
        >>> testing.check_replay(lambda x: x.add_(1.0), torch.zeros(3)).mutated
        ('0.0',)
    """
    snapshot = copy.deepcopy((args, kwargs))
    first = fn(*args, **kwargs)
    second = fn(*args, **kwargs)
    a, b = _flat_with_paths(first), _flat_with_paths(second)
    if [p for p, _ in a] != [p for p, _ in b]:
        mismatches: tuple[str, ...] = ("<structure>",)
    else:
        mismatches = tuple(p for (p, x), (_, y) in zip(a, b, strict=True) if not _same(x, y))
    before, after = _flat_with_paths(snapshot), _flat_with_paths((args, kwargs))
    mutated = tuple(p for (p, x), (_, y) in zip(before, after, strict=True) if not _same(x, y))
    return ReplayReport(not mismatches, mismatches, mutated, not mismatches and not mutated)


def assert_replay(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ReplayReport:
    """:func:`check_replay`, raising ``AssertionError`` when it fails.

    Example:

        >>> import torch
        >>> from opake_core import Clipped, gaussian_noise, random, testing
        >>> noise_fn, state = gaussian_noise(noise_multiplier=1.0, key=random.key(0))
        >>> testing.assert_replay(noise_fn, Clipped({"w": torch.zeros(3)}, 1.0), state).identical
        True
    """
    r = check_replay(fn, *args, **kwargs)
    if not r.passed:
        raise AssertionError(
            f"replay is not exact: outputs differ at {list(r.mismatches)[:5]}, "
            f"inputs modified at {list(r.mutated)[:5]}."
            " Draw randomness only from the key argument, and return new states instead of writing into the old."
        )
    return r


# -- sampler against accountant -----------------------------------------------------------------------------------


def process_rate(process: Any) -> float | None:
    """The per-step inclusion rate a (truncated) Poisson, random-allocation or without-replacement process assumes
    (inside repeats and compositions of one rate); None for other processes.

    Example:

        >>> from opake_core import accounting, testing
        >>> g = accounting.gaussian(1.0)
        >>> testing.process_rate(accounting.repeat(accounting.poisson(g, 0.05), 10))
        0.05
        >>> testing.process_rate(accounting.random_allocation(g, 4)), testing.process_rate(g)
        (0.25, None)
    """
    if isinstance(process, acc.Repeat | acc.Compose):
        inner = [process.process] if isinstance(process, acc.Repeat) else list(process.processes)
        rates = {process_rate(p) for p in inner}
        return rates.pop() if len(rates) == 1 else None
    if isinstance(process, acc.TruncatedPoisson):
        n, q, cap = process.dataset_size, process.sample_rate, process.truncated_batch_size
        k = np.arange(cap + 1, n + 1)
        excess = float(np.sum((k - cap) * stats.binom.pmf(k, n, q)))
        return q - excess / n
    if isinstance(process, acc.Poisson):
        return process.sample_rate
    if isinstance(process, acc.RandomAllocation):
        return 1.0 / process.num_steps
    if isinstance(process, acc.WithoutReplacement):
        return process.sample_size / process.dataset_size
    return None


def accounted_rate(sampler: Any, steps: int) -> tuple[float, str]:
    """The per-step inclusion rate that ``sampler``'s accounting assumes, and where it was read.

    Read from the accounting process ``sampler.process(1.0, steps)`` when it is a (truncated) Poisson or random
    allocation process; otherwise (DP-FTRL samplers, accounted by their strategy) from the public normalizer
    ``expected_batch_size / dataset_size`` that the clipped sum is divided by.

    Example:

        >>> from opake_core import sampling, testing
        >>> testing.accounted_rate(sampling.poisson(dataset_size=1_000, sample_rate=0.05), steps=10)
        (0.05, 'accounting process')
        >>> testing.accounted_rate(sampling.balls_in_bins(dataset_size=1_000, num_bins=4), steps=8)
        (0.25, 'expected_batch_size / dataset_size')
    """
    try:
        rate = process_rate(sampler.process(1.0, steps))
    except TypeError:
        rate = None
    if rate is not None:
        return float(rate), "accounting process"
    expected = getattr(sampler, "expected_batch_size", None)
    size = getattr(sampler, "dataset_size", None)
    if expected is None or not size:
        raise ConfigurationError(
            f"cannot read the accounted rate of {type(sampler).__name__}: pass accounted_rate= to check_sampling_rate."
        )
    return float(expected) / size, "expected_batch_size / dataset_size"


@dataclass(frozen=True)
class SamplingReport:
    """Result of :func:`check_sampling_rate`."""

    empirical_rate: float
    accounted_rate: float
    source: str
    inclusions: int
    trials: int
    p_value: float
    alpha: float
    passed: bool


def check_sampling_rate(
    sampler: Any, *, key: Key, steps: int, accounted: float | None = None, alpha: float = 1e-3
) -> SamplingReport:
    """Draw ``steps`` batches and test the inclusion rate against the accounted one (exact binomial test at ``alpha``).

    With ``N = sampler.dataset_size`` there are ``N * steps`` (example, step) trials. A 10% rate error is detected
    with near certainty once ``N * steps * rate`` reaches a few thousand inclusions. ``accounted`` overrides the rate
    read by :func:`accounted_rate`. A sampler sharded over ``world_size`` ranks is drawn on every rank (the same
    sampler with each ``rank``): the union of the ranks' batches is what the accountant analyses.

    Example: Poisson sampling at 0.05 passes; an accountant that assumed 0.055 would be caught.

        >>> from opake_core import random, sampling, testing
        >>> sampler = sampling.poisson(dataset_size=1_000, sample_rate=0.05)
        >>> report = testing.check_sampling_rate(sampler, key=random.key(0), steps=100)
        >>> report.passed, report.trials, report.source
        (True, 100000, 'accounting process')
        >>> testing.check_sampling_rate(sampler, key=random.key(0), steps=100, accounted=0.055).passed
        False
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigurationError(f"steps must be an int >= 1, got {steps!r}.")
    source = "given"
    if accounted is None:
        accounted, source = accounted_rate(sampler, steps)
    size = int(sampler.dataset_size)
    world = getattr(sampler, "world_size", 1)
    ranks = [sampler] if world == 1 else [replace(sampler, rank=r) for r in range(world)]
    states, total = [rank.init() for rank in ranks], 0
    for _ in range(steps):
        for r, rank in enumerate(ranks):
            indices, states[r] = rank.sample(key, states[r])
            total += len(indices)
    trials = size * steps
    p = float(stats.binomtest(total, trials, min(max(accounted, 0.0), 1.0)).pvalue)
    return SamplingReport(total / trials, float(accounted), source, total, trials, p, alpha, p >= alpha)


def assert_sampling_rate(sampler: Any, **kwargs: Any) -> SamplingReport:
    """:func:`check_sampling_rate`, raising ``AssertionError`` when it fails.

    Example:

        >>> from opake_core import random, sampling, testing
        >>> sampler = sampling.fixed_size(dataset_size=1_000, batch_size=50)
        >>> testing.assert_sampling_rate(sampler, key=random.key(0), steps=100).empirical_rate
        0.05
    """
    r = check_sampling_rate(sampler, **kwargs)
    if not r.passed:
        raise AssertionError(
            f"{type(sampler).__name__} includes examples at rate {r.empirical_rate:.5g} but its accountant assumes "
            f"{r.accounted_rate:.5g} ({r.source}); binomial p={r.p_value:.3g} < alpha={r.alpha} over {r.trials} "
            "trials. The epsilon reported for this run is not the epsilon of the sampler that ran."
        )
    return r


def matches_torch_optimizer(
    optimizer: Any,
    torch_optimizer: type[torch.optim.Optimizer],
    *,
    steps: int = 3,
    atol: float = 1e-6,
    **torch_kwargs: Any,
) -> bool:
    """Whether ``optimizer`` (an :class:`opake_core.optim.Optimizer`, built with ``non_private=True`` so that it takes
    plain tensors) moves a parameter ``[2]`` as ``torch_optimizer(params, **torch_kwargs)`` does over ``steps`` fixed
    gradients, to ``atol`` (float32).

    Example:

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.sgd(lr=0.1, non_private=True), torch.optim.SGD, lr=0.1)
        True
        >>> testing.matches_torch_optimizer(optim.sgd(lr=0.1, non_private=True), torch.optim.SGD, lr=0.2)
        False
    """
    grads = torch.tensor([[0.5, 0.1], [-0.3, 0.2], [0.1, 0.4], [0.2, -0.5]]).repeat(math.ceil(steps / 4), 1)[:steps]
    params = {"w": torch.tensor([1.0, -2.0])}
    reference = torch.nn.Parameter(params["w"].clone())
    reference_optimizer, state = torch_optimizer([reference], **torch_kwargs), optimizer.init(params)
    for grad in grads:
        updates, state = optimizer.update({"w": grad}, state, params=params)
        params = {"w": params["w"] + updates["w"]}
        reference.grad = grad.clone()
        reference_optimizer.step()
    return bool(torch.allclose(params["w"], reference.detach(), atol=atol))
