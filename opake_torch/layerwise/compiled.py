"""The layerwise engine in one traceable pass, for ``torch.compile``: forward, per-example norms and clipped sum in
one graph.

:class:`~opake_torch.layerwise.LayerwiseGradients` forms each layer's gradients inside the backward, from hooks that
the backward calls (tensor hooks and taps on a scalar anchor), and registers its module hooks for the duration of
each call. Dynamo can trace neither: compiled, that pass splits into dozens of graphs, one per hook, and its
backward runs eagerly. :class:`CompiledLayerwise` computes the same quantities in a form that traces whole:

* module forward hooks, registered **outside** the compiled region (:meth:`CompiledLayerwise.around`, entered by
  the compile wrapper around every call), note each supported layer's input and output;
* one ``torch.autograd.grad`` of the summed losses with respect to those outputs gives every layer's output gradient
  (traced by Dynamo with ``torch._dynamo.config.trace_autograd_ops``; the trainable parameters are leaves that require
  gradients, so every tapped output does, and no parameter gradient is formed);
* from inputs and output gradients, the per-layer arithmetic of the layerwise engine (the functions of
  :mod:`~opake_torch.layerwise.dense` and :mod:`~opake_torch.layerwise.ghost`, unchanged): instantiated gradients
  where they are small, ghost norms and the book-keeping sum where they are cheaper, the same choice (the engine's
  ``ghost_advantage``).

So the released clipped sum equals the layerwise engine's up to float rounding (kernels and summation orders of the
compiled graph). Two differences of cost: every output gradient is formed before any norm (the hook engine forms each
layer's gradients as the backward passes it and frees them), and the Gram matrices and scaled inputs shared by the
layers that read one tensor (q, k and v) are shared by the compiler's common-subexpression elimination instead of a
cache. The float32 ghost sums run at the run's matmul precision with the layerwise engine's margin in the norms
(:func:`~opake_torch.layerwise.precision.product_error`), read when each call starts.

Served: linear, Conv1D, embedding and normalization layers (:data:`KINDS`), without activation checkpointing (which
``torch_compile`` refuses), one row per example; a model with other layer kinds (experts, routers, attention sinks,
convolutions), or an engine of grouped examples (``LayerwiseGradients(..., grouped=True)``), keeps the hook engine
(:func:`unserved`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from torch import nn

from opake_core.clipping.rules import accumulation_dtype
from opake_core.errors import ConfigurationError
from opake_torch.layerwise.calls import Call, by_example, cast
from opake_torch.layerwise.dense import add_dense
from opake_torch.layerwise.engine import LayerwiseGradients
from opake_torch.layerwise.ghost import add_ghost, finished, ghost_names, ghost_norms, gram, tied_names, tied_norms
from opake_torch.layerwise.gradients import Gradients
from opake_torch.layerwise.precision import float32_matmuls, input_factor, matmul_precision, product_error

__all__ = ["GROUPED", "KINDS", "MIN_TORCH", "CompiledLayerwise", "torch_supported", "unserved"]

MIN_TORCH = "2.11"
"""The oldest torch release whose Dynamo traces the pass: 2.11 added ``trace_autograd_ops`` (2.10 fails on it).
Verified under 2.11 on an H100 (the CUDA tests: a Llama LoRA model compiled by inductor against the hook engine;
BERT-base in one graph) and on CPU (the tests of ``tests/torch/transformers/test_compile.py``; under 2.11 the CPU
inductor emits C++ that does not compile for GPT-2 and Llama's causal masks, and those chunks warn and run
eagerly), and under 2.13 by the CPU tests."""


def torch_supported() -> bool:
    """Whether the running torch is :data:`MIN_TORCH` or newer."""
    return torch.__version__ >= MIN_TORCH


KINDS = ("linear", "conv1d", "embedding", "layer_norm", "rms_norm", "llama_rms_norm", "gpt_oss_rms_norm")
"""The layer kinds of :mod:`opake_torch.layerwise` that the traced pass serves."""


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


GROUPED = "grouped examples"
"""What :func:`unserved` names for an engine of grouped examples (their rows are not the traced pass's batch)."""


def unserved(layerwise_gradients: LayerwiseGradients) -> list[str]:
    """The kinds of the model's trainable layers that the traced pass does not serve, and :data:`GROUPED` for an
    engine of grouped examples (empty: it serves the engine)."""
    layers = layerwise_gradients.layers(_trainable(layerwise_gradients.model))
    kinds = sorted({kind for kind, _ in layers.values() if kind not in KINDS})
    return [*kinds, GROUPED] if layerwise_gradients.grouped else kinds


@dataclass
class _Recording:
    """What the hooks note during one traced pass: the layers of its parameters, and each call with its output."""

    layers: dict[nn.Module, tuple[str, dict[str, str]]]
    m: int
    calls: list[Call] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _TracedGradients:
    """One chunk's per-example gradients (the :class:`~opake_core.clipping.engine.PerExampleGradients` protocol):
    ``dense`` holds the instantiated ones ``[m, *shape]`` in the accumulation dtype, ``ghost`` the calls whose norms
    and sums come from their input and output gradient, ``tied`` the embedding calls of the ghost weights tied to one
    (:func:`~opake_torch.layerwise.ghost.tied_norms`)."""

    names: list[str]
    m: int
    dense: dict[str, torch.Tensor]
    ghost: dict[str, Call]
    error: float  # the relative error of a float32 ghost sum's products (precision.product_error)
    device: torch.device
    tied: dict[str, Call] = field(default_factory=dict)

    def squared_norms(self) -> torch.Tensor:
        zeros = torch.zeros(self.m, dtype=torch.float64, device=self.device)
        rows = []
        for name in self.names:
            if name in self.dense:
                g = self.dense[name].reshape(self.m, -1)
                rows.append(torch.linalg.vector_norm(g, dim=1, dtype=torch.float64).square())
            elif name in self.ghost:
                rows.append(self._ghost_norms(name, zeros))
            else:  # the loss does not depend on this parameter
                rows.append(zeros)
        return torch.stack(rows)

    def _ghost_norms(self, name: str, zeros: torch.Tensor) -> torch.Tensor:
        """float64 ``[m]`` squared norms of a ghost weight: its call's, or a tied weight's two calls' (zeros for a
        call the loss does not depend on)."""
        head, embedding = self.ghost[name], self.tied.get(name)
        norms = zeros if head.grad is None else ghost_norms(head, self.m, self._input_gram, error=self.error)
        if embedding is None or embedding.grad is None:
            return finished(norms)
        return tied_norms(head, norms, embedding, ghost_norms(embedding, self.m, self._input_gram), self.m)

    def _input_gram(self, call: Call) -> torch.Tensor:
        return gram(input_factor(call, self.m))

    def _scaled_input(self, call: Call, scale: torch.Tensor, drop: torch.Tensor, dtype: torch.dtype) -> Any:
        return torch.where(drop, 0.0, cast(by_example(call.inputs, self.m), dtype) * scale)

    def add_scaled(self, scales: dict[torch.dtype, torch.Tensor], sums: list[torch.Tensor]) -> None:
        for k, name in enumerate(self.names):
            total = sums[k]
            scale = scales[total.dtype][k]
            if name in self.dense:
                g = self.dense[name]
                g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) * scale.reshape(-1, *[1] * (g.dim() - 1))
                total.add_(g.sum(dim=0))
            elif name in self.ghost:
                scale = scale.reshape(self.m, 1, 1)
                for call in (self.ghost[name], self.tied.get(name)):  # a tied weight: both calls' parts
                    if call is not None and call.grad is not None:
                        add_ghost(call, scale, scale == 0, total, self._scaled_input)


class CompiledLayerwise:
    """The ``gradients`` of an :class:`opake_core.clipping.Engine` whose chunk is compiled whole: the per-example
    gradients of :class:`~opake_torch.layerwise.LayerwiseGradients` (the same model, loss and layer arithmetic) from
    one forward and one ``torch.autograd.grad``, in code Dynamo traces into one graph.

    Every call must run inside :meth:`around` (the compile wrapper enters it around the compiled function, which
    cannot register hooks itself); a call outside raises ConfigurationError.
    """

    def __init__(self, layerwise_gradients: LayerwiseGradients) -> None:
        if not torch_supported():
            raise ConfigurationError(
                f"the compiled layerwise pass needs torch {MIN_TORCH} or newer, this is {torch.__version__}; run "
                "with torch_compile=False or upgrade torch."
            )
        kinds = unserved(layerwise_gradients)
        if kinds:
            raise ConfigurationError(
                f"the compiled layerwise pass serves the layer kinds {KINDS} with one row per example, not {kinds}; "
                "run this model with torch_compile=False."
            )
        self.layerwise = layerwise_gradients
        self._recording: _Recording | None = None
        self._error = 0.0
        self._hooked = False

    @contextlib.contextmanager
    def around(self, call_args: Sequence[Any]) -> Iterator[None]:
        """What one call of the compiled chunk ``chunk(rule, bounds, live, params, *batch)`` (``call_args``) needs
        from outside the traced code: forward hooks on the model's supported layers for the duration of the call,
        the matmul settings of the layerwise engine's sums (bf16 products reduced in float32), the parameters
        ``params`` marked as requiring gradients (put back after the call), and the batch's rows
        and positions (dimensions 0 and 1 of its tensors, 0 of ``live``) marked dynamic, so that the first
        compilation serves every chunk of two rows or more (Dynamo specializes a size of 1: the trainer's engine runs a
        chunk of one row with a dead row, ``Engine.min_rows``)."""
        for x in optree.tree_leaves((call_args[2], call_args[4:])):
            if isinstance(x, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(x, list(range(min(x.dim(), 2))))
        model = self.layerwise.model
        self.layerwise.refresh()  # a layer switched to training mode since: check again
        layers = self.layerwise.layers(_trainable(model))
        device = next(model.parameters()).device
        self._error = product_error(matmul_precision(device))
        # the parameters enter the graph as leaves that require gradients: Dynamo before torch 2.13 cannot trace
        # requires_grad_ on a tensor made inside the graph
        marked = [x for x in optree.tree_leaves(call_args[3]) if isinstance(x, torch.Tensor) and not x.requires_grad]
        handles = [module.register_forward_hook(self._forward_hook) for module in layers]
        self._hooked = True
        try:
            for x in marked:
                x.requires_grad_(True)
            with float32_matmuls(device, highest=False):
                yield
        finally:
            self._hooked = False
            self._recording = None
            for x in marked:
                x.requires_grad_(False)
            for handle in handles:
                handle.remove()

    def _forward_hook(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        recording = self._recording
        if recording is None or module not in recording.layers:
            return None
        kind, attrs = recording.layers[module]
        m = recording.m
        x = inputs[0]
        # as the hook engine reads a layer's input: tokens flattened to rows [m * T, d] are example-major
        rows = kind != "embedding" and x.dim() == 2 and x.shape[0] % m == 0
        lead = m if rows else x.shape[0]
        positions = x.numel() // max(1, lead * (1 if kind == "embedding" else x.shape[-1]))
        if kind == "embedding" and x.shape[0] == 1 and m > 1:  # positions shared by the batch: one per example
            x, output = x.expand(m, *x.shape[1:]), output.expand(m, *output.shape[1:])
        if not rows and x.shape[0] != m:
            raise ConfigurationError(
                f"a {type(module).__name__} layer runs on a tensor of leading size {x.shape[0]}, not the batch of "
                f"{m}: its per-example gradients cannot be separated. Use vmap(grad) for this model."
            )
        recording.calls.append(Call(kind, module, attrs, x.detach(), positions))
        recording.outputs.append(output)
        # the model continues with a copy: an in-place change of it (y.mul_(s)) leaves the output whose gradient is
        # taken as the layer returned it (the copy did not move the compiled step's time measurably)
        return output.clone()

    def __call__(
        self, example_grad: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]
    ) -> tuple[_TracedGradients, Any]:
        """The chunk's gradients and losses ``[m]`` (or ``(losses, aux)``) from ``batch_loss(*args)``;
        ``example_grad`` is not needed."""
        if not self._hooked:
            raise ConfigurationError("CompiledLayerwise runs inside its around() context (the compile wrapper's).")
        params, batch = args[0], tuple(args[1:])
        layers = self.layerwise.layers(params)
        sizes = [x.shape[0] for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim()]
        if not sizes or any(size != sizes[0] for size in sizes):  # a list: a set would hash, and fix, the sizes
            raise ConfigurationError(f"batched tensors need one leading batch dimension, got sizes {sizes}.")
        m = sizes[0]
        recording = self._recording = _Recording(layers, m)
        with torch.enable_grad():  # clipped_grad runs under no_grad
            leaves = {k: v if v.requires_grad else v.detach().requires_grad_() for k, v in params.items()}
            result = self.layerwise.batch_loss(leaves, *batch)
            self._recording = None
            losses, aux = result if isinstance(result, tuple) else (result, None)
            if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.shape[0] != m:
                raise ConfigurationError(f"batch_loss must return per-example losses [{m}], got {losses!r:.80}.")
            grads = torch.autograd.grad(losses.sum(), recording.outputs, allow_unused=True)
        first = next(iter(params.values()))
        names = [path[0] for path in optree.tree_paths(params)]  # the leaf order of the clipped sums
        out = _TracedGradients(names, m, {}, {}, self._error, first.device)
        shapes = {k: v.shape for k, v in params.items()}
        dtypes = {k: accumulation_dtype(v.dtype) for k, v in params.items()}
        for call, grad in zip(recording.calls, grads, strict=True):
            call.grad = None if grad is None else grad.detach()
        meta = Gradients(out.names, shapes, dtypes, m, first.device)
        advantage = self.layerwise.ghost_advantage
        out.ghost = {name: call for name, (call, _) in ghost_names(recording.calls, meta, advantage).items()}
        tied = tied_names(recording.calls, meta, advantage)
        out.ghost.update({name: head for name, (head, _) in tied.items()})
        out.tied = {name: embedding for name, (_, embedding) in tied.items()}
        for call in recording.calls:
            for attr, name in call.names.items():
                if name in out.ghost or call.grad is None:
                    continue
                first_use = name not in out.dense
                if first_use:
                    out.dense[name] = torch.zeros(m, *shapes[name], dtype=dtypes[name], device=first.device)
                add_dense(call, attr, out.dense[name], first=first_use)
        values = losses.detach()
        return out, values if aux is None else (values, optree.tree_map(torch.Tensor.detach, aux))
