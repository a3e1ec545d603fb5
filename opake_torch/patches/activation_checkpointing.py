"""Gradient checkpointing that runs inside ``torch.func.vmap(grad(...))``.

Why not ``torch.utils.checkpoint``: in torch 2.13 the non-reentrant checkpoint is built on saved-tensor hooks, and
``torch.func.grad`` refuses them ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks");
``context_fn`` does not help, the hooks are installed whatever the context. The reentrant checkpoint is an
``autograd.Function`` without ``setup_context``, which functorch refuses too.

What works (verified in ``tests/torch/scale/test_checkpointing.py``): a recomputing ``autograd.Function`` written for
functorch, i.e. with ``setup_context`` and ``generate_vmap_rule = True``.

* ``forward`` runs the layer on its tensor inputs. Functorch runs a custom Function's forward below the transforms,
  so none of the layer's activations are saved for the grad transform; ``setup_context`` saves only the layer's
  inputs (the hidden states, masks, rotary tables) and its parameters (references, no copies).
* ``backward`` recomputes the layer and differentiates it with ``torch.func.vjp``, only with respect to the inputs
  that need a gradient (``ctx.needs_input_grad``): frozen base weights under LoRA get no per-example gradient.
* ``generate_vmap_rule`` lets vmap batch both passes, so the per-example backward is vectorized like the rest.
* Every tensor the layer reads is an explicit input of the Function (parameters and buffers included, taken from
  the module as ``torch.func.functional_call`` reparametrized it), so gradients reach the trainable parameters and
  batched tensors are never captured by a closure.
* The autocast state is recorded at the call and re-entered for the recompute; the RNG state (CPU and the CUDA
  device) is recorded and restored for the recompute when the layer has active dropout, so the recomputed masks
  are the forward's masks. Without active dropout no RNG state is touched, which is what lets CUDA graphs capture a
  checkpointed step (a graph cannot read the generator state during capture).

Under the layerwise engine (:mod:`opake_torch.layerwise`, plain autograd, no vmap) the Function also takes the
pass's anchor as an input, and its backward recomputes the layer in plain autograd (``torch.autograd.grad``, the
anchor among the inputs), so that the engine's hooks tap the recomputed layers and form their per-example
gradients there. The engine hands its anchor to the checkpointed layers of its model for the duration of its pass
(:func:`recompute_linked_to`); nothing else carries it.

With ``offload`` (``activation_offloading``) the Function keeps the tensors of the call in pinned host memory until
the backward (:mod:`opake_torch.offloading`): the only offloading that runs under ``vmap(grad)``, which refuses
saved-tensor hooks. The recompute in plain autograd keeps its own activations on the device.

First-order only (the backward is not itself differentiable twice). It also works outside functorch, in plain
autograd. It cannot be traced by ``torch.compile`` (the recompute runs a nested ``torch.func.vjp`` inside a
backward), hence :func:`check_memory_knobs`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from opake_core.errors import ConfigurationError
from opake_torch import offloading

__all__ = [
    "check_memory_knobs",
    "checkpoint_layer",
    "enable_vmap_checkpointing",
    "has_active_dropout",
    "recompute_linked_to",
]


def has_active_dropout(model: nn.Module) -> bool:
    """Whether a forward pass in training mode draws random numbers: a dropout module or config probability > 0."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and module.training:
            return True
        config = getattr(module, "config", None)
        if config is not None and module.training:
            for name in ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
                value = getattr(config, name, 0.0)
                if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                    return True
    return False


class _Recompute(torch.autograd.Function):
    """``run(*inputs)`` without saved activations; the backward recomputes it under ``torch.func.vjp``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(run: Callable[..., tuple[torch.Tensor, ...]], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return run(*inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        run, *tensors = inputs
        ctx.run = run
        # functorch also calls this at the levels below grad, where no input needs a gradient and no backward
        # reads what is saved: copying there would only cost time
        offload = run.offload if any(x.requires_grad for x in tensors) else 0
        ctx.devices = [x.device for x in tensors[:offload]]
        tensors[:offload] = [offloading.to_host(x) for x in tensors[:offload]]
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors
        if ctx.devices:
            moved = [offloading.to_device(x, device) for x, device in zip(inputs, ctx.devices, strict=False)]
            inputs = (*moved, *inputs[len(moved) :])
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        if not wanted:
            return (None,) * (len(inputs) + 1)
        if ctx.run.anchor is not None:
            return (None, *_plain_recompute(ctx.run, inputs, wanted, grad_outputs))

        def partial_run(*diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(inputs)
            for index, value in zip(wanted, diff, strict=True):
                full[index] = value
            return ctx.run(*full, recompute=True)

        with torch.enable_grad():
            _, vjp_fn = torch.func.vjp(partial_run, *(inputs[i] for i in wanted))
            grads = vjp_fn(tuple(grad_outputs))
        out: list[torch.Tensor | None] = [None] * len(inputs)
        for index, value in zip(wanted, grads, strict=True):
            out[index] = value
        return (None, *out)


def _plain_recompute(
    run: Any, inputs: tuple[torch.Tensor, ...], wanted: list[int], grad_outputs: tuple[torch.Tensor, ...]
) -> list[torch.Tensor | None]:
    """The gradients of ``run``'s inputs at ``wanted`` by a recompute in plain autograd; the last input is the
    layerwise anchor (``run.anchor``, the object the recomputed layers' taps link to)."""
    with torch.enable_grad(), offloading.on_device():  # read at once: offloading them would only cost copies
        full = [x.detach().requires_grad_(i in wanted) for i, x in enumerate(inputs[:-1])] + [run.anchor]
        outputs = run(*full, recompute=True)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad and g is not None]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [full[i] for i in wanted], [g for _, g in pairs], allow_unused=True
        )
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for index, value in zip(wanted, grads, strict=True):
        out[index] = value
    return out


@contextlib.contextmanager
def _replay_rng(state: tuple[torch.Tensor, torch.device | None, torch.Tensor | None] | None) -> Iterator[None]:
    if state is None:
        yield
        return
    cpu_state, device, cuda_state = state
    devices = [device] if device is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
        torch.set_rng_state(cpu_state)
        if device is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


def _is_cache(value: Any) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is optional for the Function itself
        return False
    return isinstance(value, Cache)


def checkpoint_layer(
    layer: nn.Module,
    function: Callable[..., Any],
    *args: Any,
    anchor: torch.Tensor | None = None,
    offload: bool = False,
) -> Any:
    """Run ``function(*args)`` (a call of ``layer``'s forward) with recomputation instead of saved activations.

    The signature of Hugging Face's ``_gradient_checkpointing_func`` with the layer bound first:
    ``function`` reads ``layer``'s parameters and buffers, which are swapped for the Function's inputs while it
    runs. Keyword arguments bound in a ``functools.partial`` are searched for tensors as well. ``anchor``: the
    layerwise engine's anchor (:func:`recompute_linked_to`), taken as an input, so that the backward recomputes the
    layer in plain autograd with its taps linked to it; None under vmap or plain autograd. ``offload``: the tensors
    of the call (hidden states, masks, rotary tables; not the weights) wait for the backward in pinned host memory
    (:func:`opake_torch.offloading.to_host`), the offloading that runs under ``vmap(grad)``.
    """
    keywords: dict[str, Any] = {}
    call = function
    if isinstance(function, functools.partial):
        call, keywords = functools.partial(function.func, *function.args), dict(function.keywords)
    # a KV cache would be written twice (forward and recompute); Hugging Face drops it only under some names
    keywords = {k: None if _is_cache(v) else v for k, v in keywords.items()}
    args = tuple(None if _is_cache(v) else v for v in args)
    state = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    names = list(state)
    leaves, spec = pytree.tree_flatten((args, keywords))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in positions] + [state[name] for name in names]
    tensors += [anchor] if anchor is not None else []
    device = next((t.device for t in tensors if t.is_floating_point()), torch.device("cpu"))
    autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
    rng = None
    if has_active_dropout(layer):
        cuda = device if device.type == "cuda" else None
        rng = (torch.get_rng_state(), cuda, torch.cuda.get_rng_state(cuda) if cuda is not None else None)
    out_spec: list[Any] = []
    constants: dict[int, Any] = {}

    def run(*inputs: torch.Tensor, recompute: bool = False) -> tuple[torch.Tensor, ...]:
        values = list(leaves)
        for index, value in zip(positions, inputs[: len(positions)], strict=True):
            values[index] = value
        call_args, call_kwargs = pytree.tree_unflatten(values, spec)
        params = dict(zip(names, inputs[len(positions) : len(positions) + len(names)], strict=True))
        with (
            _replay_rng(rng if recompute else None),
            torch.autocast(device.type, dtype=autocast[1], enabled=autocast[0]),
            _reparametrize_module(layer, params, tie_weights=False, strict=False),
        ):
            output = call(*call_args, **call_kwargs)
        out_leaves, tree = pytree.tree_flatten(output)
        if not out_spec:
            out_spec.append(tree)
            constants.update({i: leaf for i, leaf in enumerate(out_leaves) if not isinstance(leaf, torch.Tensor)})
        return tuple(leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor))

    run.anchor = anchor  # type: ignore[attr-defined]
    run.offload = len(positions) if offload else 0  # type: ignore[attr-defined]
    results = iter(_Recompute.apply(run, *tensors))
    count = out_spec[0].num_leaves
    return pytree.tree_unflatten([constants[i] if i in constants else next(results) for i in range(count)], out_spec[0])


def _checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is checkpointed by :func:`checkpoint_layer` (:func:`enable_vmap_checkpointing`). The
    function is an instance attribute (Hugging Face and :func:`enable_vmap_checkpointing` set it so): read from the
    instance's dictionary, which ``nn.Module.__getattr__``'s miss on every other module would make several times
    slower, a host cost of each step."""
    func = vars(module).get("_gradient_checkpointing_func")
    return isinstance(func, functools.partial) and func.func is checkpoint_layer


@contextlib.contextmanager
def recompute_linked_to(model: nn.Module, anchor: torch.Tensor) -> Iterator[None]:
    """For the duration: the layers of ``model`` checkpointed by :func:`checkpoint_layer` take ``anchor`` (the
    layerwise engine's scalar leaf, to which its taps link) as an input, so that their recompute runs in the
    backward in plain autograd and the engine's hooks tap the recomputed layers. Their checkpointing functions are
    restored on exit; other models and layers are untouched."""
    layers = [module for module in model.modules() if _checkpointed(module)]
    previous = [module._gradient_checkpointing_func for module in layers]
    for module, func in zip(layers, previous, strict=True):
        module._gradient_checkpointing_func = functools.partial(func, anchor=anchor)
    try:
        yield
    finally:
        for module, func in zip(layers, previous, strict=True):
            module._gradient_checkpointing_func = func


def enable_vmap_checkpointing(model: nn.Module, *, offload: bool = False) -> int:
    """Checkpoint every Hugging Face decoder layer of ``model`` with :func:`checkpoint_layer` (idempotent), its
    inputs kept in host memory until the backward with ``offload``.

    Sets ``gradient_checkpointing = True`` and a vmap-safe ``_gradient_checkpointing_func`` on every
    ``transformers.modeling_layers.GradientCheckpointingLayer`` (the repeated blocks of every current decoder);
    Hugging Face then checkpoints a layer when the model is in training mode and gradients are enabled (which they
    are inside ``torch.func.grad``). ``use_cache`` is forced off by Hugging Face in that case. Returns the number of
    checkpointed layers; raises ConfigurationError when the model has none.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    count = 0
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = functools.partial(checkpoint_layer, module, offload=offload)
            count += 1
        elif hasattr(module, "gradient_checkpointing"):  # the stacks, which drop their KV cache on this flag
            module.gradient_checkpointing = True
    if not count:
        raise ConfigurationError(
            f"{type(model).__name__} has no transformers GradientCheckpointingLayer to checkpoint; gradient "
            "checkpointing under vmap supports Hugging Face decoders. Set gradient_checkpointing=False, or lower "
            "microbatch_size to bound memory."
        )
    return count


def check_memory_knobs(model: nn.Module, args: Any) -> None:
    """Refuse combinations of memory knobs that cannot run (ConfigurationError).

    * ``gradient_checkpointing`` with ``torch_compile``: the recompute runs a nested ``torch.func.vjp`` inside a
      backward, which AOTAutograd cannot trace.
    * ``gradient_checkpointing`` with ``cuda_graphs`` while the model has active dropout: the recompute must replay
      the forward's RNG state, which cannot be read during a graph capture.
    """
    if not getattr(args, "gradient_checkpointing", False):
        return
    if getattr(args, "torch_compile", False):
        raise ConfigurationError(
            "gradient_checkpointing=True is incompatible with torch_compile=True: the vmap-safe recompute cannot be "
            "traced by torch.compile. Disable one of them (cuda_graphs is the alternative to compilation)."
        )
    if getattr(args, "cuda_graphs", 0) and has_active_dropout(model):
        raise ConfigurationError(
            f"gradient_checkpointing=True with cuda_graphs={args.cuda_graphs} needs a model without active dropout "
            "(the recompute replays the RNG state, which a CUDA graph capture cannot read). Set the dropout "
            "probabilities in the model config to 0, or set cuda_graphs=0."
        )
