"""The DPO loss of one preference pair with every per-pair option: reference-free losses (SimPO, CPO, ORPO, the
chosen completion's NLL), weighted combinations (MPO, and RPO as DPO + NLL), WPO weighting, LD-DPO length
desensitization and f-DPO divergences.

Each function here reads one pair only (its two completions' token log-probabilities, token counts and logits, and
the reference's log-probabilities of the same two completions), so its gradient can be clipped on its own: the
privacy unit stays the pair. The options of TRL that mix pairs are refused by :class:`~.config.DPOConfig` instead:
``aot`` / ``aot_unpaired`` sort log-ratios across the batch, and TRL's ``sft`` averages over the tokens of the whole
batch (``chosen_nll`` here is its per-pair form, the mean over the pair's own chosen tokens).

Notation for one pair (``w`` chosen, ``l`` rejected): ``L_w, L_l`` the policy's log-probabilities of the completions
(summed over completion tokens; with LD-DPO, the tokens past the shorter completion's length weigh ``ld_alpha``),
``R_w, R_l`` the reference's (the same sums), ``n_w, n_l`` the completion token counts, ``A_w, A_l`` the mean
per-token log-probabilities (``L / n`` without LD weighting), ``s`` the sigmoid, ``e`` label smoothing:

=================  ==========================================================================================
``chosen_nll``     ``-A_w`` (RPO, Pang et al. 2024, arXiv 2404.19733: combine with ``sigmoid`` via MPO weights)
``simpo``          ``-(1 - e) log s(z) - e log s(-z)``, ``z = beta (A_w - A_l) - simpo_gamma`` (Meng et al. 2024,
                   arXiv 2405.14734; TRL's CPOTrainer ``loss_type="simpo"``)
``cpo``            ``-(1 - e) log s(z) - e log s(-z) + cpo_alpha * (-A_w)``, ``z = beta (L_w - L_l)`` (Xu et al.
                   2024, arXiv 2401.08417; TRL's CPOTrainer)
``orpo``           ``-A_w - orpo_lambda * log s(o)``, ``o = (A_w - A_l) - (log(1 - e^A_w) - log(1 - e^A_l))``, the
                   log odds ratio (Hong et al. 2024, arXiv 2403.07691, eqs. 4-7; TRL's ORPOTrainer with
                   ``beta = orpo_lambda``)
the others         TRL's DPOTrainer formulas, :func:`opake_torch.transformers.trl.dpo.dpo_loss`
=================  ==========================================================================================

Options (TRL's DPOConfig names):

- ``loss_type`` with several names and ``loss_weights`` (MPO): ``sum_i loss_weights[i] * loss_i``.
- ``use_weighting`` (WPO, Zhou et al. 2024, arXiv 2406.11827, eq. 2): the loss times ``w_w * w_l``, ``w = exp(mean
  over completion tokens of (log p_t - log sum_v p_v^2))`` at each position, computed without gradient.
- ``ld_alpha`` (LD-DPO, Liu et al. 2024, arXiv 2409.06411): in ``L`` and ``R``, the completion tokens past
  ``min(n_w, n_l)`` weigh ``ld_alpha``; the pair's own two lengths decide.
- ``f_divergence_type`` (f-DPO, Wang et al. 2023, arXiv 2309.16240): the log-ratios ``c = L_w - R_w`` and
  ``r = L_l - R_l`` become ``f'``-scores before ``sigmoid``, ``sigmoid_norm``, ``hinge``, ``ipo``, ``exo_pair``,
  ``robust`` and ``discopop`` (TRL's set): ``forward_kl`` ``1 - e^-x``, ``js_divergence`` ``log 2 + log s(x)``,
  ``alpha_divergence`` ``(e^((a - 1) x) - 1) / (a - 1)`` (``a = f_alpha_divergence_coef``; ``x`` when ``a = 1``).

The NLL terms are each pair's mean over its chosen tokens, where TRL's CPO and ORPO trainers average the chosen tokens
of the whole batch: the per-pair mean is the library's loss reduction (no normalization across examples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from opake_core.errors import ConfigurationError

__all__ = [
    "F_DIVERGENCES",
    "F_DIVERGENCE_LOSSES",
    "REFERENCE_FREE_LOSSES",
    "PairLogps",
    "PairOptions",
    "pair_logps",
    "pair_loss",
    "summed_logps",
    "token_logps",
    "wpo_weight",
]

REFERENCE_FREE_LOSSES = ("chosen_nll", "simpo", "cpo", "orpo")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The losses whose log-ratios TRL maps through f' (its set without "sft", which is refused here).
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop")


@dataclass(frozen=True)
class PairOptions:
    """The loss settings of one run, validated (:meth:`from_args` reads a :class:`~.config.DPOConfig`)."""

    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    orpo_lambda: float = 1.0
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    use_weighting: bool = False

    def __post_init__(self) -> None:
        if len(self.loss_weights) != len(self.loss_types):
            raise ConfigurationError(
                f"loss_weights={list(self.loss_weights)} has {len(self.loss_weights)} entries for "
                f"{len(self.loss_types)} loss types {list(self.loss_types)}; give one weight per loss_type."
            )
        if not all(math.isfinite(w) and w >= 0 for w in self.loss_weights):
            raise ConfigurationError(f"loss_weights must be finite and >= 0, got {list(self.loss_weights)}.")
        if self.ld_alpha is not None and not 0 <= self.ld_alpha <= 1:
            raise ConfigurationError(
                f"ld_alpha={self.ld_alpha!r} must lie in [0, 1] (1: plain DPO; 0: only the tokens both completions "
                "share in length count), or be None."
            )
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ConfigurationError(
                f"f_divergence_type must be one of {list(F_DIVERGENCES)}, got {self.f_divergence_type!r}."
            )
        if self.f_divergence_type != "reverse_kl":
            others = [t for t in self.loss_types if t not in F_DIVERGENCE_LOSSES]
            if others:
                raise ConfigurationError(
                    f"f_divergence_type={self.f_divergence_type!r} reshapes the log-ratios of "
                    f"{list(F_DIVERGENCE_LOSSES)} only (as in TRL), not of {others}; use those losses, or "
                    "f_divergence_type='reverse_kl'."
                )
            if self.f_divergence_type == "alpha_divergence" and not math.isfinite(self.f_alpha_divergence_coef):
                raise ConfigurationError(
                    f"f_alpha_divergence_coef must be finite, got {self.f_alpha_divergence_coef!r}."
                )

    @classmethod
    def from_args(cls, args: Any) -> PairOptions:
        """The options of a :class:`~.config.DPOConfig` (its ``loss_type``: one name or a tuple of names)."""
        types = (args.loss_type,) if isinstance(args.loss_type, str) else tuple(args.loss_type)
        weights = args.loss_weights
        return cls(
            loss_types=types,
            loss_weights=(1.0,) * len(types) if weights is None else tuple(float(w) for w in weights),
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            discopop_tau=args.discopop_tau,
            simpo_gamma=args.simpo_gamma,
            cpo_alpha=args.cpo_alpha,
            orpo_lambda=args.orpo_lambda,
            ld_alpha=args.ld_alpha,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            use_weighting=args.use_weighting,
        )

    @property
    def needs_reference(self) -> bool:
        """Whether any loss reads the reference's log-probabilities."""
        return any(t not in REFERENCE_FREE_LOSSES for t in self.loss_types)


@dataclass(frozen=True)
class PairLogps:
    """One pair's inputs to :func:`pair_loss` (0-d tensors; see the module docstring's notation).

    ``chosen``/``rejected``: ``L_w, L_l``; ``ref_chosen``/``ref_rejected``: ``R_w, R_l`` (None when no loss reads
    them); ``chosen_tokens``/``rejected_tokens``: ``n_w, n_l``; ``chosen_mean``/``rejected_mean``: ``A_w, A_l``;
    ``weight``: WPO's ``w_w * w_l`` (detached), None without ``use_weighting``.
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_mean: torch.Tensor
    rejected_mean: torch.Tensor
    weight: torch.Tensor | None = None


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities ``[T - 1]`` of one sequence (``logits [T, V]``), in float32."""
    return torch.gather(F.log_softmax(logits[:-1].float(), dim=-1), -1, input_ids[1:, None]).squeeze(-1)


def summed_logps(
    logps: dict[str, torch.Tensor], completion_mask: dict[str, torch.Tensor], ld_alpha: float | None
) -> dict[str, torch.Tensor]:
    """Per side, the sum of ``logps[side]`` (``[T_side - 1]``, from :func:`token_logps`) over its completion tokens;
    with ``ld_alpha``, the tokens past ``min(n_w, n_l)`` (the pair's shorter completion) weigh ``ld_alpha``."""
    masks = {side: mask[1:].to(logps[side].dtype) for side, mask in completion_mask.items()}
    if ld_alpha is None:
        return {side: (logps[side] * masks[side]).sum(-1) for side in logps}
    shared = torch.minimum(*(m.sum(-1) for m in masks.values()))
    out = {}
    for side, mask in masks.items():
        position = mask.cumsum(-1)  # 1, 2, ... on the completion tokens
        weight = torch.where(position <= shared, 1.0, ld_alpha) * mask
        out[side] = (logps[side] * weight).sum(-1)
    return out


def wpo_weight(logits: torch.Tensor, logps: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """WPO's weight of one completion, without gradient: ``exp(mean over completion tokens of (log p_t - log sum_v
    p_v^2))`` (``logits [T, V]``, ``logps [T - 1]`` from :func:`token_logps`)."""
    with torch.no_grad():
        log_probs = F.log_softmax(logits[:-1].float(), dim=-1)
        mask = completion_mask[1:].to(logps.dtype)
        aligned = (logps.detach() - torch.logsumexp(2 * log_probs, dim=-1)) * mask
        return torch.exp(aligned.sum(-1) / mask.sum(-1).clamp(min=1))


def pair_logps(
    options: PairOptions,
    logits: dict[str, torch.Tensor],
    input_ids: dict[str, torch.Tensor],
    completion_mask: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor] | None,
) -> PairLogps:
    """The :class:`PairLogps` of one pair from the policy's ``logits [T_side, V]`` per side; ``reference``: the
    reference's summed log-probabilities per side (LD-weighted like the policy's), or None."""
    logps = {side: token_logps(logits[side], input_ids[side]) for side in logits}
    summed = summed_logps(logps, completion_mask, options.ld_alpha)
    plain = summed if options.ld_alpha is None else summed_logps(logps, completion_mask, None)
    # completion tokens as TRL counts them for ipo / sigmoid_norm (the whole mask), and the scored ones (from the
    # second position on) for the means; they differ only if a sequence starts inside its completion
    tokens = {side: mask.sum(-1).to(logps[side].dtype) for side, mask in completion_mask.items()}
    scored = {side: mask[1:].sum(-1).to(logps[side].dtype) for side, mask in completion_mask.items()}
    weight = None
    if options.use_weighting:
        weight = wpo_weight(logits["chosen"], logps["chosen"], completion_mask["chosen"])
        weight = weight * wpo_weight(logits["rejected"], logps["rejected"], completion_mask["rejected"])
    return PairLogps(
        chosen=summed["chosen"],
        rejected=summed["rejected"],
        ref_chosen=None if reference is None else reference["chosen"],
        ref_rejected=None if reference is None else reference["rejected"],
        chosen_tokens=tokens["chosen"],
        rejected_tokens=tokens["rejected"],
        chosen_mean=plain["chosen"] / scored["chosen"].clamp(min=1),
        rejected_mean=plain["rejected"] / scored["rejected"].clamp(min=1),
        weight=weight,
    )


def _f_score(log_ratio: torch.Tensor, options: PairOptions) -> torch.Tensor:
    """``f'(exp(x))`` of a log-ratio ``x`` for the run's f-divergence (TRL's formulas)."""
    kind = options.f_divergence_type
    if kind == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if kind == "alpha_divergence" and abs(options.f_alpha_divergence_coef - 1.0) >= 1e-6:
        a = options.f_alpha_divergence_coef - 1.0
        # TRL clamps the exponent at 80 in float32 so that exp stays finite
        return (torch.exp(torch.clamp(a * log_ratio, max=80.0)) - 1.0) / a
    return log_ratio


def _smoothed(z: torch.Tensor, smoothing: float) -> torch.Tensor:
    return -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for ``x < 0``, stable on both sides of ``-log 2`` (as TRL's ORPO)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _one(loss_type: str, pair: PairLogps, options: PairOptions) -> torch.Tensor:
    beta, smoothing = options.beta, options.label_smoothing
    if loss_type == "chosen_nll":
        return -pair.chosen_mean
    if loss_type == "simpo":
        return _smoothed(beta * (pair.chosen_mean - pair.rejected_mean) - options.simpo_gamma, smoothing)
    if loss_type == "cpo":
        return _smoothed(beta * (pair.chosen - pair.rejected), smoothing) - options.cpo_alpha * pair.chosen_mean
    if loss_type == "orpo":
        log_odds = (pair.chosen_mean - pair.rejected_mean) - (
            _log1mexp(pair.chosen_mean) - _log1mexp(pair.rejected_mean)
        )
        return -pair.chosen_mean - options.orpo_lambda * F.logsigmoid(log_odds)
    from opake_torch.transformers.trl.dpo import dpo_loss  # dpo.py builds on this module

    chosen, rejected = pair.chosen - pair.ref_chosen, pair.rejected - pair.ref_rejected
    if loss_type in F_DIVERGENCE_LOSSES:
        # TRL's losses read the log-ratios only through c - r (or their length-normalized forms): pass the scores
        # as log-probabilities against a zero reference.
        chosen, rejected = _f_score(chosen, options), _f_score(rejected, options)
    zero = torch.zeros_like(chosen)
    return dpo_loss(
        chosen,
        rejected,
        zero,
        zero,
        beta=beta,
        loss_type=loss_type,
        chosen_tokens=pair.chosen_tokens,
        rejected_tokens=pair.rejected_tokens,
        label_smoothing=smoothing,
        discopop_tau=options.discopop_tau,
    )


def pair_loss(pair: PairLogps, options: PairOptions) -> torch.Tensor:
    """The pair's loss: ``sum_i loss_weights[i] * loss_i`` over ``options.loss_types``, times WPO's weight with
    ``use_weighting``. A 0-d tensor; reads this pair only."""
    total = sum(w * _one(t, pair, options) for t, w in zip(options.loss_types, options.loss_weights, strict=True))
    return total if pair.weight is None else total * pair.weight
