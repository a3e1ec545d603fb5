"""Turn an ``nn.Module`` into a pure function of its parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from opake_core.errors import InputTypeError

__all__ = ["functional_model"]


def functional_model(
    module: nn.Module,
) -> tuple[Callable[..., Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a module into ``(apply, params, frozen)``.

    * ``params``: ``{name: tensor}`` of the trainable parameters (``requires_grad=True``), detached.
    * ``frozen``: the other parameters and the buffers, detached.
    * ``apply(params, frozen, *args, **kwargs)`` runs ``module.forward`` with those tensors.

    Tied (shared) parameters appear once, under their first name, and are used at every place they are tied to,
    so a per-example gradient already sums the contributions of every use before it is clipped.

    Example: the pure function computes what the module computes, and the core's steps differentiate it.

        >>> import torch
        >>> from opake_core import clipped_grad
        >>> from opake_torch import functional_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
        >>> apply, params, frozen = functional_model(model)
        >>> x = torch.randn(5, 3)
        >>> torch.allclose(apply(params, frozen, x), model(x))
        True
        >>> grad_fn, state = clipped_grad(lambda p, x: apply(p, frozen, x).sum(), clipping_norm=1.0)
        >>> clipped, state = grad_fn(params, x, state=state)
        >>> sorted(clipped.value) == sorted(params)
        True
    """
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"functional_model expects an nn.Module, got {type(module).__name__}.")
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    frozen = {name: p.detach() for name, p in module.named_parameters() if not p.requires_grad}
    frozen.update({name: b.detach() for name, b in module.named_buffers()})

    def apply(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return functional_call(module, {**frozen, **params}, args, kwargs, tie_weights=True, strict=False)

    return apply, params, frozen
