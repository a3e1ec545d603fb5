"""Turn an ``nn.Module`` into a pure function of its parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["functional_model", "load_parameters"]


def functional_model(
    module: nn.Module,
) -> tuple[Callable[..., Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split a module into ``(apply, params, frozen)``.

    * ``params``: ``{name: tensor}`` of the trainable parameters (``requires_grad=True``), detached.
    * ``frozen``: the other parameters and the buffers, detached.
    * ``apply(params, frozen, *args, **kwargs)`` runs ``module.forward`` with those tensors.

    Tied (shared) parameters appear once, under their first name, and are used at every place they are tied to,
    so a per-example gradient already sums the contributions of every use before it is clipped.
    """
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"functional_model expects an nn.Module, got {type(module).__name__}.")
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    frozen = {name: p.detach() for name, p in module.named_parameters() if not p.requires_grad}
    frozen.update({name: b.detach() for name, b in module.named_buffers()})

    def apply(params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return functional_call(module, {**frozen, **params}, args, kwargs, tie_weights=True, strict=False)

    return apply, params, frozen


def load_parameters(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy ``params`` (as returned by training on :func:`functional_model`'s tensors) into ``module`` in place."""
    own = dict(module.named_parameters())
    unknown = sorted(set(params) - set(own))
    if unknown:
        raise ConfigurationError(f"load_parameters got names the module does not have: {unknown[:5]}.")
    with torch.no_grad():
        for name, value in params.items():
            own[name].copy_(value)
