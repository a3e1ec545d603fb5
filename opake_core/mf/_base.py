"""The contract every concrete strategy implements (a lower-triangular Toeplitz ``C``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamPlan:
    """How ``opake_core.mf.streaming`` applies ``C^-1`` one step at a time.

    * ``"identity"``: ``x_t = z_t``; no buffer.
    * ``"fir"``: ``x_t = sum_{r<p} h_r z_{t-r}`` with ``coef = h`` (the taps of ``C^-1``); keeps ``p - 1`` past ``z``.
    * ``"iir"``: ``x_t = (z_t - sum_{r>=1} c_r x_{t-r}) / c_0`` with ``coef = c`` (the band of ``C``); keeps ``p - 1``
      past outputs (Choquette-Choo et al. 2023, arXiv:2306.08153, the banded-Toeplitz case of Algorithm 9).
    * ``"blt"``: ``x_t = z_t - sum_j omega_j S_j``, then ``S_j <- theta_j S_j + x_t`` with ``coef = omega`` and
      ``decay = theta`` (McMahan et al. 2024, arXiv:2408.08868, Algorithm 3); keeps one buffer per ``S_j``.
    """

    kind: str
    coef: tuple[float, ...] = ()
    decay: tuple[float, ...] = ()

    @property
    def num_buffers(self) -> int:
        if self.kind == "identity":
            return 0
        if self.kind == "blt":
            return len(self.coef)
        return len(self.coef) - 1


class Concrete:
    """Mixin of concrete strategies: the Toeplitz coefficients of ``C`` and ``C^-1`` and a stream plan."""

    def strategy_coef(self, n: int) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    def noising_coef(self, n: int) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def plan(self) -> StreamPlan:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def num_buffers(self) -> int:
        """Model-sized buffers the streaming noise holds."""
        return self.plan.num_buffers

    def check_horizon(self, n: int) -> None:
        """Raise when the strategy cannot serve ``n`` steps (BandMF: ``bands <= n_steps``)."""
