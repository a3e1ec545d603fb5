"""``grad_norm`` in the logs: the L2 norm of the privatized gradient each step releases.

Hugging Face logs the norm of the batch gradient before its clipping; under DP that norm is an exact statistic of
the private batch. The value logged here is instead the norm of what the optimizer receives: the clipped sum of the
per-example gradients, divided by the expected batch size, **with the noise added** (after the sum over ranks). That
tree is released by the step itself, so its norm is post-processing of a private output and costs no privacy; it is
dominated by the noise when the noise is large (about ``noise std * sqrt(parameters)``).
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from opake_core.tree import Noised

__all__ = ["ReleasedNorm"]


class ReleasedNorm:
    """``optimizer`` (a core :class:`~opake_core.optim.Optimizer`) that also keeps the squared L2 norm of the noised
    gradient tree its last ``update`` or ``apply_in_place`` received (:attr:`squared`, a float32 scalar on the
    device, read only when a row is logged: no host sync per step). Every other attribute is the optimizer's."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.squared: torch.Tensor | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def update(self, updates: Any, state: Any, **kwargs: Any) -> tuple[Any, Any]:
        self._keep(updates)
        return self.optimizer.update(updates, state, **kwargs)

    def apply_in_place(self, updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        self._keep(updates)
        return self.optimizer.apply_in_place(updates, state, params)

    def _keep(self, updates: Any) -> None:
        """The squared norm of a noised tree, taken before the optimizer, which may write into its tensors."""
        if isinstance(updates, Noised):
            leaves = optree.tree_leaves(updates.value)
            wide = [leaf for leaf in leaves if leaf.dtype == torch.float64]  # a float64 norm is not narrowed
            narrow = [leaf for leaf in leaves if leaf.dtype != torch.float64]  # bf16 / float32: taken in float32
            with torch.no_grad():  # one multi-tensor launch per kind of leaf, no per-leaf host work
                norms = [*(torch._foreach_norm(narrow, 2, dtype=torch.float32) if narrow else []),
                         *(torch._foreach_norm(wide) if wide else [])]  # fmt: skip
                self.squared = torch.stack(norms).square().sum().float() if norms else None
