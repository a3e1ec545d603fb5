"""Whole-horizon accounting of DP-FTRL (matrix-factorization) runs: one entry point, :func:`mf_process`.

``mf_process(strategy, sampler=..., noise_multiplier=z, n_steps=n)`` validates the triple (mechanism, sampler,
horizon) together and returns the process of the **whole** run; MF noise is correlated across steps, so there is no
per-step accounting and every epsilon reported during the run is this full-horizon value.

Noise convention (that of :func:`opake_core.mf.mf_gaussian_noise` and :func:`opake_core.step.dp_ftrl`): the run adds
``C^-1 w`` with ``w ~ N(0, (z * sens(C, P) * Delta)^2 I)``, ``Delta`` the per-step clipped sensitivity and ``P`` the
``participation`` the noise was scaled with (single participation by default, so ``sens = ||c||``, the max column
norm of ``C``). Pass the same ``participation`` here as to the noise. Below, ``z_1 = z * sens(C, P) / ||c||`` is the
multiplier relative to one column of ``C``.

==========================  =================  ===================================================================
mechanism                   sampler            process
==========================  =================  ===================================================================
``mf_band`` (BandMF)        ``cyclic_poisson`` ``repeat(poisson(gaussian(z_1), q), ceil(n / b))``: the exact
                                               reduction of Choquette-Choo et al. 2023 (arXiv 2306.08153, Theorem 1,
                                               formally Theorems 4-5, Algorithm 2): each group is visited every ``b``
                                               steps, its columns of the b-banded ``C`` are orthogonal, and each
                                               visit is a Poisson-subsampled Gaussian at the conditional rate ``q``
                                               with per-round sensitivity ``||c||``. Needs bands = groups.
``mf_band``                 ``b_min_sep``      :class:`BMinSepMF`, Monte Carlo (Dong and Ganesh 2026, arXiv
                                               2602.09338, Eq. 2); needs bands <= min_sep.
``mf_blt|bisr|bsr|``        ``balls_in_bins``  :class:`BallsInBinsMF`, Monte Carlo of the dominating pair of
``lambda_cgd``                                 Choquette-Choo et al. 2024 (arXiv 2410.06266, Lemma 3.2; needs
                                               ``C >= 0``); ``n_steps`` a multiple of the number of bins.
``mf_identity``             ``poisson``        exactly the DP-SGD process ``sampler.process(z_1, n)``.
``mf_identity``             ``balls_in_bins``  ``random_allocation(gaussian(z_1 / sqrt(k)), bins)``, ``k = n / bins``:
                                               fixed bins over ``k`` epochs with ``C = I`` have Gram ``k I``.
any of the above            (``amplified=False``) ``gaussian(z * sens(C, P) / sens(C, P_sampler))``: one Gaussian
                                               mechanism over the horizon with the sensitivity under the sampler's
                                               participation pattern (no amplification).
==========================  =================  ===================================================================

Private second moments (:func:`opake_core.noise.paired_mf_gaussian_noise`) add a second stream with its own
strategy; whitened, the pair has the first strategy's Gram matrix when both strategies are the same, so the table
above accounts it unchanged. ``second_moment_strategy=`` names a different one, and ``mf_process`` accepts it only
where the first strategy's process still covers the pair: unamplified (``amplified=False``, the noise scaled for the
sampler's own participation pattern), or BandMF under cyclic Poisson with single participation and a second strategy
with at most as many bands as the sampler has groups (each visit of a group is then one Poisson-subsampled Gaussian
of whitened sensitivity ``1 / z``). Anything else, the Monte Carlo accountants in particular, is refused.

The Monte Carlo processes (``BMinSepMF``, ``BallsInBinsMF``) are accounted in
:mod:`opake_core.accounting.mf_monte_carlo`; every query (``epsilon``, ``delta``, ``calibrate_noise_multiplier``)
dispatches on the process, so a caller never needs to know which accountant answers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from opake_core import mf as _mf
from opake_core import validate
from opake_core.accounting.mf_monte_carlo import BallsInBinsMF, BMinSepMF, _check_bins
from opake_core.accounting.processes import Process, gaussian, poisson, random_allocation, repeat
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.mf.participation import SINGLE

__all__ = [
    "COMPATIBLE_SAMPLERS",
    "MFProcess",
    "mechanism_name",
    "mf_process",
    "sampler_participation",
]

COMPATIBLE_SAMPLERS: dict[str, tuple[str, ...]] = {
    "mf_band": ("cyclic_poisson", "b_min_sep"),
    "mf_blt": ("balls_in_bins",),
    "mf_bisr": ("balls_in_bins",),
    "mf_bsr": ("balls_in_bins",),
    "mf_lambda_cgd": ("balls_in_bins",),
    "mf_identity": ("poisson", "balls_in_bins"),
}
"""The mechanism x sampler pairs that have an accountant here (``mf_process`` refuses every other pair)."""

_MECHANISMS = (
    ((_mf.BandMF, _mf.BandedToeplitz), "mf_band"),
    ((_mf.BLT, _mf.BufferedToeplitz), "mf_blt"),
    ((_mf.BISR,), "mf_bisr"),
    ((_mf.BSR,), "mf_bsr"),
    ((_mf.LambdaCGD,), "mf_lambda_cgd"),
    ((_mf.Identity,), "mf_identity"),
)
MFProcess = Process | BallsInBinsMF | BMinSepMF
"""What :func:`mf_process` returns: a dp-accounting process, or one of the Monte Carlo processes."""


def mechanism_name(strategy: Any) -> str:
    """The mechanism name (``"mf_band"``, ``"mf_blt"``, ...) of an :mod:`opake_core.mf` strategy."""
    for types, name in _MECHANISMS:
        if isinstance(strategy, types):
            return name
    raise InputTypeError(
        f"expected an opake_core.mf strategy (identity(), band_mf(), blt(), bsr(), bisr(), lambda_cgd()), got "
        f"{type(strategy).__name__}."
    )


def _sampler_name(sampler: Any) -> str:
    config = getattr(sampler, "config", None)
    name = dict(config).get("sampler") if isinstance(config, tuple) else None
    if not isinstance(name, str):
        raise InputTypeError(
            f"sampler must be an opake_core.sampling sampler (cyclic_poisson, b_min_sep, balls_in_bins, poisson), "
            f"got {type(sampler).__name__}."
        )
    return name


def sampler_participation(sampler: Any) -> _mf.MinSepParticipation | _mf.CyclicParticipation:
    """The participation pattern a sampler guarantees (what unamplified accounting and optimization use).

    Example:

        >>> from opake_core import accounting, sampling
        >>> accounting.sampler_participation(sampling.b_min_sep(dataset_size=1_000, sample_rate=0.05, min_sep=4))
        MinSepParticipation(min_sep=4, max_participations=None)
        >>> accounting.sampler_participation(sampling.balls_in_bins(dataset_size=1_000, num_bins=8))
        CyclicParticipation(cycle_length=8)
    """
    name = _sampler_name(sampler)
    if name == "cyclic_poisson":
        return _mf.CyclicParticipation(sampler.bands)
    if name == "balls_in_bins":
        return _mf.CyclicParticipation(sampler.num_bins)
    if name == "b_min_sep":
        return _mf.MinSepParticipation(sampler.min_sep)
    if name == "poisson":
        return _mf.MinSepParticipation(1)
    raise ConfigurationError(f"the {name!r} sampler has no matrix-factorization participation pattern here.")


def mf_process(
    strategy: Any,
    *,
    sampler: Any,
    noise_multiplier: float,
    n_steps: int,
    participation: Any = SINGLE,
    amplified: bool = True,
    second_moment_strategy: Any = None,
) -> MFProcess:
    """The whole-horizon privacy process of a DP-FTRL run (see the module docstring for each pair).

    Args:
        strategy: an :mod:`opake_core.mf` strategy; ``band_mf``/``blt`` specifications are optimized for
            ``n_steps`` and ``participation`` exactly as :func:`opake_core.mf.mf_gaussian_noise` does (pass the
            result of ``opake_core.mf.optimize`` to both to optimize once).
        sampler: an :mod:`opake_core.sampling` sampler compatible with the mechanism (:data:`COMPATIBLE_SAMPLERS`).
        noise_multiplier: ``z >= 0``, the multiplier given to the noise; 0 is a non-private run.
        n_steps: the horizon ``n``.
        participation: the participation pattern the noise was scaled with (``sens(C, participation)``).
        amplified: ``False`` accounts the run as one Gaussian mechanism with the sensitivity under the sampler's
            participation pattern (a valid, looser bound).
        second_moment_strategy: the strategy of the second-moment stream of a private-second-moment run (None:
            none, or the same strategy as ``strategy``); see the module docstring for where it is covered.

    Raises:
        ConfigurationError: an incompatible mechanism/sampler pair (the message names the compatible samplers), a
            Poisson sampler with ``sharding="global"`` (a record can join a step several times),
            BandMF bands > n_steps, bands != the cyclic sampler's groups or > min_sep, a balls-in-bins horizon that
            is not a multiple of the bins, a negative coefficient under balls-in-bins, a second-moment strategy
            that the process does not cover.
        InputTypeError: not a strategy or not a sampler.

    Example: BandMF with cyclic Poisson sampling over as many groups as bands is exactly a Poisson-subsampled
    Gaussian visited once every ``bands`` steps (a refused pair names the samplers that work).

        >>> from opake_core import ConfigurationError, accounting, mf, sampling
        >>> sampler = sampling.cyclic_poisson(dataset_size=1_000, sample_rate=0.05, bands=2)
        >>> run = accounting.mf_process(mf.band_mf(bands=2), sampler=sampler, noise_multiplier=1.0, n_steps=100)
        >>> run == accounting.repeat(accounting.poisson(accounting.gaussian(1.0), sampler.conditional_rate), 50)
        True
        >>> try:
        ...     poisson = sampling.poisson(dataset_size=1_000, sample_rate=0.05)
        ...     accounting.mf_process(mf.band_mf(bands=2), sampler=poisson, noise_multiplier=1.0, n_steps=100)
        ... except ConfigurationError as error:
        ...     print(str(error)[:78])
        mechanism 'mf_band' cannot be accounted with the 'poisson' sampler; use one of
    """
    mechanism, name = mechanism_name(strategy), _sampler_name(sampler)
    allowed = COMPATIBLE_SAMPLERS[mechanism]
    if name not in allowed:
        users = sorted(m for m, s in COMPATIBLE_SAMPLERS.items() if name in s)
        hint = f"; the {name!r} sampler goes with {users}" if users else ""
        raise ConfigurationError(
            f"mechanism {mechanism!r} cannot be accounted with the {name!r} sampler; use one of {list(allowed)} "
            f"for {mechanism!r}{hint}."
        )
    if getattr(sampler, "sharding", "per_rank") != "per_rank":
        raise ConfigurationError(
            f"matrix-factorization noise is accounted for a record that joins a step at most once, but the "
            f"{name!r} sampler with sharding={sampler.sharding!r} lets {sampler.world_size} ranks draw the same record "
            "in one step. Use sharding='per_rank' (disjoint shards), or DP-SGD (gaussian) with the global sharding."
        )
    n = validate.integer("n_steps", n_steps, minimum=1)
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    concrete = _mf.optimize(strategy, n, participation=participation)
    coef = _mf.coefficients(concrete, n)
    z1 = z * _mf.sensitivity(concrete, n, participation=participation) / float(np.linalg.norm(coef))
    if name == "balls_in_bins":
        _check_bins(n, sampler.num_bins)
    if name == "cyclic_poisson" and _mf.band_count(concrete, n) != sampler.bands:
        raise ConfigurationError(
            f"BandMF with cyclic Poisson needs the strategy's bands to equal the sampler's groups, got bands="
            f"{_mf.band_count(concrete, n)} and cyclic_poisson(bands={sampler.bands}); build both with the same "
            "bands."
        )
    if name == "b_min_sep" and _mf.band_count(concrete, n) > sampler.min_sep:
        raise ConfigurationError(
            f"BandMF with b-min-sep sampling needs bands <= min_sep, got bands={_mf.band_count(concrete, n)} and "
            f"min_sep={sampler.min_sep}; use fewer bands or a larger min_sep."
        )
    if second_moment_strategy is not None:
        second = _mf.optimize(second_moment_strategy, n, participation=participation)
        if second != concrete:
            _check_second_moment(second, sampler, n=n, participation=participation, amplified=amplified)
    if not amplified:
        pattern = sampler_participation(sampler)
        return gaussian(
            z
            * _mf.sensitivity(concrete, n, participation=participation)
            / _mf.sensitivity(concrete, n, participation=pattern)
        )
    if name == "poisson":
        return sampler.process(z1, n)
    if name == "cyclic_poisson":
        return repeat(poisson(gaussian(z1), sampler.conditional_rate), math.ceil(n / sampler.bands))
    if name == "b_min_sep":
        band = coef[: _mf.band_count(concrete, n)]
        return BMinSepMF(tuple(band), z1, sampler.min_sep, sampler.sampling_prob, n)
    if mechanism == "mf_identity":
        return random_allocation(gaussian(z1 / math.sqrt(n // sampler.num_bins)), sampler.num_bins)
    return BallsInBinsMF(tuple(coef), z1, sampler.num_bins, n)


def _check_second_moment(second: Any, sampler: Any, *, n: int, participation: Any, amplified: bool) -> None:
    """Refuse a second-moment strategy, different from the first, that the first strategy's process does not cover
    (see the module docstring)."""
    name = _sampler_name(sampler)
    if not amplified:
        pattern = sampler_participation(sampler)
        if participation == pattern:
            return
        reason = (
            f"unamplified accounting covers it only when the noise is scaled for the sampler's own participation "
            f"pattern ({pattern}), got participation={participation}"
        )
    elif name == "cyclic_poisson" and participation == SINGLE and _mf.band_count(second, n) <= sampler.bands:
        return
    elif name == "cyclic_poisson":
        reason = (
            f"cyclic Poisson covers it with single participation and at most {sampler.bands} bands (the sampler's "
            f"groups), got {_mf.band_count(second, n)} bands and participation={participation}"
        )
    else:
        reason = f"the {name!r} sampler's accountant is computed from the first strategy's coefficients alone"
    raise ConfigurationError(
        f"the second-moment stream's strategy differs from the first stream's and is not covered by this "
        f"accountant: {reason}. Pass the same strategy for both streams (the pair is then accounted unchanged), "
        "or account with amplified=False and the noise scaled for the sampler's participation pattern."
    )
