"""Adding updates to parameters, out of place."""

from __future__ import annotations

from typing import Any

import torchopt
from torch.profiler import record_function

from opake_core.errors import InputTypeError
from opake_core.tree import Clipped


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf: a new tree; ``params`` and ``updates`` are not modified.

    ``updates`` is what an optimizer's ``update`` returned (a plain tree shaped like ``params``), never
    gradients.
    """
    with record_function("opake::optim.apply_updates"):
        if isinstance(updates, Clipped):
            raise InputTypeError(
                f"apply_updates received a {type(updates).__name__} tree of gradients; pass it through an "
                "optimizer's update first and apply the updates it returns."
            )
        return torchopt.apply_updates(params, updates, inplace=False)
