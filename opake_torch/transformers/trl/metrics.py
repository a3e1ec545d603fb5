"""TRL's log metrics (``mean_token_accuracy``, ``num_tokens``, ``rewards/*``, ``logps/*`` ...), computed per example.

Each trainer's ``compute_per_example_loss_and_metrics(params, example)`` returns its loss together with a dict of
per-example values (:func:`sft_example_metrics`, :func:`dpo_example_metrics`): scalars computed from that example
alone, from the logits and log-probabilities its loss already needs, detached, and safe under ``vmap``. The step
stacks them ``[B]``; :class:`TRLMetrics` sums them on the device between two log rows (no host sync per step) and
reads them out under TRL's names:

- a per-example mean (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
  ``logps/chosen``, ``logps/rejected``): the sum over the examples since the last row, divided by their number;
- a per-token mean (``mean_token_accuracy``, ``entropy``, ``logits/chosen``, ``logits/rejected``): summed numerators
  over summed token counts, so a long example weighs by its tokens, as TRL's batch-level ratios do;
- ``num_tokens``: the attention-mask tokens of every training example so far (cumulative, as in TRL).

TRL averages per-batch values over the steps of a log row; here every example (or token) of the row weighs the same,
which differs when Poisson batches differ in size. **These values are exact statistics of the private data and are
outside the privacy guarantee**, like the logged loss: keep them private, or do not log them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from opake_core.errors import InputTypeError

__all__ = [
    "DPO_METRICS",
    "SFT_METRICS",
    "TRLMetrics",
    "dpo_example_metrics",
    "sft_example_metrics",
    "token_metrics",
    "trl_log_metrics",
]

SFT_METRICS = ("num_tokens", "mean_token_accuracy", "entropy")
DPO_METRICS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    "logits/chosen", "logits/rejected", "num_tokens", "mean_token_accuracy", "entropy",
)  # fmt: skip

# per-example values averaged over examples, under their TRL names
_PER_EXAMPLE = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")  # fmt: skip
# TRL name -> (numerator, token count) of a per-token mean
_PER_TOKEN = {
    "mean_token_accuracy": ("correct_tokens", "accuracy_tokens"),
    "entropy": ("entropy_sum", "entropy_tokens"),
    "logits/chosen": ("logits_sum/chosen", "logits_tokens/chosen"),
    "logits/rejected": ("logits_sum/rejected", "logits_tokens/rejected"),
}


def token_metrics(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the target positions of one sequence: top-1 hits, entropy, mean logit, and their count.

    ``logits [T', V]`` predict ``targets [T']``; ``mask [T']`` (0/1) keeps the target positions. Returns float32
    scalars ``correct``, ``entropy``, ``logits`` (the sum of each position's mean logit) and ``tokens``.
    """
    logits = logits.detach().float()
    mask = mask.to(logits.dtype)
    logps = F.log_softmax(logits, dim=-1)
    entropy = -(logps.exp() * logps).sum(-1)
    correct = (logits.argmax(-1) == targets).to(logits.dtype)
    return {
        "correct": (correct * mask).sum(),
        "entropy": (entropy * mask).sum(),
        "logits": (logits.mean(-1) * mask).sum(),
        "tokens": mask.sum(),
    }


def sft_example_metrics(
    logits: torch.Tensor | None, labels: torch.Tensor, attention_mask: torch.Tensor, *, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """One SFT example's values: ``num_tokens`` (its attention-mask tokens) and, with ``logits [T, V]``, the top-1
    hits and entropy over its target tokens (position ``t`` predicts ``labels[t + 1]``), as TRL's SFTTrainer counts
    them. ``logits=None`` (a loss that never builds them, ``chunked_nll``) gives ``num_tokens`` only."""
    out = {"num_tokens": attention_mask.detach().float().sum()}
    if logits is None:
        return out
    targets = labels[1:]
    mask = targets != ignore_index
    safe = torch.where(mask, targets, torch.zeros_like(targets))
    stats = token_metrics(logits[:-1], safe, mask)
    out.update(
        correct_tokens=stats["correct"],
        accuracy_tokens=stats["tokens"],
        entropy_sum=stats["entropy"],
        entropy_tokens=stats["tokens"],
    )
    return out


def dpo_example_metrics(
    *,
    beta: float,
    policy: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    logits: Mapping[str, torch.Tensor],
    input_ids: Mapping[str, torch.Tensor],
    completion_mask: Mapping[str, torch.Tensor],
    attention_mask: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """One preference pair's values, as TRL's DPOTrainer defines them (``side`` is ``chosen`` / ``rejected``).

    ``policy[side]`` / ``reference[side]``: summed completion log-probabilities; ``logits[side] [T, V]``;
    ``input_ids``, ``completion_mask``, ``attention_mask`` ``[T]`` per side. The rewards are
    ``beta * (log pi - log ref)``; accuracy is ``rewards/chosen > rewards/rejected``; ``mean_token_accuracy`` is over
    the chosen completion, ``entropy`` over both completions, ``num_tokens`` the attention-mask tokens of both
    sequences.
    """
    rewards = {side: beta * (policy[side] - reference[side]).detach().float() for side in ("chosen", "rejected")}
    out = {
        "rewards/chosen": rewards["chosen"],
        "rewards/rejected": rewards["rejected"],
        "rewards/accuracies": (rewards["chosen"] > rewards["rejected"]).float(),
        "rewards/margins": rewards["chosen"] - rewards["rejected"],
        "logps/chosen": policy["chosen"].detach().float(),
        "logps/rejected": policy["rejected"].detach().float(),
        "num_tokens": sum(attention_mask[side].detach().float().sum() for side in ("chosen", "rejected")),
    }
    entropy, entropy_tokens = 0.0, 0.0
    for side in ("chosen", "rejected"):
        stats = token_metrics(logits[side][:-1], input_ids[side][1:], completion_mask[side][1:])
        out[f"logits_sum/{side}"], out[f"logits_tokens/{side}"] = stats["logits"], stats["tokens"]
        entropy, entropy_tokens = entropy + stats["entropy"], entropy_tokens + stats["tokens"]
        if side == "chosen":
            out["correct_tokens"], out["accuracy_tokens"] = stats["correct"], stats["tokens"]
    out["entropy_sum"], out["entropy_tokens"] = entropy, entropy_tokens
    return out


def trl_log_metrics(sums: Mapping[str, float], count: float, num_tokens: float) -> dict[str, float]:
    """TRL's log names from the per-example values summed over ``count`` examples (``num_tokens``: the cumulative
    token count). A metric whose inputs are absent (``mean_token_accuracy`` under ``chunked_nll``) is left out; a
    row without examples or tokens reports 0.0, as TRL does."""
    logs: dict[str, float] = {}
    for name in _PER_EXAMPLE:
        if name in sums:
            logs[name] = float(sums[name]) / count if count else 0.0
    for name, (numerator, tokens) in _PER_TOKEN.items():
        if numerator in sums and tokens in sums:
            logs[name] = float(sums[numerator]) / float(sums[tokens]) if float(sums[tokens]) > 0 else 0.0
    if "num_tokens" in sums:
        logs["num_tokens"] = float(num_tokens)
    return logs


class TRLMetrics:
    """Running sums of the per-example values between two log rows, read out under TRL's names.

    ``add(values)`` takes the step's stacked per-example values (``{name: [B]}``) and adds them on their device,
    without a host sync; ``drain()`` returns the log row (:func:`trl_log_metrics`) and resets the sums, keeping the
    cumulative ``num_tokens``. ``mean`` (as in ``Run.drain``) averages a summed tensor across DDP ranks: the ratios
    stay exact, ``num_tokens`` then counts one rank's average share.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0  # examples since the last drain (their number is public to this rank: the batch size)
        self.num_tokens = 0.0

    def add(self, values: Mapping[str, torch.Tensor] | None) -> None:
        if not values:
            return
        sizes = {int(v.shape[0]) if v.ndim else 1 for v in values.values()}
        if len(sizes) != 1:
            raise InputTypeError(f"per-example metric values must share their batch size, got sizes {sorted(sizes)}.")
        self.count += sizes.pop()
        for name, value in values.items():
            total = value.detach().float().sum()
            self.sums[name] = self.sums[name] + total if name in self.sums else total

    def drain(self, mean: Callable[[Any], Any] = lambda value: value) -> dict[str, float]:
        if not self.sums:
            return {}
        device = next(iter(self.sums.values())).device
        count = float(mean(torch.tensor(float(self.count), device=device)))  # averaged like the sums
        sums = {name: float(mean(total)) for name, total in self.sums.items()}
        self.num_tokens += sums.get("num_tokens", 0.0)
        logs = trl_log_metrics(sums, count, self.num_tokens)
        self.sums, self.count = {}, 0
        return logs
