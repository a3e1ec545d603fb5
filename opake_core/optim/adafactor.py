"""Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", ICML,
arXiv:1804.04235), Algorithms 4 and 5 without momentum (their recommended ``beta1 = 0``).

Per leaf, at update ``t`` (from 1), with ``beta2_t = 1 - t^decay_rate`` and gradient ``G``:

* leaves with >= 2 dimensions keep a factored second moment over the last two dimensions (rows ``n``, columns
  ``m``; leading dimensions are batched): ``R_t = beta2_t R_{t-1} + (1 - beta2_t) mean_cols(G^2 + eps1)`` and
  ``C_t = beta2_t C_{t-1} + (1 - beta2_t) mean_rows(G^2 + eps1)``, and ``V_hat = R_t C_t^T / mean(R_t)`` (the
  paper's row and column *sums* give the same ``V_hat``); memory ``n + m`` instead of ``n * m``;
* other leaves keep ``V_t = beta2_t V_{t-1} + (1 - beta2_t)(G^2 + eps1)``;
* ``U = G / sqrt(V_hat)``, clipped per leaf to ``U / max(1, RMS(U) / clip_threshold)``;
* the step is relative to the parameter's scale: ``update = -lr_t * (max(eps2, RMS(X_{t-1})) * U +
  weight_decay * X_{t-1})``, with ``lr_t`` the paper's relative step size ``rho_t`` (a float or a schedule).

``RMS(x) = sqrt(mean(x^2))`` over one leaf.

**Noise-bias correction** (``noise_bias_correction=True``; :mod:`opake_core.optim.bias_correction` for Adam's). A
noised gradient is ``G = S + Z`` with ``Z`` of independent ``N(0, sigma_t^2)`` entries (``sigma_t`` the leaf's noise
std at update ``t``), independent of the signal ``S``. Then ``E[G^2] = S^2 + sigma_t^2`` entrywise, and a row mean
or a column mean of ``G^2 + eps1`` has expectation that of ``S^2 + eps1`` plus ``sigma_t^2``: every entry of every
row statistic and column statistic absorbs the same ``sigma_t^2``. The three accumulators are linear recursions with
the same weights, so by induction

    ``E[R_t] = R_t(S) + phi_t``, ``E[C_t] = C_t(S) + phi_t``, ``E[V_t] = V_t(S) + phi_t``,
    ``phi_t = beta2_t phi_{t-1} + (1 - beta2_t) sigma_t^2``, ``phi_0 = 0``

(``R_t(S)``: the accumulator fed the signal alone; ``beta2_1 = 0``, so ``phi_1 = sigma_1^2``). ``phi`` is a scalar
per leaf, known on the host. The correction removes it from each factor *before* the reconstruction, with the rule
of :func:`~opake_core.optim.bias_correction.without_noise` (``X - phi`` where positive, else ``X``):
``V_hat = R' C'^T / mean(R')``, ``R' = without_noise(R, phi)``, ``C' = without_noise(C, phi)``, and
``V' = without_noise(V, phi)`` for the other leaves. Subtracting ``phi`` from the reconstructed ``V_hat`` instead
would be wrong: ``(R + phi)(C + phi)^T / mean(R + phi)`` is not ``R C^T / mean(R) + phi``, and the noise share of a
reconstructed entry depends on its row and column. ``R'`` and ``C'`` are unbiased for the signal's factors (before
the rule's fallback); ``V_hat`` is their ratio, so it is consistent rather than exactly unbiased, as the factored
estimate is for the signal itself. With ``sigma = 0`` the corrected optimizer is the plain one bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torchopt import chain
from torchopt.base import EmptyState, GradientTransformation

from opake_core import validate
from opake_core.errors import ConfigurationError
from opake_core.optim._foreach import add_decayed_weights
from opake_core.optim._guard import NoiseAwareTransformation, Optimizer
from opake_core.optim._lr import LearningRate, check_lr, scale_by_neg_lr
from opake_core.optim.bias_correction import NoiseVarianceState, noise_aware_chain, noise_ema, without_noise, zero_noise

__all__ = ["FactoredRmsState", "adafactor"]


class FactoredRmsState(NamedTuple):
    """State of :func:`scale_by_factored_rms`.

    Attributes:
        count: number of updates applied so far (0-d int64 tensor on the CPU).
        row: per leaf, the row EMA ``R`` (shape ``p.shape[:-1]``) for factored leaves, else empty.
        col: per leaf, the column EMA ``C`` (shape ``p.shape[:-2] + p.shape[-1:]``) for factored leaves, else
            empty.
        v: per leaf, the full EMA ``V`` (shape ``p.shape``) for leaves with < 2 dimensions, else empty.
    """

    count: torch.Tensor
    row: Any
    col: Any
    v: Any


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean().sqrt()


def scale_by_factored_rms(
    decay_rate: float, eps1: float, *, noise_bias_correction: bool = False
) -> GradientTransformation | NoiseAwareTransformation:
    """``G -> G / sqrt(V_hat)`` with Adafactor's (factored, for >= 2-D leaves) second-moment estimate; with
    ``noise_bias_correction`` a :class:`NoiseAwareTransformation` whose state is ``NoiseVarianceState(
    FactoredRmsState, phi)`` and whose factors lose the noise variance ``phi`` (the module docstring)."""

    def init_fn(params):
        def empty(p):
            return p.new_zeros((0,))

        def factored(p):
            return p.ndim >= 2

        return FactoredRmsState(
            count=torch.zeros((), dtype=torch.int64),
            row=optree.tree_map(lambda p: p.new_zeros(p.shape[:-1]) if factored(p) else empty(p), params),
            col=optree.tree_map(
                lambda p: p.new_zeros(p.shape[:-2] + p.shape[-1:]) if factored(p) else empty(p), params
            ),
            v=optree.tree_map(lambda p: empty(p) if factored(p) else torch.zeros_like(p), params),
        )

    def beta2_of(state: FactoredRmsState) -> float:
        return 1.0 - float(state.count + 1) ** decay_rate

    def step(updates, state, phis):
        """The update and the new state; ``phis``: per-leaf noise variance averages, or None (uncorrected)."""
        beta2 = beta2_of(state)

        def leaf(g, row, col, v, noise):
            correct = (lambda x: x) if noise is None else (lambda x: without_noise(x, noise))
            g2 = g.square().add(eps1)
            if g.ndim >= 2:
                row = row.mul(beta2).add(g2.mean(dim=-1), alpha=1 - beta2)
                col = col.mul(beta2).add(g2.mean(dim=-2), alpha=1 - beta2)
                r, c = correct(row), correct(col)
                v_hat = r.unsqueeze(-1) * c.unsqueeze(-2) / r.mean(dim=-1, keepdim=True).unsqueeze(-1)
            else:
                v = v.mul(beta2).add(g2, alpha=1 - beta2)
                v_hat = correct(v)
            return g.div(v_hat.sqrt()), row, col, v

        g, treedef = optree.tree_flatten(updates)
        noise = [None] * len(g) if phis is None else [float(f) for f in phis]
        parts = (optree.tree_leaves(x) for x in (state.row, state.col, state.v))
        out = [leaf(*args) for args in zip(g, *parts, noise, strict=True)]
        updates, row, col, v = (optree.tree_unflatten(treedef, list(x)) for x in zip(*out, strict=True))
        return updates, FactoredRmsState(count=state.count + 1, row=row, col=col, v=v)

    if not noise_bias_correction:

        def update_fn(updates, state, *, params=None, inplace=False):
            return step(updates, state, None)

        return GradientTransformation(init_fn, update_fn)

    def corrected_init(params):
        return NoiseVarianceState(inner=init_fn(params), phi=zero_noise(params))

    def corrected_fn(updates, state, *, params=None, noise_std, inplace=False):
        phi = noise_ema(state.phi, noise_std, beta2_of(state.inner))  # the accumulators' own beta2_t
        out, inner = step(updates, state.inner, optree.tree_leaves(phi))
        return out, NoiseVarianceState(inner=inner, phi=phi)

    return NoiseAwareTransformation(corrected_init, corrected_fn)


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """``U -> U / max(1, RMS(U) / threshold)`` per leaf (the paper's update clipping, threshold ``d``)."""

    def update_fn(updates, state, *, params=None, inplace=False):
        return optree.tree_map(lambda u: u.div(_rms(u).div(threshold).clamp(min=1.0)), updates), state

    return GradientTransformation(lambda params: EmptyState(), update_fn)


def scale_by_param_block_rms(min_scale: float) -> GradientTransformation:
    """``U -> max(min_scale, RMS(X)) * U`` per leaf, ``X`` the current parameter (relative step size)."""

    def update_fn(updates, state, *, params=None, inplace=False):
        return optree.tree_map(lambda u, p: u.mul(_rms(p).clamp(min=min_scale)), updates, params), state

    return GradientTransformation(lambda params: EmptyState(), update_fn)


def adafactor(
    lr: LearningRate = 1e-3,
    *,
    decay_rate: float = -0.8,
    eps: tuple[float, float] = (1e-30, 1e-3),
    clip_threshold: float = 1.0,
    weight_decay: float = 0.0,
    noise_bias_correction: bool = False,
    non_private: bool = False,
) -> Optimizer:
    """Adafactor with a factored second moment for >= 2-D leaves and parameter-scaled steps; ``update`` needs
    ``params``.

    Args:
        lr: relative step size ``rho_t`` (> 0) or a schedule ``step -> rho``; the step of a leaf is ``lr``
            times the leaf's RMS (at least ``eps[1]``).
        decay_rate: exponent ``c`` of ``beta2_t = 1 - t^c``, in [-1, 0) (the paper uses -0.8).
        eps: ``(eps1, eps2)``, both > 0: ``eps1`` is added to the squared gradient (gradient units squared),
            ``eps2`` is the smallest parameter scale (parameter units).
        clip_threshold: the update-clipping threshold ``d`` (> 0; ``math.inf`` disables clipping).
        weight_decay: decoupled decay coefficient (>= 0), multiplied by ``lr`` (not by the parameter scale).
        noise_bias_correction: remove the noise variance's average from the row and column factors (and from the
            unfactored moments) before the reconstruction (the module docstring).
        non_private: accept plain trees of tensors (an explicitly non-private run).

    Example: three updates (non-private here, to compare) match ``torch.optim.Adafactor``.

        >>> import torch
        >>> from opake_core import optim, testing
        >>> testing.matches_torch_optimizer(optim.adafactor(lr=0.01, non_private=True), torch.optim.Adafactor, lr=0.01)
        True
    """
    lr = check_lr(lr)
    c = validate.number("decay_rate", decay_rate)
    if not -1 <= c < 0:
        raise ConfigurationError(f"decay_rate must lie in [-1, 0), got {c!r} (beta2_t = 1 - t^c must rise to 1).")
    if not isinstance(eps, tuple | list) or len(eps) != 2:
        raise ConfigurationError(f"eps must be a pair (eps1, eps2), got {eps!r}.")
    eps1 = validate.positive("eps[0]", eps[0])
    eps2 = validate.positive("eps[1]", eps[1])
    threshold = validate.number("clip_threshold", clip_threshold)
    if not threshold > 0:
        raise ConfigurationError(f"clip_threshold must be positive, got {clip_threshold!r}.")
    weight_decay = validate.non_negative("weight_decay", weight_decay)
    parts = (
        scale_by_factored_rms(c, eps1, noise_bias_correction=bool(noise_bias_correction)),
        clip_by_block_rms(threshold),
        scale_by_param_block_rms(eps2),
        add_decayed_weights(weight_decay),
        scale_by_neg_lr(lr),
    )
    flags = {"non_private": non_private, "needs_params": True, "needs_whole_leaves": True}  # factored, per-leaf RMS
    if noise_bias_correction:
        return Optimizer("adafactor", noise_aware_chain(*parts), noise_aware=True, **flags)
    return Optimizer("adafactor", chain(*parts), **flags)
