"""The neighbour test: every record's per-example gradient depends on that record only.

DP-SGD's sensitivity is the clipping bound ``C`` only if adding or removing one record changes the clipped sum by
that record's own clipped gradient and nothing else. A model that couples the records of a batch breaks this while
every single gradient still looks right: a module that computes a statistic over the batch (a batch mean, batch
norm in a batched forward), or a record whose output depends on the batch's padded length (a position the attention
mask does not cover, a pooling over padding). Both couple the records of the layerwise engine, which runs one
batched forward; under ``vmap(grad)`` each record runs alone but padded to the batch's length, so the second does.

The test runs the engine of the run on a few training rows ``S`` (the shortest of a small sample among them, and an
empty record where the trainer's own collation and loss serve the run), then on ``S`` plus the longest row of the
sample, which grows the padded length; adding that row must leave every row of ``S`` with the same gradient: per
trainable leaf its squared norm, and the sum over ``S`` with fixed random weights (which moves with any change of a
row's gradient, not only of its norm). Both passes run in the step's chunks (``microbatch_size`` rows at most: the
memory of a step, and the rows a batched forward of the step holds together), without dropout (eval mode), on rows
cut to their first positions, under ``no_grad`` as a step does; nothing is drawn from the global random generator.

Cost: two passes of the engine (a forward and a backward each) on :data:`ROWS` and ``ROWS + 1`` rows, and one
float32 accumulator of the trainable parameters, once per ``train()`` call: about two steps on five rows. Wall time
on a two-core CPU, 'layerwise' and 'vmap': 0.01 s each for the one-layer test models, 3 s and 10 to 14 s for a
BERT-base-shaped classifier (110M parameters, rows of 8 to 128 tokens).

What it does not see: a coupling smaller than the tolerance (rounding of the dtype in use), one that appears only in
training mode other than batch norm (which the layerwise engine refuses by type), and one that needs rows the sample
does not hold.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree
import torch
from torch import nn

from opake_core.clipping.engine import example_grad
from opake_core.clipping.microbatching import chunk_sizes
from opake_core.clipping.rules import accumulation_dtype
from opake_core.errors import ConfigurationError

__all__ = [
    "POSITIONS",
    "ROWS",
    "SAMPLE",
    "check_neighbours",
    "check_padding_mask",
    "neighbour_rows",
    "neighbour_users",
]

SAMPLE = 16
"""Rows read, evenly spaced over the dataset, to find the shortest and the longest."""

ROWS = 4
"""Rows in the smaller batch ``S`` of the test (the larger one holds one more)."""

POSITIONS = 512
"""The added row is cut to its first ``POSITIONS`` positions and the rows of ``S`` to half as many, so that the padded
length grows whenever the added row is longer than that half."""


def _length(value: Any) -> int | None:
    """The positions of a sequence column's value (its first dimension), or None for a scalar or a string."""
    if isinstance(value, str | bytes):
        return None
    if isinstance(value, torch.Tensor | np.ndarray):
        return int(value.shape[0]) if value.ndim else None
    return len(value) if isinstance(value, Sequence) else None


def _cut(row: dict[str, Any], positions: int) -> dict[str, Any]:
    return {k: v[:positions] if (_length(v) or 0) > positions else v for k, v in row.items()}


def neighbour_rows(
    dataset: Any,
    read: Callable[[Sequence[int]], list[dict[str, Any]]],
    *,
    empty: bool,
    positions: int = POSITIONS,
) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """``(S, extra)`` for :func:`check_neighbours`: ``read(indices)`` returns the rows of ``dataset`` at ``indices``.

    Of :data:`SAMPLE` rows evenly spaced over the dataset, ``extra`` is the longest (its longest sequence column), cut
    to its first ``positions``, and ``S`` the shortest and the next ones in dataset order, :data:`ROWS` in all, cut to
    ``positions // 2``, the last of them an empty record (every sequence column of length 0) with ``empty``. None when
    no batch of two rows can be formed.
    """
    n = len(dataset)
    indices = sorted({int(i) for i in np.linspace(0, n - 1, min(n, SAMPLE)).round()}) if n else []
    sample = read(indices)
    if len(sample) < (1 if empty else 2):
        return None
    length = [max((_length(v) or 0 for v in row.values()), default=0) for row in sample]
    longest = max(range(len(sample)), key=lambda i: length[i])
    others = [i for i in range(len(sample)) if i != longest]
    shortest = [min(others, key=lambda i: length[i])] if others else []
    chosen = shortest + [i for i in others if i not in shortest]
    empty_row = _empty(sample[longest]) if empty else None
    rows = [_cut(sample[i], positions // 2) for i in chosen[: ROWS - int(empty_row is not None)]]
    rows += [empty_row] if empty_row is not None else []
    return (rows, _cut(sample[longest], positions)) if rows else None


def neighbour_users(
    read: Callable[[Sequence[int]], list[dict[str, Any]]],
    row_users: np.ndarray,
    max_rows: int,
    *,
    positions: int = POSITIONS,
) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]] | None:
    """``(S, extra)`` for :func:`check_neighbours` under ``privacy_unit="user"``: the records are users, each the list
    of its first ``max_rows`` rows (``row_users[i]``: the user of row ``i``; ``read(indices)`` returns rows). Of
    :data:`SAMPLE` users evenly spaced over the users, ``extra`` is the one with the longest row, cut to its first
    ``positions``, and ``S`` the shortest and the next ones, :data:`ROWS` in all, cut to ``positions // 2``. None
    with fewer than two users."""
    count = int(row_users.max()) + 1 if len(row_users) else 0
    if count < 2:
        return None
    chosen_users = sorted({int(u) for u in np.linspace(0, count - 1, min(count, SAMPLE)).round()})
    users = [read(np.flatnonzero(row_users == u)[:max_rows]) for u in chosen_users]
    length = [max((_length(v) or 0 for row in rows for v in row.values()), default=0) for rows in users]
    longest = max(range(len(users)), key=lambda i: length[i])
    others = sorted((i for i in range(len(users)) if i != longest), key=lambda i: length[i])
    rows = [[_cut(row, positions // 2) for row in users[i]] for i in others[:ROWS]]
    return rows, [_cut(row, positions) for row in users[longest]]


def _empty(row: dict[str, Any]) -> dict[str, Any] | None:
    """``row`` with every sequence column of length 0 (tensors of their dtype), or None where a column is no tensor
    of numbers (the data check refuses such a row)."""
    try:
        return {k: torch.as_tensor(v)[:0] if _length(v) is not None else v for k, v in row.items()}
    except (TypeError, ValueError, RuntimeError):
        return None


def check_padding_mask(
    dataset: Any,
    read: Callable[[Sequence[int]], list[dict[str, Any]]],
    collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> None:
    """ConfigurationError when ``collate`` (a data collator) marks padding as attended: the rows of
    :func:`neighbour_rows` (``read(indices)`` returns the rows of ``dataset``), collated with the longest of them, give
    a shorter row an ``attention_mask`` that keeps more positions than the row has tokens. The model then attends to
    positions whose number depends on the other records of the batch, which couples them (and the neighbour test
    sees it only where the loss moves). Nothing to see without ``input_ids`` and ``attention_mask``."""
    sample = neighbour_rows(dataset, read, empty=False)
    if sample is None:
        return
    rows, extra = sample
    mask = collate([*rows, extra]).get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    for row, kept in zip(rows, mask.ne(0).sum(dim=1).tolist(), strict=False):
        tokens = _length(row.get("input_ids"))
        if tokens is not None and kept > tokens:
            raise ConfigurationError(
                f"the data collator marks padding as attended: a row of {tokens} tokens, padded to {mask.shape[1]} "
                f"beside a longer one, gets an attention_mask that keeps {kept} positions. Each record would then "
                "depend on how long the other records of its batch are, which the privacy guarantee does not allow. "
                "Use a collator that sets attention_mask to 0 on padding (transformers.DataCollatorWithPadding, "
                "DataCollatorForLanguageModeling), or leave data_collator=None for the trainer's own padding."
            )


def check_neighbours(
    gradients: Callable[..., Any],
    *,
    model: nn.Module,
    params: dict[str, torch.Tensor],
    loss_fn: Callable[..., Any],
    has_aux: bool,
    batch_of: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    rows: list[dict[str, Any]],
    extra: dict[str, Any],
    microbatch: int,
    batch_loss: Callable[..., Any] | None,
    rtol: float,
    engine_name: str,
) -> float:
    """Raise ConfigurationError when adding ``extra`` to the batch of ``rows`` changes another row's gradient.

    Args:
        gradients: the engine's ``gradients(example_grad, args, batch_argnums)``
            (:class:`~opake_core.clipping.Engine`), run on ``(params, batch)``.
        loss_fn: the per-example loss ``loss_fn(params, example)`` of the step (``(loss, aux)`` with ``has_aux``).
        batch_of: rows -> the batch the step would see (collated, on the device).
        rows, extra: from :func:`neighbour_rows`.
        microbatch: the step's chunk size: each batch runs as the step's chunks of at most this many rows.
        batch_loss: the batched loss the engine runs in one forward (``batch_loss(params, batch)``), or None where
            each row runs alone (``vmap``); used to name the first module whose output moved.
        rtol: the largest relative change allowed (the rounding of the dtype in use).
        engine_name: the engine's name, for the message.

    Returns the largest relative change seen. The message names the trainable leaf whose gradient moved the most
    and the first module (in forward order) whose output for a row of ``rows`` changed, with no value from the data.
    """
    k = len(rows)
    small, large = batch_of(rows), batch_of([*rows, extra])
    names = [path[0] if len(path) == 1 else ".".join(map(str, path)) for path in optree.tree_paths(params)]
    weights = 1.0 + torch.rand(k + 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights[k] = 0.0  # the added row itself is not compared
    # one accumulator: the small batch adds sum_i w_i g_i, the large one subtracts it
    moved = [torch.zeros_like(x, dtype=accumulation_dtype(x.dtype)) for x in optree.tree_leaves(params)]
    training = model.training
    model.eval()  # no dropout: both passes see the same function
    try:
        step_grad = example_grad(loss_fn, 0, has_aux)
        sq_small = _pass(gradients, step_grad, params, small, weights[:k], moved, microbatch)
        sq_large = _pass(gradients, step_grad, params, large, -weights, moved, microbatch)[:, :k]
    finally:
        model.train(training)
    moved_sq = torch.stack([d.double().square().sum() for d in moved])  # [L]
    del moved
    worst, rel, per_leaf = _changes(sq_small, sq_large, moved_sq, weights[:k])
    if worst <= rtol:
        return worst
    suspects = [i for i in range(k) if rel[i] > rtol] or [i for i in range(k) if sq_small[:, i].sum() > 0]
    run = functools.partial(_row_outputs, model, params, loss_fn=loss_fn, batch_loss=batch_loss, microbatch=microbatch)
    module = _first_moved(run(small, k), run(large, k), suspects, dict(model.named_modules()), rtol)
    where = f"; the first module whose output for another record changed: {module}" if module else ""
    if batch_loss is not None:
        fix = (
            "Use per_example_gradients='vmap' (each record runs alone; 'auto' falls back to it), or fix the model (no "
            "statistic over the batch, every padding position masked)."
        )
    else:
        fix = (
            "Fix the model (every padding position masked: pass an attention_mask, or try another "
            "attn_implementation), or pad every batch to one length (max_length with pad_to_multiple_of=max_length), "
            "so that no record changes it."
        )
    raise ConfigurationError(  # no number or row: the test reads private records, and messages reach logs
        f"records are not independent under per_example_gradients={engine_name!r}: adding one training record to a "
        f"batch of {k} changed the per-example gradients of the others by more than rtol={rtol} (relative), most "
        f"on {names[int(per_leaf.argmax())]!r}{where}. The model computes across the batch (a batch statistic or a "
        "batch-level branch), or a record depends on the batch's padded length (a position its attention mask does "
        f"not cover): the clipped sum would move by more than C when one record is added. {fix}"
    )


def _changes(
    sq_small: torch.Tensor, sq_large: torch.Tensor, moved_sq: torch.Tensor, weights: torch.Tensor
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """``(worst, rel [k], per_leaf [L])`` from the rows' squared norms per leaf in the two batches (``[L, k]``) and
    the squared norms of their weighted sums' difference (``[L]``): each row's relative change of norm, the weighted
    sum's change relative to ``sum_i w_i ||g_i||``, the largest of them, and how much each leaf moved."""
    a, b = sq_small.sqrt(), sq_large.sqrt()  # each row's norm per leaf
    norm_a, norm_b = sq_small.sum(0).sqrt(), sq_large.sum(0).sqrt()
    nonfinite = ~norm_a.isfinite() & ~norm_b.isfinite()  # a non-finite gradient adds nothing to a step either way
    top = torch.maximum(norm_a, norm_b)
    rel = torch.nan_to_num((norm_a - norm_b).abs() / top, nan=math.inf)  # one side non-finite: inf
    rel = torch.where(nonfinite | (top == 0), torch.zeros_like(rel), rel)
    scale = (weights.to(a.device) * torch.where(nonfinite, 0.0, norm_a)).sum()
    total = moved_sq.sum().sqrt()
    worst = max([*rel.tolist(), (total / scale).item() if scale > 0 else (0.0 if total == 0 else math.inf)])
    return worst, rel, moved_sq.sqrt() + torch.nan_to_num((a - b).abs(), nan=math.inf).sum(1)


def _chunks(batch: dict[str, torch.Tensor], microbatch: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into the step's chunks (:func:`~opake_core.clipping.microbatching.chunk_sizes`)."""
    m = len(next(iter(batch.values())))
    out, start = [], 0
    for real, _ in chunk_sizes(m, microbatch):
        out.append({key: value[start : start + real] for key, value in batch.items()})
        start += real
    return out


def _pass(
    gradients: Callable[..., Any],
    step_grad: Callable[..., Any],
    params: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    weights: torch.Tensor,
    sums: list[torch.Tensor],
    microbatch: int,
) -> torch.Tensor:
    """The engine's squared norms ``[L, m]`` (float64) on ``batch``, chunk by chunk; adds ``sum_i weights[i] g_i`` to
    ``sums``."""
    norms, start = [], 0
    with torch.no_grad():
        for chunk in _chunks(batch, microbatch):
            grads, _ = gradients(step_grad, (params, chunk), (1,))
            norms.append(grads.squared_norms())
            rows = weights[start : start + norms[-1].shape[1]]
            scales = {s.dtype: rows.to(s.dtype).to(s.device)[None].expand(len(sums), -1) for s in sums}
            grads.add_scaled(scales, sums)
            start += norms[-1].shape[1]
    return torch.cat(norms, dim=1)


def _first_moved(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], rows: list[int], modules: dict, rtol: float
) -> str | None:
    """``'name' (Type)`` of the first module, in forward order, whose output for one of ``rows`` differs between
    ``before`` and ``after`` (on the positions both have), or None."""
    for name, x_all in before.items():
        y_all = after.get(name)
        if y_all is None or x_all.dim() != y_all.dim():
            continue
        for i in rows:
            x, y = x_all[i], y_all[i]
            common = tuple(slice(0, min(p, q)) for p, q in zip(x.shape, y.shape, strict=True))
            x, y = x[common], y[common]
            if not torch.allclose(x, y, rtol=0, atol=rtol * max(x.abs().max().item(), 1e-30), equal_nan=True):
                return f"{name!r} ({type(modules[name]).__name__})"
    return None


def _row_outputs(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    k: int,
    *,
    loss_fn: Callable[..., Any],
    batch_loss: Callable[..., Any] | None,
    microbatch: int,
) -> dict[str, torch.Tensor]:
    """``{module name: its output for rows 0..k-1}`` (stacked), in the order the modules first ran, from the forwards
    of the step's chunks (``batch_loss``) or of each row alone (``loss_fn``); modules that run more than once per
    forward, or whose output has no row dimension, are left out."""
    names = {module: name for name, module in model.named_modules() if module is not model}
    seen: dict[str, list[torch.Tensor]] = {}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple | list) and output else output
        if isinstance(out, torch.Tensor) and out.dim():
            seen.setdefault(names[module], []).append(out.detach().float())

    if batch_loss is None:
        chunks = [{key: value[i : i + 1] for key, value in batch.items()} for i in range(k)]
        forward = lambda chunk: loss_fn(params, {key: value[0] for key, value in chunk.items()})  # noqa: E731
    else:
        chunks = _chunks(batch, microbatch)
        forward = functools.partial(batch_loss, params)
    handles = [module.register_forward_hook(hook) for module in names]
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for chunk in chunks:
                forward(chunk)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    sizes = [len(next(iter(chunk.values()))) for chunk in chunks]
    once = lambda calls: [c.shape[0] for c in calls] == sizes and len({c.shape[1:] for c in calls}) == 1  # noqa: E731
    return {name: torch.cat(calls)[:k] for name, calls in seen.items() if once(calls)}
