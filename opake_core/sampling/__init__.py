"""Batch samplers for DP-SGD as pure functions of (key, state).

``sampler.init() -> state``; ``sampler.sample(key, state) -> (indices, new_state)``; the draw for step s
depends only on (key, s). Each sampler declares its accounting with ``sampler.process(noise_multiplier,
steps)``, so a sampler and its accountant are chosen together. :func:`by_user` makes any of them user-level:
it samples users, each contributing at most ``k`` of its rows.
"""

from opake_core.sampling.b_min_sep import BMinSep, b_min_sep
from opake_core.sampling.balls_in_bins import BallsInBins, balls_in_bins
from opake_core.sampling.cyclic_poisson import CyclicPoisson, cyclic_poisson
from opake_core.sampling.fixed_size import FixedSize, fixed_size
from opake_core.sampling.k_out_of_t import KOutOfT, k_out_of_t
from opake_core.sampling.poisson import Poisson, poisson
from opake_core.sampling.sequential import Sequential, sequential
from opake_core.sampling.state import SamplerState
from opake_core.sampling.users import ByUser, by_user, filled_slots

__all__ = [
    "BMinSep",
    "BallsInBins",
    "ByUser",
    "CyclicPoisson",
    "FixedSize",
    "KOutOfT",
    "Poisson",
    "SamplerState",
    "Sequential",
    "b_min_sep",
    "balls_in_bins",
    "by_user",
    "cyclic_poisson",
    "filled_slots",
    "fixed_size",
    "k_out_of_t",
    "poisson",
    "sequential",
]
