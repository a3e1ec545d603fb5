"""Multi-tensor (``torch._foreach_*``) versions of the per-leaf transforms that dominate a step's launch count.

A model with hundreds of parameter tensors pays a kernel launch per leaf and per operation in a per-leaf
``tree_map``; the ``_foreach`` operations launch one kernel per group of tensors. Each function here performs the
same floating-point operations in the same order as the per-leaf torchopt transform it replaces, so results are
bitwise equal. Out of place (the default) every operation writes to new tensors. With ``inplace=True`` (a step that
owns its inputs, :func:`opake_core.dp_step` with ``donate=True``) the new state is written into the old state's tensors
and the updates into the gradients' tensors, with the same bits: no model-sized tree is allocated.
"""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch
from torchopt.base import GradientTransformation

from opake_core.tree import size_groups

__all__ = ["AdamState", "add_decayed_weights", "scale_by_adam"]

GROUP_NUMEL = 2**26
"""Elements (256 MB in float32) per group of leaves whose temporary an in-place update forms at once."""


class AdamState(NamedTuple):
    """Adam's moments (trees like the parameters) and ``count``, the number of updates: a 0-d int64 CPU tensor.

    One host counter (not one per leaf on the device), so the bias corrections are two host scalars per step.
    """

    mu: object
    nu: object
    count: object


def _leaves(tree: object) -> tuple[list[torch.Tensor], object]:
    return optree.tree_flatten(tree)


def scale_by_adam(b1: float, b2: float, eps: float) -> GradientTransformation:
    """``m_hat / (sqrt(v_hat) + eps)`` with ``m = b1 m + (1 - b1) g`` and ``v = b2 v + (1 - b2) g^2``, bias-corrected.

    The same operations as ``torchopt.transform.scale_by_adam`` (``eps_root = 0``), grouped across leaves.
    """

    def init_fn(params: object) -> AdamState:
        leaves, treedef = _leaves(params)
        return AdamState(
            mu=optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves]),
            nu=optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves]),
            count=torch.zeros((), dtype=torch.int64),
        )

    def update_fn(updates, state, *, params=None, inplace=False):
        g, treedef = _leaves(updates)
        mu, nu = optree.tree_leaves(state.mu), optree.tree_leaves(state.nu)
        if inplace:
            torch._foreach_mul_(mu, b1)
            torch._foreach_mul_(nu, b2)
        else:
            mu, nu = torch._foreach_mul(mu, b1), torch._foreach_mul(nu, b2)
        torch._foreach_add_(mu, g, alpha=1 - b1)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)
        count = state.count + 1
        # the bias corrections as torchopt forms them: 1 - b^count in float32 (exact as Python floats)
        bc1, bc2 = float(1 - pow(b1, count)), float(1 - pow(b2, count))
        if inplace and all(a.dtype == b.dtype for a, b in zip(g, mu, strict=True)):
            # g is free once the moments are updated: the direction goes there, one group's denominator at a time
            for group in size_groups([leaf.numel() for leaf in g], GROUP_NUMEL):
                denominator = torch._foreach_div([nu[i] for i in group], bc2)
                torch._foreach_sqrt_(denominator)
                torch._foreach_add_(denominator, eps)
                direction = [g[i] for i in group]
                torch._foreach_copy_(direction, [mu[i] for i in group])
                torch._foreach_div_(direction, bc1)
                torch._foreach_div_(direction, denominator)
            out = g
        else:
            m_hat = torch._foreach_div(mu, bc1)
            v_hat = torch._foreach_div(nu, bc2)
            denominator = torch._foreach_sqrt(v_hat)
            torch._foreach_add_(denominator, eps)
            out = torch._foreach_div(m_hat, denominator)
        unflatten = lambda leaves: optree.tree_unflatten(treedef, leaves)  # noqa: E731
        return unflatten(out), AdamState(mu=unflatten(mu), nu=unflatten(nu), count=count)

    return GradientTransformation(init_fn, update_fn)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """``update + weight_decay * param`` for every leaf (torchopt's ``add_decayed_weights``, grouped)."""

    def init_fn(params: object) -> tuple:
        return ()

    def update_fn(updates, state, *, params=None, inplace=False):
        if weight_decay == 0:
            return updates, state
        g, treedef = _leaves(updates)
        if inplace:
            torch._foreach_add_(g, optree.tree_leaves(params), alpha=weight_decay)
            return updates, state
        out = torch._foreach_add(g, optree.tree_leaves(params), alpha=weight_decay)
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(init_fn, update_fn)
