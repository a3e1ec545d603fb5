"""Privacy processes: small frozen descriptions of what a run releases, composed like values.

A process says *what* was released (a Gaussian sum, subsampled or not, repeated, composed); the queries in
:mod:`opake_core.accounting.queries` say *how private* it is. Every process maps to a dp-accounting ``DpEvent``
(:func:`to_dp_event`), and dp-accounting does the arithmetic (for :class:`RandomAllocation`, with the PLD of
:mod:`opake_core.accounting.allocation_pld`).

Notation: ``sigma`` (noise multiplier) is the noise standard deviation divided by the L2 sensitivity of the
released sum under add-or-remove adjacency (the clipping bound); ``q`` the sampling rate; ``t`` a number of steps.
``without_replacement`` is accounted under replace-one adjacency, where that sensitivity doubles: its event gets
``sigma / 2`` (a caller passes the same ``sigma`` as everywhere else, never a halved one).

=====================================  ======================================================================
factory                                DpEvent
=====================================  ======================================================================
``gaussian(sigma)``                    ``GaussianDpEvent(sigma)``; ``sigma = 0`` is ``NonPrivateDpEvent``
``adaptive_clipping(g, ...)``          ``GaussianDpEvent(sigma_eff)`` (Andrew et al. 2021, Thm 1)
``poisson(g, q)``                      ``PoissonSampledDpEvent(q, g)``; ``q = 1`` is ``g``
``truncated_poisson(g, q, N, B)``      ``TruncatedSubsampledGaussianDpEvent(N, q, B, sigma)`` (PLD only)
``without_replacement(g, N, B)``       ``SampledWithoutReplacementDpEvent(N, B, GaussianDpEvent(sigma / 2))``
                                       (RDP, replace-one adjacency only; see :class:`WithoutReplacement`)
``random_allocation(g, t)``            ``RandomAllocationDpEvent(sigma, t)``, accounted by the numerical PLD of
                                       :mod:`opake_core.accounting.allocation_pld` (PLD only; Monte Carlo on request)
``poisson_group(g, q, k)``             ``GroupPoissonDpEvent(sigma, q, k)``: a group of ``k`` records under
                                       record-level Poisson sampling (:mod:`opake_core.accounting.group`; RDP
                                       through the Poisson step that dominates it, looser)
``repeat(p, n)``                       ``SelfComposedDpEvent(p, n)``
``compose(p1, p2, ...)``               ``ComposedDpEvent([p1, p2, ...])``
=====================================  ======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import dp_accounting

from opake_core import validate
from opake_core.accounting.allocation_pld import RandomAllocationDpEvent
from opake_core.accounting.group import GroupPoissonDpEvent
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "AdaptiveClipping",
    "Compose",
    "Gaussian",
    "Poisson",
    "PoissonGroup",
    "Process",
    "RandomAllocation",
    "Repeat",
    "TruncatedPoisson",
    "WithoutReplacement",
    "adaptive_clipping",
    "compose",
    "contains_random_allocation",
    "contains_without_replacement",
    "gaussian",
    "is_nonprivate",
    "k_out_of_t",
    "poisson",
    "poisson_group",
    "random_allocation",
    "releases",
    "repeat",
    "to_dp_event",
    "truncated_poisson",
    "without_replacement",
]


@dataclass(frozen=True)
class Gaussian:
    """One release of a sum with Gaussian noise of std ``noise_multiplier`` times its sensitivity."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", validate.noise_multiplier("noise_multiplier", self.noise_multiplier)
        )


@dataclass(frozen=True)
class AdaptiveClipping:
    """A Gaussian gradient release plus the noisy clipped-count release of adaptive clipping.

    The count is the centred sum of "was clipped" indicators (sensitivity 1/2) with Gaussian noise of std
    ``sigma_b = count_noise_fraction * expected_batch_size``. Andrew, Thakkar, McMahan, Ramaswamy,
    "Differentially private learning with adaptive clipping", NeurIPS 2021 (arXiv 1905.03871), Theorem 1: the
    two releases together are one Gaussian mechanism with multiplier ``(sigma**-2 + (2 * sigma_b)**-2) **
    -0.5``.
    """

    inner: Gaussian
    count_noise_fraction: float
    expected_batch_size: float

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Gaussian):
            raise ConfigurationError(
                f"adaptive_clipping accounts a Gaussian release, got {type(self.inner).__name__}; "
                "pass gaussian(noise_multiplier)."
            )
        for name in ("count_noise_fraction", "expected_batch_size"):
            value = validate.real(name, getattr(self, name))
            if value <= 0:
                raise ConfigurationError(f"{name} must be > 0, got {value!r}.")
            object.__setattr__(self, name, value)

    @property
    def effective_noise_multiplier(self) -> float:
        sigma = self.inner.noise_multiplier
        if sigma == 0.0:
            return 0.0
        sigma_b = self.count_noise_fraction * self.expected_batch_size
        return (sigma**-2 + (2.0 * sigma_b) ** -2) ** -0.5


_Mechanism = Gaussian | AdaptiveClipping


def _check_mechanism(where: str, inner: object) -> None:
    if not isinstance(inner, Gaussian | AdaptiveClipping):
        raise ConfigurationError(
            f"{where} amplifies a Gaussian release, got {type(inner).__name__}; there is no correct "
            f"accountant for "
            "that pair here. Pass gaussian(...) or adaptive_clipping(...)."
        )


@dataclass(frozen=True)
class Poisson:
    """One step of Poisson sampling at rate ``sample_rate`` followed by ``inner``."""

    inner: _Mechanism
    sample_rate: float

    def __post_init__(self) -> None:
        _check_mechanism("poisson", self.inner)
        object.__setattr__(self, "sample_rate", validate.rate("sample_rate", self.sample_rate))


@dataclass(frozen=True)
class TruncatedPoisson:
    """One step of Poisson sampling capped at ``truncated_batch_size`` (a uniform subset of the cap is kept).

    Accounted with dp-accounting's truncated analysis (Ganesh 2025, arXiv 2508.15089), which needs the public
    ``dataset_size`` and is available with the PLD accountant only.
    """

    inner: _Mechanism
    sample_rate: float
    dataset_size: int
    truncated_batch_size: int

    def __post_init__(self) -> None:
        _check_mechanism("truncated_poisson", self.inner)
        q = validate.rate("sample_rate", self.sample_rate)
        if q == 1.0:
            raise ConfigurationError(
                "truncated_poisson needs sample_rate < 1, got 1.0; with q = 1 use a fixed batch, not truncation."
            )
        object.__setattr__(self, "sample_rate", q)
        object.__setattr__(self, "dataset_size", validate.integer("dataset_size", self.dataset_size, minimum=1))
        object.__setattr__(
            self,
            "truncated_batch_size",
            validate.integer("truncated_batch_size", self.truncated_batch_size, minimum=1),
        )


@dataclass(frozen=True)
class WithoutReplacement:
    """One step on a batch of exactly ``sample_size`` distinct examples drawn uniformly from ``dataset_size``,
    followed by the Gaussian release ``inner``.

    Accounted under **replace-one** adjacency (the dataset size is public, a neighbour replaces one example), the
    only relation with an amplification bound for this sampler (Wang, Balle and Kasiviswanathan 2019, Theorem 27;
    dp-accounting's RDP accountant). Replacing an example moves the clipped sum by up to twice the clipping bound,
    so a noise of ``sigma`` times the bound is a Gaussian release with multiplier ``sigma / 2`` under that
    relation, which is the event given to dp-accounting. The epsilon is not comparable one-to-one with an
    add-or-remove epsilon (Poisson sampling): it answers for a replaced example, not a removed one.
    """

    inner: Gaussian
    dataset_size: int
    sample_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Gaussian):
            raise ConfigurationError(
                f"without_replacement amplifies a plain Gaussian release, got {type(self.inner).__name__}: adaptive "
                "clipping's count is accounted with Poisson sampling only. Use gaussian(...)."
            )
        n = validate.integer("dataset_size", self.dataset_size, minimum=1)
        b = validate.integer("sample_size", self.sample_size, minimum=1)
        if b > n:
            raise ConfigurationError(f"sample_size must be <= dataset_size, got sample_size={b} > dataset_size={n}.")


@dataclass(frozen=True)
class RandomAllocation:
    """A whole-horizon release: the example takes part in exactly one of ``num_steps`` steps, chosen
    uniformly.

    Feldman & Shenfeld, "Privacy amplification by random allocation", 2025 (arXiv 2502.08202). Its dominating
    pair (add direction) is ``P = (1/t) sum_j N(e_j, sigma^2 I_t)`` against ``Q = N(0, sigma^2 I_t)``.
    """

    inner: Gaussian
    num_steps: int

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Gaussian):
            raise ConfigurationError(
                f"random_allocation is accounted for a plain Gaussian release, got "
                f"{type(self.inner).__name__}; "
                "pass gaussian(noise_multiplier)."
            )
        object.__setattr__(self, "num_steps", validate.integer("num_steps", self.num_steps, minimum=1))


@dataclass(frozen=True)
class PoissonGroup:
    """One step of record-level Poisson sampling at ``sample_rate`` of a Gaussian release, accounted for a group of
    ``group_size`` records (a user with that many rows): :mod:`opake_core.accounting.group`."""

    inner: Gaussian
    sample_rate: float
    group_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Gaussian):
            raise ConfigurationError(
                f"poisson_group is accounted for a plain Gaussian release, got {type(self.inner).__name__}; pass "
                "gaussian(noise_multiplier)."
            )
        object.__setattr__(self, "sample_rate", validate.rate("sample_rate", self.sample_rate))
        object.__setattr__(self, "group_size", validate.integer("group_size", self.group_size, minimum=1))


@dataclass(frozen=True)
class Repeat:
    """``process`` run ``count`` times (independent randomness each time)."""

    process: Process
    count: int

    def __post_init__(self) -> None:
        _check_process("repeat", self.process)
        object.__setattr__(self, "count", validate.integer("count", self.count, minimum=1))


@dataclass(frozen=True)
class Compose:
    """The processes run one after another on the same data (build it with :func:`compose`).

    Example:

        >>> from opake_core import accounting
        >>> run = accounting.compose(accounting.gaussian(4.0), accounting.gaussian(3.0))
        >>> type(run).__name__, len(run.processes)
        ('Compose', 2)
    """

    processes: tuple[Process, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "processes", tuple(self.processes))
        if not self.processes:
            raise ConfigurationError("compose needs at least one process, got none.")
        for p in self.processes:
            _check_process("compose", p)


Process = (
    Gaussian
    | AdaptiveClipping
    | Poisson
    | TruncatedPoisson
    | WithoutReplacement
    | RandomAllocation
    | PoissonGroup
    | Repeat
    | Compose
)
"""Any process: what the queries (``epsilon``, ``delta``, the calibrations) accept."""


def _check_process(where: str, p: object) -> None:
    if not isinstance(p, Process):
        raise InputTypeError(f"{where} expects a process (gaussian, poisson, ...), got {type(p).__name__} {p!r}.")


def gaussian(noise_multiplier: float) -> Gaussian:
    """One Gaussian release; ``noise_multiplier = 0`` is an explicit non-private release (epsilon = inf).

    Example: its epsilon is dp-accounting's for a ``GaussianDpEvent``.

        >>> import dp_accounting
        >>> from opake_core import accounting
        >>> ours = accounting.epsilon(accounting.gaussian(2.0), delta=1e-5, accountant="rdp").value
        >>> theirs = dp_accounting.rdp.RdpAccountant().compose(dp_accounting.GaussianDpEvent(2.0)).get_epsilon(1e-5)
        >>> bool(ours == theirs), accounting.epsilon(accounting.gaussian(0.0), delta=1e-5).value
        (True, inf)
    """
    return Gaussian(noise_multiplier)


def adaptive_clipping(inner: Gaussian, *, count_noise_fraction: float, expected_batch_size: float) -> AdaptiveClipping:
    """The gradient release ``inner`` plus adaptive clipping's noisy count (see :class:`AdaptiveClipping`).

    Example: with the count's noise std ``0.05 * 100 = 5`` the pair is one Gaussian with multiplier
    ``(1 + (2 * 5)^-2)^-1/2``.

        >>> from opake_core import accounting
        >>> step = accounting.adaptive_clipping(accounting.gaussian(1.0), count_noise_fraction=0.05,
        ...                                     expected_batch_size=100.0)
        >>> round(step.effective_noise_multiplier, 6), round((1 + 10.0**-2) ** -0.5, 6)
        (0.995037, 0.995037)
    """
    return AdaptiveClipping(inner, count_noise_fraction, expected_batch_size)


def poisson(inner: Gaussian | AdaptiveClipping, sample_rate: float) -> Poisson:
    """One Poisson-sampled step of ``inner``.

    Example: 100 steps at rate 0.01 with multiplier 2, against dp-accounting's PLD accountant directly.

        >>> import dp_accounting
        >>> from opake_core import accounting
        >>> run = accounting.repeat(accounting.poisson(accounting.gaussian(2.0), 0.01), 100)
        >>> event = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(2.0))
        >>> direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        >>> direct.compose(dp_accounting.SelfComposedDpEvent(event, 100)).get_epsilon(1e-5) == accounting.epsilon(
        ...     run, delta=1e-5).value
        True
    """
    return Poisson(inner, sample_rate)


def truncated_poisson(
    inner: Gaussian | AdaptiveClipping, sample_rate: float, *, dataset_size: int, truncated_batch_size: int
) -> TruncatedPoisson:
    """One truncated-Poisson step of ``inner`` (see :class:`TruncatedPoisson`).

    Example: a cap at 15 of an expected 10 costs a little privacy over plain Poisson sampling.

        >>> from opake_core import accounting
        >>> capped = accounting.truncated_poisson(accounting.gaussian(3.0), 0.01, dataset_size=1_000,
        ...                                       truncated_batch_size=15)
        >>> plain = accounting.poisson(accounting.gaussian(3.0), 0.01)
        >>> accounting.epsilon(capped, delta=1e-5).value > accounting.epsilon(plain, delta=1e-5).value
        True
    """
    return TruncatedPoisson(inner, sample_rate, dataset_size, truncated_batch_size)


def without_replacement(inner: Gaussian, *, dataset_size: int, sample_size: int) -> WithoutReplacement:
    """One step on a uniformly drawn batch of exactly ``sample_size`` examples (see :class:`WithoutReplacement`).

    Example: accounted by RDP under replace-one adjacency, with the multiplier halved for dp-accounting.

        >>> import dp_accounting
        >>> from opake_core import accounting
        >>> run = accounting.repeat(accounting.without_replacement(accounting.gaussian(2.0), dataset_size=1_000,
        ...                                                        sample_size=10), 100)
        >>> result = accounting.epsilon(run, delta=1e-5)
        >>> result.accountant, accounting.default_adjacency(run)
        ('rdp', 'replace_one')
        >>> direct = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        >>> event = dp_accounting.SampledWithoutReplacementDpEvent(1_000, 10, dp_accounting.GaussianDpEvent(1.0))
        >>> bool(direct.compose(dp_accounting.SelfComposedDpEvent(event, 100)).get_epsilon(1e-5) == result.value)
        True
    """
    return WithoutReplacement(inner, dataset_size, sample_size)


def random_allocation(inner: Gaussian, num_steps: int) -> RandomAllocation:
    """1-out-of-``num_steps`` random allocation of ``inner`` (a whole horizon, include it once).

    Example: accounted by its numerical PLD (an upper bound, deterministic), more private than ten Poisson steps at
    rate 1/10; the Monte Carlo estimator answers on request (its confidence bound is looser).

        >>> from opake_core import accounting
        >>> once_in_ten = accounting.random_allocation(accounting.gaussian(1.0), 10)
        >>> exact = accounting.epsilon(once_in_ten, delta=1e-2)
        >>> exact.accountant, round(exact.value, 2)
        ('pld', 0.73)
        >>> poisson = accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.1), 10)
        >>> round(accounting.epsilon(poisson, delta=1e-2).value, 2)
        0.89
        >>> settings = accounting.MonteCarlo(num_samples=50_000, failure_probability=1e-3)
        >>> sampled = accounting.epsilon(once_in_ten, delta=1e-2, accountant="monte_carlo", monte_carlo=settings)
        >>> sampled.accountant, exact.value <= sampled.value < 1.0
        ('monte_carlo', True)
    """
    return RandomAllocation(inner, num_steps)


def poisson_group(inner: Gaussian, sample_rate: float, *, group_size: int) -> PoissonGroup:
    """One step of record-level Poisson sampling of ``inner``, seen by a group of ``group_size`` records: the
    user-level guarantee of a record-level run whose users hold at most ``group_size`` rows (ELS).

    Cost: a query takes seconds (the mixture's PLD is built on the grid, then composed; 1,000 steps at q = 0.01 and
    z = 1 on one CPU core: about 2 s for a group of 2, 14 s for a group of 8). ``accountant="rdp"`` answers at once
    with a looser bound (the dominating Poisson step, :func:`opake_core.accounting.group.rdp_dominating`), which
    also sizes the PLD grid and starts a calibration near its answer.

    Example: a group of one is the Poisson step itself; a user with 4 rows costs about 4 times the epsilon of a row
    (at the same delta: the group-privacy theorem would multiply delta too).

        >>> from opake_core import accounting
        >>> g = accounting.gaussian(1.0)
        >>> row = accounting.epsilon(accounting.repeat(accounting.poisson(g, 0.01), 100), delta=1e-5).value
        >>> one = accounting.repeat(accounting.poisson_group(g, 0.01, group_size=1), 100)
        >>> abs(accounting.epsilon(one, delta=1e-5).value - row) < 1e-6
        True
        >>> four = accounting.repeat(accounting.poisson_group(g, 0.01, group_size=4), 100)
        >>> round(row, 2), round(accounting.epsilon(four, delta=1e-5).value, 2)
        (0.72, 3.21)
    """
    return PoissonGroup(inner, sample_rate, group_size)


def k_out_of_t(inner: Gaussian, *, k: int, t: int, allocation: str) -> Process:
    """The whole-horizon process of the k-out-of-t sampler over ``t`` steps.

    * ``"block"``: ``t`` is split into ``k`` equal blocks, one uniform step per block: exactly ``k`` independent
      1-out-of-``t/k`` allocations (needs ``t % k == 0``).
    * ``"total"``: a uniform ``k``-subset of the ``t`` steps. Bounded (conservatively) by the block reduction with
      block sizes ``floor(t/k)`` and ``ceil(t/k)`` (Feldman & Shenfeld 2025, arXiv 2502.08202).

    Example:

        >>> from opake_core import accounting
        >>> g = accounting.gaussian(1.0)
        >>> accounting.k_out_of_t(g, k=2, t=10, allocation="block") == accounting.repeat(
        ...     accounting.random_allocation(g, 5), 2)
        True
    """
    k = validate.integer("k", k, minimum=1)
    t = validate.integer("t", t, minimum=1)
    if k > t:
        raise ConfigurationError(
            f"k must be <= t, got k={k}, t={t}; an example cannot take part in more steps than exist."
        )
    if allocation == "block":
        if t % k:
            raise ConfigurationError(
                f"allocation='block' needs t divisible by k, got t={t}, k={k}; choose t a multiple of k or "
                f"use "
                "allocation='total'."
            )
        return repeat(random_allocation(inner, t // k), k)
    if allocation == "total":
        size, extra = divmod(t, k)
        parts = [repeat(random_allocation(inner, size), k - extra)]
        if extra:
            parts.append(repeat(random_allocation(inner, size + 1), extra))
        return compose(*parts)
    raise ConfigurationError(f"allocation must be 'block' or 'total', got {allocation!r}.")


def repeat(process: Process, count: int) -> Repeat:
    """``process`` composed with itself ``count`` times (``count >= 1``).

    Example: four releases at multiplier 2 are as private as one at multiplier 1 (Gaussian composition).

        >>> from opake_core import accounting
        >>> four = accounting.epsilon(accounting.repeat(accounting.gaussian(2.0), 4), delta=1e-5, accountant="rdp")
        >>> one = accounting.epsilon(accounting.gaussian(1.0), delta=1e-5, accountant="rdp")
        >>> abs(four.value - one.value) < 1e-9
        True
    """
    return Repeat(process, count)


def compose(*processes: Process) -> Process:
    """The sequential composition of ``processes``; a single process is returned unchanged.

    Example: a run resumed with more noise costs more than its first part alone.

        >>> from opake_core import accounting
        >>> first = accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.01), 600)
        >>> then = accounting.repeat(accounting.poisson(accounting.gaussian(3.0), 0.01), 400)
        >>> whole = accounting.compose(first, then)
        >>> eps = lambda p: accounting.epsilon(p, delta=1e-5, accountant="rdp").value
        >>> eps(first) < eps(whole), accounting.compose(first) is first
        (True, True)
    """
    if len(processes) == 1:
        _check_process("compose", processes[0])
        return processes[0]
    return Compose(tuple(processes))


def _children(p: Process) -> tuple[Process, ...]:
    if isinstance(p, Repeat):
        return (p.process,)
    if isinstance(p, Compose):
        return p.processes
    return ()


def releases(p: Process) -> list[Process]:
    """The single releases ``p`` composes: its parts inside every repeat and composition, in order."""
    children = _children(p)
    return [p] if not children else [part for c in children for part in releases(c)]


def contains_random_allocation(p: Process) -> bool:
    """Whether ``p`` has a random-allocation part (it has no dp-accounting event)."""
    return any(isinstance(part, RandomAllocation) for part in releases(p))


def contains_without_replacement(p: Process) -> bool:
    """Whether ``p`` has a sampled-without-replacement part (accounted under replace-one adjacency only).

    Example:

        >>> from opake_core import accounting
        >>> fixed = accounting.without_replacement(accounting.gaussian(1.0), dataset_size=100, sample_size=10)
        >>> accounting.contains_without_replacement(accounting.repeat(fixed, 5))
        True
    """
    return any(isinstance(part, WithoutReplacement) for part in releases(p))


def is_nonprivate(p: Process) -> bool:
    """Whether any part of ``p`` is released without noise (its epsilon is inf).

    Example:

        >>> from opake_core import accounting
        >>> accounting.is_nonprivate(accounting.compose(accounting.gaussian(1.0), accounting.gaussian(0.0)))
        True
    """
    if isinstance(p, Gaussian):
        return p.noise_multiplier == 0.0
    if isinstance(p, Poisson | TruncatedPoisson | RandomAllocation | PoissonGroup | AdaptiveClipping):
        return is_nonprivate(p.inner)
    if isinstance(p, WithoutReplacement):
        return is_nonprivate(p.inner)
    return any(is_nonprivate(c) for c in _children(p))


def _gaussian_event(multiplier: float) -> dp_accounting.DpEvent:
    if multiplier == 0.0:
        return dp_accounting.NonPrivateDpEvent()
    return dp_accounting.GaussianDpEvent(multiplier)


def _multiplier(inner: Gaussian | AdaptiveClipping) -> float:
    if isinstance(inner, AdaptiveClipping):
        return inner.effective_noise_multiplier
    return inner.noise_multiplier


def to_dp_event(p: Process) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``p``; random allocation has none and raises ConfigurationError.

    Example:

        >>> from opake_core import accounting
        >>> event = accounting.to_dp_event(accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.01), 3))
        >>> event.count, event.event
        (3, PoissonSampledDpEvent(sampling_probability=0.01, event=GaussianDpEvent(noise_multiplier=1.0)))
    """
    if isinstance(p, Gaussian | AdaptiveClipping):
        return _gaussian_event(_multiplier(p))
    if isinstance(p, Poisson):
        inner = _gaussian_event(_multiplier(p.inner))
        if p.sample_rate == 1.0 or isinstance(inner, dp_accounting.NonPrivateDpEvent):
            return inner
        return dp_accounting.PoissonSampledDpEvent(p.sample_rate, inner)
    if isinstance(p, TruncatedPoisson):
        sigma = _multiplier(p.inner)
        if sigma == 0.0:
            return dp_accounting.NonPrivateDpEvent()
        return dp_accounting.TruncatedSubsampledGaussianDpEvent(
            dataset_size=p.dataset_size,
            sampling_probability=p.sample_rate,
            truncated_batch_size=p.truncated_batch_size,
            noise_multiplier=sigma,
        )
    if isinstance(p, WithoutReplacement):
        sigma = p.inner.noise_multiplier
        if sigma == 0.0:
            return dp_accounting.NonPrivateDpEvent()
        # replace-one sensitivity of the clipped sum: twice the clipping bound
        return dp_accounting.SampledWithoutReplacementDpEvent(
            p.dataset_size, p.sample_size, dp_accounting.GaussianDpEvent(sigma / 2.0)
        )
    if isinstance(p, Repeat):
        return dp_accounting.SelfComposedDpEvent(to_dp_event(p.process), p.count)
    if isinstance(p, Compose):
        return dp_accounting.ComposedDpEvent([to_dp_event(c) for c in p.processes])
    if isinstance(p, RandomAllocation):
        sigma = p.inner.noise_multiplier
        return dp_accounting.NonPrivateDpEvent() if sigma == 0.0 else RandomAllocationDpEvent(sigma, p.num_steps)
    if isinstance(p, PoissonGroup):
        sigma = p.inner.noise_multiplier
        if sigma == 0.0:
            return dp_accounting.NonPrivateDpEvent()
        return GroupPoissonDpEvent(sigma, p.sample_rate, p.group_size)
    raise InputTypeError(f"to_dp_event expects a process, got {type(p).__name__} {p!r}.")
