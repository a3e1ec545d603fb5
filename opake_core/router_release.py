"""Private load balancing of mixture-of-experts routers: the per-example load statistic, its Gaussian release, the
filtered load estimate and the surrogate load-balancing loss.

The usual auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2021) multiplies the fraction of tokens
each expert received **in the whole batch** by the router's probabilities, so one example's loss depends on every
other example and its gradient can no longer be clipped alone. This module splits it in two:

1. every step releases the batch's router load through the Gaussian mechanism (a second clipped, noised sum next to
   the gradient), and a filter turns the releases into a load estimate ``f~`` (public: it is post-processing);
2. each example's loss gets a surrogate term that uses ``f~`` of the *previous* steps, so the example's gradient
   depends on that example only and is clipped with the rest of its gradient.

Notation (shapes for one example):

=========================  ===================================================================================
``L, E, k``                MoE layers, experts per layer, experts per token (top-k)
``m_t``                    the token mask (1: a real token), ``T_x = sum_t m_t``
``T_max, T_mean``          public bounds: the longest example counted in full, and the mean length (``T_mean``
                           defaults to ``T_max``); ``w_x = min(T_x, T_max) / T_mean`` (a row longer than
                           ``T_max`` is clipped to the bound)
``h^l_e(x)``               ``(1/T_x) sum_t m_t 1[e in top_k(logits^l_t)]``: the share of the example's tokens
                           routed to expert ``e`` in layer ``l``; ``sum_e h^l_e = k``
``s(x)``                   ``w_x (h(x) - k/E)`` in ``R^{L x E}``: the released per-example statistic
``Delta_L``                ``(T_max / T_mean) sqrt(k L (1 - k/E))``: the L2 bound of ``s(x)``
``B, z, rho``              expected batch size, the gradient's noise multiplier, the release's budget ratio
``sigma_h``                ``(z / sqrt(rho)) Delta_L / B``: the noise std of the released mean
``beta``                   the filter's EMA coefficient (``filter_beta``)
=========================  ===================================================================================

Sensitivity (add or remove one example). In one layer every real token picks ``k`` distinct experts, so
``h^l in [0, 1]^E`` with ``sum_e h^l_e = k`` and ``||h^l - k/E||^2 = ||h^l||^2 - k^2/E <= sum_e h^l_e - k^2/E =
k (1 - k/E)`` (``h_e^2 <= h_e`` as ``0 <= h_e <= 1``; equality when the same ``k`` experts take every token). Over
``L`` layers and with ``w_x <= T_max / T_mean``: ``||s(x)||_2 <= Delta_L``. The batch's sum divided by the public
``B`` therefore moves by at most ``Delta_L / B`` in L2 norm.

Accounting. The gradient (noise ``z C / B`` for sensitivity ``C / B``) and the router statistic (noise
``(z/sqrt(rho)) Delta_L / B``) are computed on the same sampled batch; scaled by their sensitivities they are one
Gaussian release of the concatenated vector ``(g / C, s / Delta_L)`` with per-coordinate noise std ``z`` on the first
block and ``z / sqrt(rho)`` on the second, whose privacy loss is that of a single Gaussian with multiplier
``z_eff = z / sqrt(1 + rho)`` (``1/z_eff^2 = 1/z^2 + rho/z^2``). Account it with
:func:`opake_core.accounting.moe_aux`.

Estimator (public post-processing of the releases): pool the released ``[L, E]`` mean over layers, project it on the
sum-zero subspace, filter with a bias-corrected EMA, ``d~_t = (sum_i beta^{t-i} (1-beta) y_i) / (1 - beta^t)``, and
estimate the load ``f~ = clamp(k/E + d~, 0, 1)``. The pooled, projected noise has per-coordinate std
``s_h = sigma_h / sqrt(L) sqrt((E-1)/E)``; the filter's noise variance follows ``v_t = beta^2 v_{t-1} + (1-beta)^2
s_h^2`` (before the bias correction, which divides the std by ``1 - beta^t``).

Surrogate: ``S(x; f~) = E w_x sum_e (f~_e - k/E) P_e(x)`` with ``P_e(x)`` the router's softmax probability of
expert ``e`` averaged over the example's real tokens and over layers. :func:`surrogate_loss` returns ``S - S``
with the second term detached: the loss **value** is unchanged, its gradient is ``grad S``, which pushes probability
away from the experts the estimate finds overloaded.

Reference: the private router load-balancing mechanism of the Opake library (JetBrains Research), documented as
"MoE load balancing"; the auxiliary loss it replaces is Fedus, Zoph, Shazeer, "Switch Transformers", JMLR 2022
(arXiv 2101.03961), eq. (4).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import optree
import torch

from opake_core import random, validate
from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.tree import NAMESPACE, Clipped, Noised

__all__ = [
    "STREAM",
    "RouterGeometry",
    "RouterState",
    "exact_router_release",
    "load_probabilities",
    "load_statistic",
    "router_release",
    "sum_statistics",
    "surrogate_loss",
]

STREAM = "opake.moe.router"
"""The stream tag of the router release's noise: step ``t`` draws from ``fold_in(key, STREAM, t)``."""

ReleaseFn = Callable[[Clipped, "RouterState"], tuple[Noised, "RouterState"]]


@dataclass(frozen=True)
class RouterGeometry:
    """The public shape of a router release.

    Attributes:
        top_k: experts per token ``k`` (``1 <= k < E``).
        num_experts: experts per layer ``E``.
        num_layers: MoE layers ``L``.
        max_tokens: ``T_max``, tokens counted in full; a longer example's weight is clipped to ``T_max / T_mean``.
        mean_tokens: ``T_mean``, the public normalizer of the token weight (default ``max_tokens``).
    """

    top_k: int
    num_experts: int
    num_layers: int
    max_tokens: int
    mean_tokens: float | None = None

    def __post_init__(self) -> None:
        experts = validate.integer("num_experts", self.num_experts, minimum=2)
        top_k = validate.integer("top_k", self.top_k, minimum=1)
        if top_k >= experts:
            raise ConfigurationError(
                f"top_k must be smaller than num_experts={experts}, got {top_k}: with every expert chosen there is "
                "nothing to balance; drop the router release."
            )
        object.__setattr__(self, "num_experts", experts)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "num_layers", validate.integer("num_layers", self.num_layers, minimum=1))
        object.__setattr__(self, "max_tokens", validate.integer("max_tokens", self.max_tokens, minimum=1))
        mean = self.max_tokens if self.mean_tokens is None else validate.positive("mean_tokens", self.mean_tokens)
        object.__setattr__(self, "mean_tokens", float(mean))

    @property
    def uniform(self) -> float:
        """``k / E``: every expert's share of a token under perfect balance."""
        return self.top_k / self.num_experts

    @property
    def sensitivity(self) -> float:
        """``Delta_L = (T_max / T_mean) sqrt(k L (1 - k/E))``: the L2 bound of one example's statistic."""
        k, layers = self.top_k, self.num_layers
        return self.max_tokens / self.mean_tokens * math.sqrt(k * layers * (1.0 - self.uniform))


def _mask_and_weight(geometry: RouterGeometry, logits: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    if logits.dim() != 3 or logits.shape[-1] != geometry.num_experts or logits.shape[0] != geometry.num_layers:
        raise InputTypeError(
            f"router logits must be [L={geometry.num_layers}, T, E={geometry.num_experts}] for one example, got "
            f"shape {tuple(logits.shape)}; stack the layers' [T, E] logits of one example."
        )
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if mask is None:
        mask = torch.ones(logits.shape[1], dtype=dtype, device=logits.device)
    mask = mask.to(dtype)
    tokens = mask.sum()
    weight = torch.clamp(tokens, max=geometry.max_tokens) / geometry.mean_tokens
    return mask, tokens, weight, dtype


def load_statistic(geometry: RouterGeometry, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The per-example release ``s(x) = w_x (h(x) - k/E)``, ``[L, E]``, with ``||s(x)||_2 <= Delta_L``.

    Args:
        geometry: the release's :class:`RouterGeometry`.
        logits: ``[L, T, E]`` router logits of one example (the expert choice is the top-k of each row; the
            softmax does not change it).
        mask: ``[T]`` token mask (1 for a real token); None counts every token.

    Returns:
        float32 ``[L, E]`` (float64 for float64 logits), detached; all zeros for an example without real tokens.
        Pure tensor code, so it runs under ``torch.func.vmap``.
    """
    mask, tokens, weight, dtype = _mask_and_weight(geometry, logits.detach(), mask)
    chosen = torch.topk(logits.detach(), geometry.top_k, dim=-1).indices  # [L, T, k]
    experts = torch.arange(geometry.num_experts, device=logits.device)
    hits = (chosen[..., None] == experts).any(dim=-2).to(dtype)  # [L, T, E]: k ones per token
    share = (hits * mask[None, :, None]).sum(dim=1) / tokens.clamp(min=1.0)  # h^l_e
    return weight * (share - geometry.uniform)


def load_probabilities(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``P_e(x)``: the router's softmax probability of each expert, averaged over the real tokens and the layers.

    Args:
        logits: ``[L, T, E]`` router logits of one example; mask: ``[T]`` (None: every token).

    Returns:
        ``[E]`` in float32 (float64 for float64 logits), differentiable in ``logits``; zeros without real tokens.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(dtype), dim=-1)
    if mask is None:
        mask = torch.ones(logits.shape[1], dtype=dtype, device=logits.device)
    mask = mask.to(dtype)
    per_layer = (probs * mask[None, :, None]).sum(dim=1) / mask.sum().clamp(min=1.0)
    return per_layer.mean(dim=0)


def surrogate_loss(
    geometry: RouterGeometry, logits: torch.Tensor, load: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The value-neutral surrogate ``S - stop_gradient(S)``, ``S(x; f~) = E w_x sum_e (f~_e - k/E) P_e(x)``.

    Its value is 0 (the loss it is added to keeps its value); its gradient is ``grad S``. Scale it by the
    auxiliary-loss coefficient and add it to the example's loss.

    Args:
        geometry: the release's :class:`RouterGeometry`.
        logits: ``[L, T, E]`` router logits of one example; mask: ``[T]`` (None: every token).
        load: ``[E]`` the load estimate ``f~`` (:attr:`RouterState.load`), a constant of the step.

    Returns:
        A scalar in float32 (float64 for float64 logits).
    """
    mask, _, weight, dtype = _mask_and_weight(geometry, logits, mask)
    centred = load.detach().to(dtype) - geometry.uniform
    value = geometry.num_experts * weight * (centred * load_probabilities(logits, mask)).sum()
    return value - value.detach()


def sum_statistics(geometry: RouterGeometry, statistics: torch.Tensor, *, expected_batch_size: float) -> Clipped:
    """The batch's statistics ``[B, L, E]`` (rows of :func:`load_statistic`) summed and divided by the public
    ``expected_batch_size``, as a :class:`~opake_core.tree.Clipped` ``[L, E]`` tensor with sensitivity
    ``Delta_L / B``. The sum is in float64."""
    if statistics.dim() != 3 or statistics.shape[1:] != (geometry.num_layers, geometry.num_experts):
        raise InputTypeError(
            f"statistics must be [B, L={geometry.num_layers}, E={geometry.num_experts}], got "
            f"{tuple(statistics.shape)}; stack load_statistic(...) of every example of the batch."
        )
    b = validate.positive("expected_batch_size", expected_batch_size)
    return Clipped(statistics.to(torch.float64).sum(dim=0) / b, geometry.sensitivity / b)


@optree.dataclasses.dataclass(frozen=True, namespace=NAMESPACE)
class RouterState:
    """State of the router release and its filter.

    Attributes:
        filtered: ``[E]`` float64, the EMA ``sum_i beta^{t-i} (1 - beta) y_i`` of the pooled, projected releases
            before the bias correction.
        key: the noise key; step ``t`` draws from ``fold_in(key, STREAM, t)`` on the statistic's device.
        step: releases made so far (``t``).
        noise_var: ``v_t``, the variance of every coordinate of ``filtered``'s noise (before the bias correction).
        top_k, beta: ``k`` and ``filter_beta``, to read the estimate from the state alone.
    """

    filtered: torch.Tensor
    key: random.Key = optree.dataclasses.field(pytree_node=False)
    step: int = optree.dataclasses.field(pytree_node=False, default=0)
    noise_var: float = optree.dataclasses.field(pytree_node=False, default=0.0)
    top_k: int = optree.dataclasses.field(pytree_node=False, default=1)
    beta: float = optree.dataclasses.field(pytree_node=False, default=0.99)

    @property
    def _weight(self) -> float:
        return 1.0 - self.beta**self.step  # the EMA's total weight: its bias correction

    @property
    def deviation(self) -> torch.Tensor:
        """``d~``: the bias-corrected filtered deviation from ``k/E`` (``[E]``, sums to 0); zeros before a release."""
        return self.filtered / self._weight if self.step else torch.zeros_like(self.filtered)

    @property
    def load(self) -> torch.Tensor:
        """``f~ = clamp(k/E + d~, 0, 1)``, ``[E]`` float64: the load estimate the next step's surrogate uses."""
        return torch.clamp(self.top_k / self.filtered.numel() + self.deviation, 0.0, 1.0)

    @property
    def filtered_noise_std(self) -> float:
        """Per-coordinate noise std of ``d~`` (``sqrt(v_t) / (1 - beta^t)``); 0 before a release."""
        return math.sqrt(self.noise_var) / self._weight if self.step else 0.0

    @property
    def imbalance(self) -> float:
        """``max_e |f~_e - k/E| / (k/E)``: the estimated worst relative overload (0: balanced)."""
        uniform = self.top_k / self.filtered.numel()
        return float((self.load - uniform).abs().max()) / uniform


def router_release(
    geometry: RouterGeometry,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    ratio: float = 0.02,
    key: random.Key,
    filter_beta: float = 0.99,
) -> tuple[ReleaseFn, RouterState]:
    """The router release as a ``(release_fn, state)`` pair.

    ``release_fn(clipped, state) -> (noised, new_state)`` takes the batch's mean statistic from
    :func:`sum_statistics` (a ``Clipped`` ``[L, E]`` tensor with sensitivity ``Delta_L / B``), adds ``N(0,
    sigma_h^2)`` to every coordinate, ``sigma_h = (z / sqrt(rho)) * sensitivity``, and updates the filter (pool over
    layers, project on the sum-zero subspace, EMA). ``noised`` is the released ``[L, E]`` mean as a
    :class:`~opake_core.tree.Noised` tensor; ``new_state.load`` is the estimate for the next step.

    Args:
        geometry: the release's :class:`RouterGeometry`.
        noise_multiplier: ``z``, the gradient's noise multiplier (``> 0``; the release is private only with a
            private gradient).
        expected_batch_size: ``B``, the public expected batch the statistics' sum is divided by.
        ratio: ``rho > 0``: the release gets noise multiplier ``z / sqrt(rho)``; together with the gradient the
            step is one Gaussian with ``z / sqrt(1 + rho)`` (:func:`opake_core.accounting.moe_aux`).
        key: the release's own noise key (not the gradient's).
        filter_beta: ``beta`` in ``[0, 1)``.

    Raises:
        InputTypeError: ``clipped`` is not a ``Clipped`` ``[L, E]`` tensor, or its sensitivity is not
            ``Delta_L / B``.
    """
    if not isinstance(geometry, RouterGeometry):
        raise InputTypeError(f"geometry must be a RouterGeometry, got {type(geometry).__name__}.")
    z = validate.noise_multiplier("noise_multiplier", noise_multiplier)
    if z == 0.0:
        raise ConfigurationError(
            "router_release needs a private gradient (noise_multiplier > 0), got 0.0; a non-private run balances "
            "its routers with the model's own auxiliary loss."
        )
    rho = validate.positive("ratio", ratio)
    return _release(geometry, z / math.sqrt(rho), expected_batch_size, key, filter_beta)


def exact_router_release(
    geometry: RouterGeometry, *, expected_batch_size: float, key: random.Key, filter_beta: float = 0.99
) -> tuple[ReleaseFn, RouterState]:
    """The router release of a **non-private** run (noise multiplier 0): :func:`router_release` without noise, the
    same filter on the exact batch statistic. It releases the statistic as it is: use it only where the gradient is
    released without noise too. ``key`` is kept in the state (nothing is drawn)."""
    if not isinstance(geometry, RouterGeometry):
        raise InputTypeError(f"geometry must be a RouterGeometry, got {type(geometry).__name__}.")
    return _release(geometry, 0.0, expected_batch_size, key, filter_beta)


def _release(
    geometry: RouterGeometry, multiplier: float, expected_batch_size: float, key: random.Key, filter_beta: float
) -> tuple[ReleaseFn, RouterState]:
    """The ``(release_fn, state)`` pair with noise multiplier ``multiplier`` (0: no noise is drawn)."""
    expected = geometry.sensitivity / validate.positive("expected_batch_size", expected_batch_size)
    beta = validate.real("filter_beta", filter_beta)
    if not 0.0 <= beta < 1.0:
        raise ConfigurationError(f"filter_beta must be in [0, 1), got {beta!r}; 0.99 is the default.")
    shape = (geometry.num_layers, geometry.num_experts)
    e, layers = geometry.num_experts, geometry.num_layers

    def release_fn(clipped: Clipped, state: RouterState) -> tuple[Noised, RouterState]:
        if not isinstance(clipped, Clipped) or isinstance(clipped, Noised):
            raise InputTypeError(
                f"release_fn expects the Clipped mean from sum_statistics(...), got {type(clipped).__name__}."
            )
        value = clipped.value
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            raise InputTypeError(f"the released statistic must be a {shape} tensor, got {value!r:.80}.")
        sensitivity = clipped.sensitivity
        if not isinstance(sensitivity, float | int) or not math.isclose(sensitivity, expected, rel_tol=1e-12):
            raise InputTypeError(
                f"the statistic's sensitivity must be Delta_L / B = {expected!r}, got {sensitivity!r}; build it "
                f"with sum_statistics(geometry, ..., expected_batch_size={expected_batch_size!r})."
            )
        with torch.profiler.record_function("opake::router_release"):
            sigma = multiplier * sensitivity
            noised = value.to(torch.float64)
            if sigma > 0.0:
                step_key = random.fold_in(state.key, STREAM, state.step)
                noised = noised + sigma * random.normal(step_key, shape, dtype=torch.float64, device=value.device)
            pooled = noised.mean(dim=0)
            projected = pooled - pooled.mean()
            filtered = beta * state.filtered.to(projected.device) + (1.0 - beta) * projected
            pooled_var = sigma**2 / layers * (e - 1) / e
            new_state = RouterState(
                filtered,
                state.key,
                state.step + 1,
                beta**2 * state.noise_var + (1.0 - beta) ** 2 * pooled_var,
                geometry.top_k,
                beta,
            )
        return Noised(noised, clipped.sensitivity, sigma), new_state

    state = RouterState(torch.zeros(e, dtype=torch.float64), key, 0, 0.0, geometry.top_k, beta)
    return release_fn, state
