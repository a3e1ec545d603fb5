"""The hooks of one chunk's batched pass: they record every call of a served layer in the forward and hand each one
its output gradient inside the backward, where its per-example gradients are formed at once.

The output gradients come from a tensor hook on the layer's output or, for the first layers, whose outputs need no
gradient yet, from a tap (:class:`_Tap`) that links them to a scalar anchor: the backward runs to the anchor and forms
no parameter gradient. A call keeps its input as the layer's weight gradient reads it: rounded to bf16 where the
layer ran in bfloat16 (:class:`~opake_torch.layerwise.precision.Bf16Inputs`). The hooks exist for the duration of
one pass (:meth:`ChunkPass.install`, :meth:`ChunkPass.remove`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from opake_core.errors import ConfigurationError
from opake_torch.layerwise.calls import Call, same_tensor
from opake_torch.layerwise.dense import add_dense
from opake_torch.layerwise.experts import Routing, replace_forward, tapped_experts_forward
from opake_torch.layerwise.ghost import InputGrams, ghost_norms, one_pass_sum
from opake_torch.layerwise.gradients import Gradients
from opake_torch.layerwise.precision import Bf16Inputs
from opake_torch.layerwise.uses import DEPTHWISE, ELEMENTWISE, ParameterUses, Watched

__all__ = ["ChunkPass"]


class _Tap(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the output gradient to ``record``.

    It also links the output to ``anchor`` (a scalar leaf), so that a backward to the anchor reaches every tapped
    layer and nothing else: no parameter gradient is ever formed. The output is a copy, not a view: autograd refuses
    an in-place operation on a view that a custom function returns (``F.relu(linear(x), inplace=True)``), and on a
    copy the backward hands ``record`` the gradient of the value before that operation, the layer's own output.
    Only the outputs that need no gradient yet are tapped (the first layers; with ``hooks_suffice`` the others take
    a tensor hook), so the copy costs one pass over those outputs.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, anchor: torch.Tensor, record: Callable[[torch.Tensor], None]) -> Any:
        ctx.record = record
        ctx.anchor = (anchor.dtype, anchor.device)
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        ctx.record(grad)
        dtype, device = ctx.anchor
        return grad, torch.zeros((), dtype=dtype, device=device), None


def _hook_output(output: torch.Tensor, record: Callable[[torch.Tensor], None]) -> bool:
    """Hand ``record`` the gradient of ``output`` as the layer returned it, even where the model then changes it in
    place; False where only a tap can (a view of part of a tensor).

    A tensor hook registered before an in-place operation receives the gradient of the value before it, except on
    a view, whose hooks the operation drops (a linear layer with a bias on ``[m, T, d]`` returns a view of its
    ``[m T, out]`` product). A view of a whole tensor takes a hook on the autograd node of that tensor instead: the
    in-place operation leaves that node in the graph, and the gradient it receives is the output's, reshaped.
    """
    if not output._is_view():
        output.register_hook(record)
        return True
    base = output._base
    whole = base.numel() == output.numel() and output.is_contiguous() and base.is_contiguous()
    if base.grad_fn is None or not whole or output.storage_offset() != base.storage_offset():
        return False
    shape, index = output.shape, base.output_nr  # not the output itself: the node would keep it alive

    def prehook(grads: tuple[torch.Tensor | None, ...]) -> None:
        grad = grads[index]
        if grad is not None:
            record(grad if grad.shape == shape else grad.view(shape))  # (a view is a host operation per call)

    base.grad_fn.register_prehook(prehook)
    return True


class _BroadcastTap(torch.overrides.TorchFunctionMode):
    """Active during one call of an attention layer with sinks: the expansion of its ``sinks`` parameter over the
    batch (``sinks.reshape(1, -1, 1, 1).expand(m, -1, T, -1)`` in Hugging Face's eager attention, the only place it
    is used) goes through ``on_expand``, which taps it; the tap's gradient ``[R, H, T, 1]`` (``R`` rows: the
    batch, or its examples' rows) summed over the positions and an example's rows is each example's gradient of the
    sinks. ``tapped`` says whether that expansion happened (other attention implementations use the sinks otherwise,
    and are refused)."""

    def __init__(self, param: torch.Tensor, rows: int, on_expand: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.seen, self.rows, self.on_expand, self.tapped = [param], rows, on_expand, False

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not args or not any(args[0] is seen for seen in self.seen):
            return out
        if func is torch.Tensor.expand and out.dim() and out.shape[0] == self.rows:
            self.tapped = True
            return self.on_expand(out)
        if func in (torch.Tensor.reshape, torch.Tensor.view):
            self.seen.append(out)
        return out


class ChunkPass:
    """The hooks of one chunk's pass on the served layers.

    Args:
        layers: ``{layer: (kind, {attribute: trainable name})}``, the served layers of the model.
        out: the chunk's gradients, filled inside the backward (``out.ghost`` names the weights that take ghost
            norms: set before the backward starts).
        anchor: the scalar leaf the taps link to, and that the backward runs to.
        hooks_suffice: nothing outside the taps needs a gradient, so a layer output that requires one is downstream
            of a tap and a tensor hook on it suffices (cheaper than another tap).
        rows: the rows the model runs on, ``R``: ``out.m``, or ``out.m * k`` for grouped examples of ``k`` rows
            each (example ``i`` owns rows ``i k ... i k + k - 1``); a layer must see them in dimension 0 (or, as
            flattened tokens, a multiple of them), and its per-example quantities fold an example's rows together
            (``[R, T, d]`` read as ``[m, k T, d]``: :func:`~opake_torch.layerwise.calls.by_example`).

    ``calls`` lists the layer calls in the forward's order (a checkpointed layer's forward, which keeps nothing,
    notes its call; its recompute in the backward is tapped like the others).
    """

    def __init__(
        self,
        layers: dict[nn.Module, tuple[str, dict[str, str]]],
        out: Gradients,
        anchor: torch.Tensor,
        *,
        hooks_suffice: bool,
        rows: int,
    ) -> None:
        self.layers, self.out, self.anchor, self.hooks_suffice = layers, out, anchor, hooks_suffice
        self.rows = rows
        self.slots = rows // max(1, out.m)  # k: the rows of one example
        self.calls: list[Call] = []
        self.written: set[str] = set()  # instantiated names the backward has written (their buffers held zeros)
        self.grams = InputGrams(out.m)
        self.bf16 = Bf16Inputs()
        self.modes: list[_BroadcastTap | ParameterUses] = []  # the taps of the attention and scope calls in progress
        self.scopes: dict[nn.Module, list[Watched]] = {}  # the modules during whose calls parameters are followed
        self.handles: list[Any] = []

    def install(self, model: nn.Module) -> None:
        """Register the hooks on ``model``'s served layers (and the scopes whose parameter uses are followed)."""
        if any(kind in (ELEMENTWISE, DEPTHWISE) for kind, _ in self.layers.values()):
            parents = {child: parent for parent in model.modules() for child in parent.children()}
            for module, (kind, attrs) in self.layers.items():
                if kind in (ELEMENTWISE, DEPTHWISE):
                    scope = module if kind == ELEMENTWISE else parents.get(module, module)
                    watched = (Watched(module, a, name, kind) for a, name in attrs.items())
                    self.scopes.setdefault(scope, []).extend(watched)
        handles = self.handles
        for scope in self.scopes:
            handles.append(scope.register_forward_pre_hook(self.enter_uses))
            handles.append(scope.register_forward_hook(self.leave_uses))
        for module, (kind, _) in self.layers.items():
            if kind == DEPTHWISE:
                handles.append(module.register_forward_pre_hook(self.guard_conv))
            if kind in (ELEMENTWISE, DEPTHWISE):
                continue
            if kind == "attention_sinks":
                handles.append(module.register_forward_pre_hook(self.enter_sinks))
                handles.append(module.register_forward_hook(self.leave_sinks))
                continue
            if kind == "experts":
                forward = functools.partial(tapped_experts_forward, examples=self.out.m)
                handles.append(replace_forward(module, forward, self.tap_experts))
                continue
            if kind == "router":
                handles.append(module.register_forward_pre_hook(self.link_router_input))
            handles.append(module.register_forward_hook(self.forward_hook))

    def remove(self) -> None:
        """Remove the hooks (and leave the taps a forward that raised left active)."""
        while self.modes:
            self.modes.pop().__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()

    def record(self, call: Call, grad: torch.Tensor) -> None:
        """Runs inside the backward: instantiated gradients are formed at once and the layer's tensors freed."""
        out = self.out
        if call.version is not None and call.inputs._version != call.version:
            # the layer's weight gradient reads the input it ran on; autograd does not see the change, since the
            # engine's parameters need no gradient, so the per-example gradients would silently be wrong
            raise ConfigurationError(
                f"the input of a {type(call.module).__name__} layer was modified in place after the layer ran (an "
                "in-place operation on a tensor a served layer reads, such as x.mul_() after linear(x)): its "
                "per-example gradients would be formed from the modified values. Use the out-of-place operation "
                "(x = x * ...) or vmap(grad) for this model."
            )
        self.bf16.release()  # the backward has begun: the forward's calls hold what they keep
        call.grad = grad.detach() if grad.requires_grad else grad  # (a detach is a host operation per call)
        for attr, name in call.names.items():
            if name in out.tied and call.kind == "embedding":  # a tied weight's other part (Gradients.squared_norms)
                out.tied[name] = (call, ghost_norms(call, out.m, self.grams))
            elif name in out.ghost:
                error = out.product_error if out.dtypes[name] == torch.float32 else 0.0
                if one_pass := one_pass_sum(call, out.dtypes[name]):
                    out.one_pass.add(name)  # the sum may take one pass: these norms carry its margin
                norms = ghost_norms(
                    call, out.m, self.grams, error=error, route=out.norm_route, one_pass=one_pass, defer=True
                )
                out.ghost[name] = (call, norms)  # a Bound is finished with the chunk's others (Gradients.squared_norms)
            else:
                add_dense(call, attr, out.block(name), first=name not in self.written)
                self.written.add(name)
        if call.input_key is not None:
            self.grams.done(call)
        if not any(name in out.ghost for name in call.names.values()):
            call.inputs = call.grad = None

    def forward_hook(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        m, rows = self.out.m, self.rows
        kind, attrs = self.layers[module]
        if kind == "router":  # flattened tokens [R * T, d] in, (logits, scores, experts) out
            return self.router_hook(module, attrs, inputs[0], output[0])
        x = inputs[0]  # detached where kept (Bf16Inputs.keep), not before: a detach is a host operation per call
        # tokens flattened to rows [R * T, d], example-major (MoE blocks' shared experts, the gated norm's heads)
        flat = kind != "embedding" and x.dim() == 2 and x.shape[0] % rows == 0
        width = 1 if kind == "embedding" else x.shape[-1]
        if flat:
            positions = x.numel() // max(1, m * width)
        else:  # [R, T, ...] or positions shared by the rows [1, T]: an example's k rows of T positions each
            positions = x.numel() // max(1, x.shape[0] * width) * self.slots
        if not torch.is_grad_enabled():  # a checkpointed layer's forward: its recompute is tapped
            self.calls.append(Call(kind, module, attrs, None, positions))
            return None
        if kind == "embedding" and x.shape[0] == 1 and rows > 1:  # positions shared by the batch: one per row
            x, output = x.expand(rows, *x.shape[1:]), output.expand(rows, *output.shape[1:])
        if (not flat and x.shape[0] != rows) or (kind == "gated_rms_norm" and len(inputs) != 2):
            raise ConfigurationError(
                f"a {type(module).__name__} layer runs on a tensor of leading size {x.shape[0]}, not the batch of "
                f"{rows}: its per-example gradients cannot be separated. Use vmap(grad) for this model."
            )
        gate = inputs[1].detach() if kind == "gated_rms_norm" else None
        kept = x.detach() if kind == "embedding" else self.bf16.keep(kind, inputs[0], output)
        return self.tap(Call(kind, module, attrs, kept, positions, gate=gate), output)

    def register(self, call: Call) -> None:
        self.calls.append(call)
        call.version = None if call.inputs is None else call.inputs._version
        if call.kind not in ("embedding", "experts"):
            call.input_key = same_tensor(call.inputs)
            self.grams.read_by(call)

    def tap(self, call: Call, output: torch.Tensor) -> torch.Tensor | None:
        """Record ``call`` and hand it its output's gradient in the backward (None: the output is unchanged)."""
        self.register(call)
        record = functools.partial(self.record, call)
        if self.hooks_suffice and output.requires_grad and _hook_output(output, record):
            return None
        return _Tap.apply(output, self.anchor, record)

    def router_hook(self, module: nn.Module, attrs: dict[str, str], x: torch.Tensor, logits: torch.Tensor) -> None:
        """A router's logits are ``F.linear`` of its input, and its scores are computed from that very tensor: a
        tensor hook on it sees the whole gradient (:meth:`link_router_input` made it require one)."""
        positions = x.shape[0] // max(1, self.out.m)
        if not torch.is_grad_enabled():
            self.calls.append(Call("linear", module, attrs, None, positions))
            return None
        if x.shape[0] % self.rows or not logits.requires_grad:
            raise ConfigurationError(
                f"a {type(module).__name__} router runs on {x.shape[0]} rows, not a multiple of the batch of "
                f"{self.rows}: its per-example gradients cannot be separated. Use vmap(grad) for this model."
            )
        call = Call("linear", module, attrs, self.bf16.keep("linear", x, logits), positions)
        self.register(call)
        logits.register_hook(lambda grad: self.record(call, grad))
        return None

    def link_router_input(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0]
        if not torch.is_grad_enabled() or x.requires_grad:
            return None
        return (_Tap.apply(x, self.anchor, lambda grad: None), *args[1:])

    def tap_experts(self, module: nn.Module, attr: str, x: torch.Tensor, routing: Routing, y: torch.Tensor) -> Any:
        """One projection of an experts layer (``attr``: its weight): rows ``x`` ``[R * T, in]`` routed as
        ``routing`` says, output ``y``; returns the output the layer continues with."""
        attrs = self.layers[module][1]
        names = {k: attrs[a] for k, a in (("weight", attr), ("bias", f"{attr}_bias")) if a in attrs}
        if not names:
            return y
        positions = x.shape[0] // max(1, self.out.m)
        if not torch.is_grad_enabled():
            self.calls.append(Call("experts", module, names, None, positions))
            return y
        if x.shape[0] % self.rows:
            raise ConfigurationError(
                f"a {type(module).__name__} layer runs on {x.shape[0]} rows, not a multiple of the batch of "
                f"{self.rows}: its per-example gradients cannot be separated. Use vmap(grad) for this model."
            )
        call = Call("experts", module, names, self.bf16.keep("experts", x, y), positions, routing=routing,
                    transposed=bool(module.is_transposed))  # fmt: skip
        tapped = self.tap(call, y)
        return y if tapped is None else tapped

    def enter_sinks(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        attrs = self.layers[module][1]

        def on_expand(expanded: torch.Tensor) -> torch.Tensor:
            call = Call("attention_sinks", module, attrs, None, expanded.shape[2])
            self.calls.append(call)
            if not torch.is_grad_enabled():  # a checkpointed layer's forward: its recompute is tapped
                return expanded
            return _Tap.apply(expanded, self.anchor, lambda grad: self.record(call, grad))

        self.modes.append(_BroadcastTap(module.sinks, self.rows, on_expand))
        self.modes[-1].__enter__()

    def leave_sinks(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        mode = self.modes.pop()
        mode.__exit__(None, None, None)
        if not mode.tapped:
            raise ConfigurationError(
                f"the attention sinks of {type(module).__name__} are served with eager attention only (the "
                "sinks expanded over the batch); this attention implementation uses them otherwise. Set "
                "attn_implementation='eager', freeze the sinks, or use vmap(grad) for this model."
            )

    def on_use(self, kind: str, module: nn.Module, names: dict[str, str], value: torch.Tensor, x: Any) -> torch.Tensor:
        """One use of parameters followed by :class:`ParameterUses`: ``value`` tapped (``x``: a conv's input)."""
        grad = torch.is_grad_enabled()  # else a checkpointed layer's forward: its recompute is tapped
        kept = self.bf16.keep(kind, x, value) if grad and x is not None else None
        call = Call(kind, module, names, kept, 1 if x is None else x.shape[-1])
        self.calls.append(call)
        return _Tap.apply(value, self.anchor, lambda g: self.record(call, g)) if grad else value

    def enter_uses(self, scope: nn.Module, args: tuple[Any, ...]) -> None:
        watched = [(w, getattr(w.module, w.attr)) for w in self.scopes[scope]]  # as reparametrized for this call
        self.modes.append(ParameterUses(watched, self.rows, self.on_use))
        self.modes[-1].__enter__()

    def leave_uses(self, scope: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        mode = self.modes.pop()
        mode.__exit__(None, None, None)
        mode.finish(scope)

    def guard_conv(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not any(isinstance(mode, ParameterUses) and mode.watches(module) for mode in self.modes):
            raise ConfigurationError(
                f"a depthwise {type(module).__name__} runs outside the call of the module that holds it (its "
                "weight is followed during that call): its per-example gradients cannot be formed. Use "
                "vmap(grad) for this model."
            )
