"""Per-example gradients of parameters that a layer uses in its own code, for :mod:`opake_torch.layerwise`.

The gated delta-net of Qwen3-Next and Qwen3.5-MoE (Hugging Face's ``*GatedDeltaNet``) uses three parameters outside
a layer's stock ``forward``, where no forward hook sees them:

* ``A_log`` and ``dt_bias`` (``[H]``, one per value head), in ``g = -A_log.float().exp() * softplus(a.float() +
  dt_bias)`` with ``a`` ``[m, T, H]``: **elementwise** parameters, combined with the batch by broadcasting;
* the weight of its depthwise causal ``nn.Conv1d`` (``[C, 1, K]``), whose ``forward`` is never called: the layer
  passes ``conv1d.weight`` to ``F.conv1d`` itself (``causal_conv1d_fn``, padding ``K - 1``, ``C`` groups).

:class:`ParameterUses` is a ``TorchFunctionMode`` active during one call of the layer that uses them (the *scope*:
the delta-net itself for ``A_log`` and ``dt_bias``, the conv's parent for the conv). It follows each watched
parameter through the operations the layer applies to it alone (``.float()``, ``.exp()``, negation: elementwise and
shape-preserving; views for the conv weight) and taps it where it meets the batch:

* at an elementwise operation with a batched operand (``[m, ...]``), the parameter ``p`` is replaced by
  ``p.expand(m, 1, ..., 1, *p.shape)`` (the same values, so the operation's result is unchanged), tapped, and
  passed again through the operations it went through alone; the tap's gradient ``[m, 1, ..., *p.shape]`` is each
  example's gradient of ``p``, formed by the same operations as a single-record backward;
* at ``F.conv1d`` with the watched weight (stride 1, dilation 1, one group per channel, input ``[m, C, T]``), the
  output is tapped; the example's weight gradient is then ``G_i[c, 0, k] = sum_l g_i[c, l] xpad_i[c, l + k]``
  (:func:`add_conv_gradient`) from the zero-padded input ``xpad`` and the output gradient, instantiated: ``C K``
  numbers per example (ghost norms would keep ``T x T`` Gram matrices per channel).

Any other operation on a watched parameter, or a call of the scope in which a watched parameter never met the batch
(an optional CUDA kernel, such as causal-conv1d's, that takes the weight out of sight), is refused by
:meth:`ParameterUses.finish` (ConfigurationError): a parameter whose use the mode cannot see would otherwise get a
zero gradient. While a scope runs, :func:`opake_torch.patches.compat.reference_kernels` makes Hugging Face take its
torch reference path instead of those kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opake_core.errors import ConfigurationError
from opake_torch.patches.compat import reference_kernels

__all__ = ["DEPTHWISE", "ELEMENTWISE", "ParameterUses", "Watched", "add_conv_gradient", "uses_kind"]

ELEMENTWISE = "elementwise"
DEPTHWISE = "depthwise_conv1d"

_T = torch.Tensor
_ALONE = {  # elementwise operations a watched parameter may go through before it meets the batch
    _T.float, _T.double, _T.to, _T.type_as, _T.exp, torch.exp, _T.neg, _T.__neg__, torch.neg, _T.sigmoid,
    torch.sigmoid, _T.log, torch.log, F.softplus,
}  # fmt: skip
_WITH_BATCH = {  # elementwise operations where it may meet the batch, by broadcasting
    _T.__add__, _T.__radd__, _T.add, torch.add, _T.__sub__, _T.__rsub__, _T.sub, torch.sub, _T.__mul__,
    _T.__rmul__, _T.mul, torch.mul, _T.__truediv__, _T.__rtruediv__, _T.div, torch.div,
}  # fmt: skip
_ELEMENTWISE_OPS = _ALONE | _WITH_BATCH
_VIEWS = {_T.squeeze, torch.squeeze, _T.unsqueeze, torch.unsqueeze, _T.view, _T.reshape, torch.reshape}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def uses_kind(module: nn.Module) -> str | None:
    """:data:`ELEMENTWISE` for a Hugging Face gated delta-net whose own parameters are ``A_log`` and ``dt_bias``;
    :data:`DEPTHWISE` for an ``nn.Conv1d`` with one group per channel, stride 1, dilation 1 and zero padding
    (its weight is tapped where it meets ``F.conv1d`` during its parent's call, whoever calls it); else None."""
    if isinstance(module, nn.Conv1d):
        depthwise = module.groups == module.in_channels == module.out_channels
        plain = module.stride == (1,) and module.dilation == (1,) and module.padding_mode == "zeros"
        stock = type(module).forward is nn.Conv1d.forward and isinstance(module.padding, tuple)
        return DEPTHWISE if depthwise and plain and stock else None
    own = set(module._parameters)
    if type(module).__module__.startswith("transformers.") and type(module).__name__.endswith("GatedDeltaNet"):
        return ELEMENTWISE if own and own <= {"A_log", "dt_bias"} else None
    return None


@dataclass(frozen=True)
class Watched:
    """A parameter the mode follows: ``module.<attr>`` (trainable name ``name``), of kind ``kind``."""

    module: nn.Module
    attr: str
    name: str
    kind: str


class ParameterUses(torch.overrides.TorchFunctionMode):
    """Active during one call of a scope (module docstring): taps each watched parameter where it meets the batch.

    Args:
        watched: the parameters, each with the tensor the module holds during this call (under
            ``functional_call`` or a checkpointed recompute, the reparametrized one).
        rows: the rows the model runs on, ``R`` (a batched operand has them in dimension 0): the batch size, or
            ``m k`` for ``m`` grouped examples of ``k`` rows.
        on_use: ``on_use(kind, module, names, value, inputs) -> value``: records one use (``names``: attribute ->
            trainable name) and returns ``value`` tapped; ``value`` is the expanded parameter (elementwise, with
            ``inputs`` None) or the conv's output (with ``inputs`` its zero-padded input ``[R, C, T + 2p]``).
    """

    def __init__(self, watched: list[tuple[Watched, torch.Tensor]], rows: int, on_use: Callable[..., torch.Tensor]):
        super().__init__()
        self.rows, self.on_use = rows, on_use
        self.params = {w: p for w, p in watched}
        # (tensor, watched, replay): replay(expanded) redoes on the expanded parameter what gave ``tensor`` from it
        self.derived: list[tuple[torch.Tensor, Watched, Callable[[torch.Tensor], torch.Tensor]]] = [
            (p, w, _same) for w, p in watched
        ]
        self.unseen = [w for w, _ in watched]
        self.refused: str | None = None

    def __enter__(self) -> ParameterUses:
        self._kernels = reference_kernels()
        self._kernels.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._kernels.__exit__(None, None, None)

    def watches(self, module: nn.Module) -> bool:
        """Whether a parameter of ``module`` is followed in this call."""
        return any(w.module is module for w in self.params)

    def _entry(self, x: Any) -> tuple[torch.Tensor, Watched, Callable[[torch.Tensor], torch.Tensor]] | None:
        if isinstance(x, torch.Tensor):
            for entry in self.derived:
                if entry[0] is x:
                    return entry
        return None

    def _refuse(self, func: Any, watched: Watched) -> None:
        self.refused = self.refused or f"{getattr(func, '__name__', func)} on {watched.name}"

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        hits = [(k, e) for k, v in [*enumerate(args), *kwargs.items()] if (e := self._entry(v)) is not None]
        if not hits:
            nested = [e for v in args if isinstance(v, list | tuple) for x in v if (e := self._entry(x)) is not None]
            if nested:  # inside a list (torch.cat, ...): not followed
                self._refuse(func, nested[0][1])
            return func(*args, **kwargs)
        watched = hits[0][1][1]
        if func is F.conv1d and watched.kind == DEPTHWISE:
            return self._conv(func, args, kwargs)
        if len(hits) == 1 and watched.kind == ELEMENTWISE and func in _ELEMENTWISE_OPS:
            return self._elementwise(func, args, kwargs, *hits[0])
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):  # shape, dtype, ...
            return out
        if len(hits) == 1 and watched.kind == DEPTHWISE and func in _VIEWS and out.numel() == hits[0][1][0].numel():
            self.derived.append((out, watched, _same))  # the conv weight reshaped: the same numbers in order
        else:
            self._refuse(func, watched)
        return out

    def _elementwise(self, func: Any, args: Any, kwargs: dict, where: int | str, entry: tuple) -> Any:
        """An elementwise operation on ``entry``'s tensor (at ``where``): tapped where it meets the batch, else
        followed."""
        tensor, watched, replay = entry
        others = [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor) and v is not tensor]
        batched = any(v.dim() > tensor.dim() and v.shape[0] == self.rows for v in others)
        if batched and func in _WITH_BATCH:
            rank = len(torch.broadcast_shapes(*(v.shape for v in [tensor, *others])))
            param = self.params[watched]
            expanded = param.expand(self.rows, *[1] * (rank - 1 - param.dim()), *param.shape)
            self.unseen = [w for w in self.unseen if w is not watched]
            value = self.on_use(ELEMENTWISE, watched.module, {watched.attr: watched.name}, expanded, None)
            return _call(func, args, kwargs, where, replay(value))
        out = func(*args, **kwargs)
        if batched or func not in _ALONE or out.shape != tensor.shape:
            self._refuse(func, watched)
        elif out is not tensor:
            self.derived.append((out, watched, lambda x: _call(func, args, kwargs, where, replay(x))))
        return out

    def _conv(self, func: Any, args: Any, kwargs: dict) -> Any:
        """``F.conv1d`` with a watched weight: its output tapped, when it is a depthwise conv of the batch."""
        bound = {**dict(zip(_CONV_ARGS, args, strict=False)), **kwargs}
        weight, bias = self._entry(bound["weight"]), self._entry(bound.get("bias"))
        out = func(*args, **kwargs)
        if (
            weight is None
            or weight[1].attr != "weight"
            or (bias is not None and bias[1].module is not weight[1].module)
        ):
            self._refuse(func, (weight or bias)[1])  # a watched tensor in another role
            return out
        watched, x = weight[1], bound["input"]
        channels = watched.module.in_channels
        padding = _single(bound.get("padding", 0))
        plain = (_single(bound.get("stride", 1)), _single(bound.get("dilation", 1))) == (1, 1)
        shape = tuple(x.shape) if x.dim() == 3 else ()
        if not plain or padding is None or bound.get("groups", 1) != channels or shape[:2] != (self.rows, channels):
            self._refuse(func, watched)
            return out
        names = {"weight": watched.name} | ({"bias": bias[1].name} if bias is not None else {})
        self.unseen = [w for w in self.unseen if w is not watched and (bias is None or w is not bias[1])]
        return self.on_use(DEPTHWISE, watched.module, names, out, F.pad(x.detach(), (padding, padding)))

    def finish(self, scope: nn.Module) -> None:
        """Raise ConfigurationError if an operation on a watched parameter was refused, or one never met the batch
        in this call of ``scope``."""
        problem = self.refused or (f"{self.unseen[0].name} was not seen meeting the batch" if self.unseen else None)
        if problem is not None:
            raise ConfigurationError(
                f"layerwise per-example gradients follow the parameters {type(scope).__name__} uses in its own code "
                f"through elementwise operations and a depthwise F.conv1d only; not: {problem} (an optional kernel "
                "such as causal-conv1d's or a hub kernel uses it out of sight). Freeze it, run without that kernel, "
                "or use vmap(grad) for this model."
            )


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _single(value: Any) -> int | None:
    """An int from an int or 1-tuple argument of ``conv1d``; None for a string padding ('same', 'valid')."""
    if isinstance(value, tuple | list) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, int) else None


def _call(func: Any, args: Any, kwargs: dict, where: int | str, value: torch.Tensor) -> Any:
    """``func`` with the argument at ``where`` (a position or a keyword) replaced by ``value``."""
    if isinstance(where, int):
        args = (*args[:where], value, *args[where + 1 :])
    else:
        kwargs = {**kwargs, where: value}
    return func(*args, **kwargs)


def add_conv_gradient(attr: str, xpad: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, *, first: bool) -> None:
    """``out += `` the per-example gradients of a depthwise conv's ``attr`` (weight ``[m, C, 1, K]`` or bias
    ``[m, C]``, ``out``'s dtype) from its zero-padded input ``xpad`` ``[R, C, T + 2p]`` and output gradient ``grad``
    ``[R, C, L]`` (``L = T + 2p - K + 1``): ``G_i[c, 0, k] = sum_l g_i[c, l] xpad_i[c, l + k]``, summed over the
    ``k = R / m`` rows of example ``i`` (rows ``i k ... i k + k - 1``; ``R = m`` but for grouped examples). Where the
    conv ran in bfloat16 (a bf16 output gradient), the input is rounded to bf16 as the conv's forward rounded it."""
    dtype, m = out.dtype, out.shape[0]
    g = grad.to(dtype)
    if attr == "bias":
        summed = _by_example(g.sum(dim=2), m)
        out.copy_(summed) if first else out.add_(summed)
        return
    if grad.dtype == torch.bfloat16:
        xpad = xpad.to(torch.bfloat16)
    xpad = xpad.to(dtype)
    length, taps = g.shape[2], out.shape[-1]
    weight = torch.stack([(g * xpad[:, :, k : k + length]).sum(dim=2) for k in range(taps)], dim=-1)
    weight = _by_example(weight, m).view(out.shape)
    out.copy_(weight) if first else out.add_(weight)


def _by_example(rows: torch.Tensor, m: int) -> torch.Tensor:
    """``[R, ...]`` per-row gradients summed over each example's ``R / m`` consecutive rows: ``[m, ...]``
    (``rows`` itself where ``R = m``). The padded rows of a row cannot be joined to the next row's positions (the
    taps would reach across them), hence a sum of rows rather than one long row."""
    return rows if rows.shape[0] == m else rows.reshape(m, -1, *rows.shape[1:]).sum(dim=1)
