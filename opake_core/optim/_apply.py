"""Adding updates to parameters: out of place, or into the parameters' own tensors."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.profiler import record_function

from opake_core.errors import InputTypeError
from opake_core.tree import Clipped


def apply_updates(params: Any, updates: Any, *, inplace: bool = False) -> Any:
    """``params + updates`` leaf by leaf (one multi-tensor add): a new tree; neither input is modified.

    ``updates`` is what an optimizer's ``update`` returned (a plain tree shaped like ``params``), never
    gradients. With ``inplace=True`` the sums are written into the parameters' own tensors (the same bits where
    each update has its parameter's dtype; out of place otherwise) and ``params`` is returned.

    Example:

        >>> import torch
        >>> from opake_core import optim
        >>> params = {"w": torch.ones(2)}
        >>> new = optim.apply_updates(params, {"w": torch.tensor([0.5, -1.0])})
        >>> new["w"], params["w"]  # the input is left as it was
        (tensor([1.5000, 0.0000]), tensor([1., 1.]))
    """
    with record_function("opake::optim.apply_updates"):
        if isinstance(updates, Clipped):
            raise InputTypeError(
                f"apply_updates received a {type(updates).__name__} tree of gradients; pass it through an "
                "optimizer's update first and apply the updates it returns."
            )
        leaves, treedef = optree.tree_flatten(params)
        steps, update_treedef = optree.tree_flatten(updates)
        if update_treedef != treedef:
            raise InputTypeError(f"updates {update_treedef} do not match the parameters' structure {treedef}.")
        if inplace and all(p.dtype == u.dtype for p, u in zip(leaves, steps, strict=True)):
            with torch.no_grad():  # parameters may be autograd leaves
                torch._foreach_add_(leaves, steps)
            return params
        return optree.tree_unflatten(treedef, torch._foreach_add(leaves, steps))
