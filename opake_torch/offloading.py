"""Activation offloading: the tensors a pass saves for its backward wait in pinned host memory, not on the device.

The forward of a per-example gradient pass saves, for its backward, the activations of every layer; their device
memory grows with the rows and positions of a chunk. Offloaded, each saved tensor is copied to pinned host memory as
it is saved (a non-blocking copy on the current stream, so that the device memory it frees is reused only after the
copy) and copied back when the backward reads it: device memory for time on the host link, with the same values (a
copy changes no bit).

Two ways in, since ``torch.func.grad`` refuses saved-tensor hooks ("torch.func.{grad, vjp, jacrev, hessian} don't yet
support saved tensor hooks"), so that :func:`torch.autograd.graph.save_on_cpu` cannot run inside ``vmap(grad)``:

* plain autograd (the layerwise engine): :class:`OffloadedGradients` wraps an engine's ``gradients`` in
  :func:`saved_on_host`, the saved-tensor hooks of ``save_on_cpu(pin_memory=True)`` that leave the weights where they
  are; every tensor an operation saves goes to the host, the inputs a checkpointed layer keeps included. The
  recompute of a checkpointed layer in the backward keeps its own activations on the device (they are read at once);
* ``vmap(grad)``: only a checkpointed layer's inputs, which the recompute's ``autograd.Function`` moves itself
  (:func:`~opake_torch.patches.activation_checkpointing.checkpoint_layer` with ``offload=True``); the activations of
  the other operations stay in the device memory of the grad transform.

On a CPU run host memory is the device's: :func:`to_host` returns a tensor as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

__all__ = ["VMAP_NEEDS_CHECKPOINTING", "OffloadedGradients", "on_device", "saved_on_host", "to_device", "to_host"]

VMAP_NEEDS_CHECKPOINTING = (
    "activation_offloading=True needs gradient_checkpointing=True when per-example gradients run by vmap(grad): "
    "torch.func.grad refuses the saved-tensor hooks that would move its activations, so only the inputs the "
    "checkpointed layers keep can wait in host memory. Set gradient_checkpointing=True, or "
    "per_example_gradients='layerwise' where the model allows it (it offloads every saved activation)."
)


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` in host memory: a pinned copy (non-blocking, ordered on the current stream) of a device tensor; a host
    tensor as it is."""
    if x.device.type == "cpu":
        return x
    # empty_like, not empty: under vmap it is batched like ``x`` (a checkpointed layer's inputs)
    return torch.empty_like(x, device="cpu", pin_memory=True).copy_(x, non_blocking=True)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` (from :func:`to_host`) back on ``device``."""
    return x if x.device == device else x.to(device, non_blocking=True)


def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr()


@contextlib.contextmanager
def saved_on_host(keep: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """For the duration, in plain autograd: every tensor an operation saves for the backward is held by
    :func:`to_host` and returned to its device when the backward unpacks it. Tensors that share storage with one of
    ``keep`` (the weights: they stay on the device anyway) are saved as they are.

    Raises RuntimeError inside ``torch.func.grad`` (which refuses saved-tensor hooks)."""
    kept = {_storage(x) for x in keep}

    def pack(x: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
        # detached: a packed value that holds the saved tensor itself would make a reference cycle through its node
        if _storage(x) in kept:
            return None, x.detach()
        return x.device, to_host(x).detach()  # a host tensor as it is (a checkpointed layer's offloaded inputs)

    def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
        device, x = packed
        return x if device is None else to_device(x, device)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextlib.contextmanager
def on_device() -> Iterator[None]:
    """For the duration: saved tensors stay where they are, whatever hooks are around (a checkpointed layer's
    recompute, whose activations the backward reads at once)."""
    with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, _same):
        yield


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class OffloadedGradients:
    """An engine's ``gradients`` (:class:`opake_core.clipping.Engine`) run under :func:`saved_on_host`, with the
    tensors of the arguments that are not batched (the parameters) kept where they are. For engines that run plain
    autograd (:class:`~opake_torch.layerwise.LayerwiseGradients`); ``vmap(grad)`` refuses the hooks."""

    inner: Callable[..., tuple[Any, Any]]

    def __call__(
        self, example_grad: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]
    ) -> tuple[Any, Any]:
        fixed = [arg for i, arg in enumerate(args) if i not in batch_argnums]
        # plain tensors only: a sharded parameter (FSDP2's DTensor) has no storage of its own to compare
        keep = [x for x in optree.tree_leaves(fixed) if type(x) in (torch.Tensor, torch.nn.Parameter)]
        with saved_on_host(keep):
            return self.inner(example_grad, args, batch_argnums)
