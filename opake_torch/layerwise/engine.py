"""LayerwiseGradients: the ``gradients`` of an :class:`opake_core.clipping.Engine` from one batched forward and
backward of the model, with the hooks of :mod:`opake_torch.layerwise.hooks` in place for the duration of each chunk.

Clipping itself stays in :mod:`opake_core.clipping.rules`, which takes the squared norms, forms the scales with the
same rule and margin as for materialized gradients and asks for the scaled sum: the two engines release the same
clipped sum up to float rounding. Under activation checkpointing the engine hands its anchor to the checkpointed
layers of its model for the duration of the pass
(:func:`~opake_torch.patches.activation_checkpointing.recompute_linked_to`), so that their recompute in the backward
is tapped like the other layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch import nn

from opake_core.clipping.rules import accumulation_dtype
from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.layerwise.calls import Call
from opake_torch.layerwise.ghost import NORM_ROUTES, ghost_names, tied_names
from opake_torch.layerwise.gradients import Gradients
from opake_torch.layerwise.hooks import ChunkPass
from opake_torch.layerwise.kinds import mixes, owners, unsupported_parameters
from opake_torch.layerwise.precision import matmul_precision, product_error
from opake_torch.patches.activation_checkpointing import recompute_linked_to

__all__ = ["COUPLING_RTOL", "LayerwiseGradients"]

COUPLING_RTOL = 1e-3
"""The largest relative difference of a row's squared norms between the two passes of the coupling check: the
passes run the same kernels on the same shapes, so rows that do not interact agree to rounding (bit for bit on
deterministic kernels); atomics (scatter-adds) may move the last bits."""


def _example_grad(loss_fn: Callable[..., torch.Tensor], params: dict[str, torch.Tensor], example: Any) -> dict:
    """``grad`` of ``loss_fn(params, *example)`` by plain autograd, one example: no ``torch.func`` transform, so the
    model runs the kernels of the batched pass (inside a transform Hugging Face models build an explicit attention
    mask and SDPA takes another kernel; in bf16 that alone moved an 8B model's gradients by about 6%)."""
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    with torch.enable_grad():
        grads = torch.autograd.grad(loss_fn(leaves, *example), list(leaves.values()), allow_unused=True)
    return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads, strict=True)}


def _sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2. Its ranks run their passes in lockstep (each forward gathers the
    shards), so an extra pass on one rank only would hang the others: a sharded model relies on the trainer's
    checks before its run (:mod:`opake_torch.transformers.coupling`) instead of the engine's coupling check."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule  # here: the import costs time, and only sharded runs need it

    return isinstance(model, FSDPModule)


class LayerwiseGradients:
    """Per-example gradients from one batched pass: the ``gradients`` of an :class:`opake_core.clipping.Engine`
    (``Engine(gradients=LayerwiseGradients(model, batch_loss))``).

    Args:
        model: the module whose trainable parameters are differentiated; every one of them must live in a supported
            layer (see :func:`~opake_torch.layerwise.unsupported_parameters`).
        batch_loss: ``batch_loss(params, *batch) -> losses [m]``: the arguments of the ``loss_fn`` given to
            ``clipped_grad`` (the parameters first), batched; it runs ``model`` (through
            ``torch.func.functional_call`` with ``params``) and returns each example's loss, the same per-example
            losses as ``loss_fn``, which is not called. With ``clipped_grad(has_aux=True)`` it returns
            ``(losses [m], aux)``, the per-example auxiliary values stacked ``[m, ...]``.
        ghost_advantage: a weight takes ghost norms when the factors it keeps, ``T (in + out)`` numbers per example,
            times this are fewer than the ``in * out`` of its instantiated gradient (experts: than the
            ``E * in * out`` of all experts); 1 keeps whichever holds less memory. It trades memory for time only
            (the clipped sum is the same either way). By their flops, instantiating is the faster of the two
            wherever it fits: it costs the weight gradient's flops at the matmul rate, where ghost norms add two
            float64 Gram matrices (``T (in + out) / (in out)`` of those flops again) or, by the product route, the
            weight gradient's flops again (``norm_route``), and the book-keeping sum. A larger value instantiates
            the weights near the boundary (GPT-2 small at 512 tokens: its ``c_attn``, ``c_fc`` and MLP ``c_proj``,
            whose factors hold 83% to 89% of their gradients) at the cost of memory, which the instantiated buffers
            take from the start of the backward; the benchmark harness's diagnostic mode ``dp_instantiate``
            measures 1.5.
        grouped: every example is a group of ``k`` rows (user-level privacy: a user's rows, whose summed gradient
            is clipped): every batched tensor is ``[m, k, ...]`` (one ``k`` for all), ``batch_loss`` receives the
            batch as given and returns the ``m`` examples' losses, and the model runs on the ``R = m k`` rows
            flattened example-major (example ``i`` owns rows ``i k ... i k + k - 1``: ``batch_loss`` flattens
            them). Example ``i``'s gradient is the sum over its rows, ``G_i = sum_{r, t} g_rt a_rt^T``: its rows
            taken as one example of ``k T`` positions (ghost norms over the concatenated positions, instantiated
            gradients summed over the rows), never a per-row gradient. ``loss_fn`` (of ``clipped_grad`` and
            :meth:`check`) takes one example's ``[k, ...]`` tensors. A slot an example does not fill must hold one
            of its own rows with loss weight 0, so that no row mixes examples.
        norm_route: how the ghost linear and Conv1D calls take their per-example norms: ``"auto"`` (the default)
            chooses per call, by a cost model of flops at the device's rate for each dtype and memory traffic
            (:func:`~opake_torch.layerwise.ghost.norm_route`), between ``"gram"`` (float64 Gram matrices, ``2 T^2
            (in + out)`` flops per example) and ``"product"`` (the example's gradient formed at the matmul rate for
            its norm and freed, ``2 T in out`` flops, its norm plus a proven rounding margin:
            :func:`~opake_torch.layerwise.ghost.product_norms`); ``"gram"`` or ``"product"`` forces one route
            (diagnostics, tests). Both bound the same norms; the clipped sum is formed the same way.

    With ``grouped``, the norms are ``[L, m]`` and the clipped sum is over the ``m`` examples, as for single rows;
    the coupling check of the first chunk replaces whole examples.
    """

    def __init__(
        self,
        model: nn.Module,
        batch_loss: Callable[..., torch.Tensor],
        *,
        ghost_advantage: float = 1.0,
        grouped: bool = False,
        norm_route: str = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InputTypeError(f"model must be an nn.Module, got {type(model).__name__}.")
        if not ghost_advantage > 0:
            raise ConfigurationError(
                f"ghost_advantage must be a positive number, got {ghost_advantage!r}; 1 keeps whichever of ghost norms "
                "and instantiated gradients holds less memory."
            )
        if norm_route not in NORM_ROUTES:
            raise ConfigurationError(
                f"norm_route must be one of {NORM_ROUTES}, got {norm_route!r}; 'auto' chooses per layer by cost."
            )
        self.model = model
        self.batch_loss = batch_loss
        self.norm_route = norm_route
        self.ghost_advantage = float(ghost_advantage)
        self.grouped = bool(grouped)
        self._layout: tuple[tuple[str, ...], dict[nn.Module, tuple[str, dict[str, str]]]] | None = None
        self._batch_norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._others: list[torch.Tensor] = []  # the model's parameters outside the trainable names
        self._independent: tuple[Any, ...] | None = None  # (names, training) whose coupling check passed

    def refresh(self) -> None:
        """Forget the checked layout when a batch-norm layer switched to training mode since it was checked (it
        then mixes examples): the next :meth:`layers` checks the model again."""
        if any(mixes(module) for module in self._batch_norms):
            self._layout = None

    def layers(self, params: dict[str, torch.Tensor]) -> dict[nn.Module, tuple[str, dict[str, str]]]:
        """``{layer: (kind, {attribute: trainable name})}``, checked and computed once per set of names."""
        names = tuple(sorted(params))
        if self._layout is not None and self._layout[0] == names:
            return self._layout[1]
        reasons = unsupported_parameters(self.model, params)
        if reasons:
            raise ConfigurationError(
                "layerwise per-example gradients serve Linear, Embedding, LayerNorm, RMSNorm and Conv1D layers, "
                "Hugging Face MoE routers and experts and gated delta-nets, in models whose examples do not interact; "
                "not: "
                f"{'; '.join(reasons[:5])}. Use vmap(grad) (the default engine)."
            )
        places, _ = owners(self.model, set(params))
        by_module: dict[nn.Module, tuple[str, dict[str, str]]] = {}
        for name, where in places.items():
            for module, attr, kind in where:
                by_module.setdefault(module, (kind, {}))[1][attr] = name
        self._layout = (names, by_module)
        self._others = [p for name, p in self.model.named_parameters() if name not in params]
        return by_module

    def __call__(
        self, example_grad: Callable[..., Any], args: Sequence[Any], batch_argnums: tuple[int, ...]
    ) -> tuple[Gradients, torch.Tensor]:
        """The chunk's gradients and losses ``[m]`` from ``batch_loss(*args)``; ``example_grad`` is not needed.

        The first chunk of two rows or more for a set of trainable names and a training mode passes
        :meth:`_check_independent` first (one more pass of the chunk), so that a model whose examples interact is
        refused whatever calls the engine."""
        params, batch = args[0], tuple(args[1:])
        with torch.enable_grad():  # clipped_grad runs under no_grad; this engine runs autograd
            checked = (tuple(sorted(params)), self.model.training)
            probe = None
            if checked != self._independent and not _sharded(self.model):
                probe = self._mixed_pass(params, batch, tuple(i - 1 for i in batch_argnums))
            grads, values = self._run(params, batch, instantiate=False)
            if probe is not None:
                self._check_independent(grads.squared_norms(), probe, grads.names)
                self._independent = checked
            return grads, values

    def _mixed_pass(
        self, params: dict[str, torch.Tensor], batch: tuple[Any, ...], batched: tuple[int, ...]
    ) -> torch.Tensor | None:
        """The squared norms ``[L, m]`` of the chunk with its first ``k = m // 2`` rows (grouped: examples, all their
        rows) replaced by copies of the next ``k``; None for a chunk of one row (the check waits for a larger one). The
        rows ``[k, m)`` keep their places, but the rows before them and the batch around them change: whatever a row's
        gradient reads from the other rows of its batch (a mean over the batch, a similarity to the other rows, a
        running sum over the rows) differs from the chunk's pass. The pass draws from the random generators as the
        chunk's pass then does (their state is restored after it), so dropout masks a kept row alike in both, and the
        run's draws are those it makes without the check; the same shapes run the same kernels, so on a model whose
        examples do not interact the two passes agree on the kept rows to rounding."""
        leaves = [x for j in batched for x in optree.tree_leaves(batch[j]) if isinstance(x, torch.Tensor) and x.dim()]
        m = leaves[0].shape[0] if leaves else 0
        if m < 2:
            return None
        k = m // 2
        index = torch.cat([torch.arange(k, 2 * k), torch.arange(k, m)])
        take = lambda x: x[index.to(x.device)] if isinstance(x, torch.Tensor) and x.dim() else x  # noqa: E731
        mixed = tuple(optree.tree_map(take, b) if j in batched else b for j, b in enumerate(batch))
        device = next(iter(params.values())).device
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
            grads, _ = self._run(params, mixed, instantiate=False)
        return grads.squared_norms()  # the pass's tensors go with ``grads``: the chunk's pass runs alone

    @staticmethod
    def _check_independent(squared: torch.Tensor, mixed: torch.Tensor, names: Sequence[str]) -> None:
        """ConfigurationError when a kept row's per-leaf squared norms in the chunk's pass (``squared`` ``[L, m]``,
        leaves ``names``) and in :meth:`_mixed_pass` (``mixed``) differ by more than :data:`COUPLING_RTOL` of its
        squared norm (summed over the leaves); rows with a non-finite norm in either pass are skipped (they add
        nothing to the clipped sum). The message names the leaf whose norms moved most."""
        k = squared.shape[1] // 2
        ours, theirs = squared[:, k:], mixed[:, k:]
        finite = ours.isfinite().all(dim=0) & theirs.isfinite().all(dim=0)
        ours, theirs = ours[:, finite], theirs[:, finite]
        error = (ours - theirs).abs().sum(dim=0) / ours.sum(dim=0).clamp(min=torch.finfo(ours.dtype).tiny)
        if error.numel() and not error.max().item() <= COUPLING_RTOL:
            moved = names[int((ours - theirs).abs().sum(dim=1).argmax())]
            raise ConfigurationError(  # no number: the rows may be private records, and messages reach logs
                "the examples of a batch interact in the model: a row's per-example gradient changes when the other "
                f"rows of its batch change (most in the gradient of {moved!r}: look for a mean or another statistic "
                "over the batch, batch normalization, a comparison with the other rows). Its sensitivity would not be "
                "the clipping bound, and the layerwise engine's norms would be wrong. Compute every example's output "
                "from that example alone, or use vmap(grad), which runs each example on its own."
            )

    def check(
        self, params: dict[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor], *batch: Any, rtol: float = 1e-2
    ) -> float:
        """Compare with ``grad(loss_fn)`` example by example on ``batch`` (a few examples); returns the largest relative
        error.

        ``loss_fn(params, *example)`` is the per-example loss. Raises ConfigurationError, naming the parameter with
        the largest difference, when an example's whole gradient differs by more than ``rtol`` (relative L2 over
        all parameters): a parameter used outside the supported layers, or examples that interact in the batched
        pass. The default tolerance leaves room for bf16 autocast, whose batched and per-example passes round
        differently.
        """
        training = self.model.training
        self.model.eval()  # no dropout: both passes see the same function
        try:
            grads, _ = self._run(params, batch, instantiate=True)
            rows = [_example_grad(loss_fn, params, optree.tree_map(lambda x, i=i: x[i], batch)) for i in range(grads.m)]
            expected = {k: torch.stack([row[k] for row in rows]) for k in grads.names}
        finally:
            self.model.train(training)
        diff_sq = torch.zeros(grads.m, dtype=torch.float64, device=grads.device)
        ref_sq = torch.zeros_like(diff_sq)
        worst_diff, worst_name = -1.0, ""
        for name in grads.names:
            ref = expected[name].detach().to(torch.float64).reshape(grads.m, -1)
            ours = grads.dense[name].to(torch.float64).reshape(grads.m, -1) if name in grads.dense else 0 * ref
            diff = (ours - ref).square().sum(dim=1)
            diff_sq += diff
            ref_sq += ref.square().sum(dim=1)
            if not diff.max().item() <= worst_diff:  # NaN counts as the worst
                worst_diff, worst_name = diff.max().item(), name
        worst = (diff_sq.sqrt() / ref_sq.sqrt().clamp(min=1e-30)).max().item()
        if not worst <= rtol:
            raise ConfigurationError(  # no number: the check may run on private records, and messages reach logs
                f"layerwise per-example gradients differ from grad of the per-example loss by more than rtol={rtol} "
                f"(relative), most on {worst_name!r}: a parameter is used outside a supported layer, or examples "
                "interact in the batched pass. Use vmap(grad) for this model."
            )
        return worst

    def _run(self, params: dict[str, torch.Tensor], batch: tuple[Any, ...], *, instantiate: bool) -> tuple[Any, Any]:
        """One chunk: the hooks installed, the batched forward, the backward to the anchor, the hooks removed."""
        self.refresh()
        by_module = self.layers(params)
        first = next(iter(params.values()))
        anchor = torch.zeros((), device=first.device, requires_grad=True)
        leaves = optree.tree_leaves(batch)
        out, rows = self._empty_gradients(params, leaves)
        # Nothing outside the taps needs a gradient (the parameters are detached; the batch and the other parameters
        # need none): a layer output that requires one is then downstream of a tap, so the backward to the anchor
        # reaches it and a tensor hook on it suffices (cheaper than another tap).
        hooks_suffice = not any(p.requires_grad for p in self._others) and not any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in leaves
        )
        hooks = ChunkPass(by_module, out, anchor, hooks_suffice=hooks_suffice, rows=rows)
        hooks.install(self.model)
        try:
            with recompute_linked_to(self.model, anchor):
                detached = {k: v.detach() if v.requires_grad else v for k, v in params.items()}
                with torch.enable_grad():
                    result = self.batch_loss(detached, *batch)
                return self._backward(result, out, hooks.calls, anchor, instantiate=instantiate)
        finally:
            hooks.remove()

    def _empty_gradients(self, params: dict[str, torch.Tensor], leaves: list[Any]) -> tuple[Gradients, int]:
        """The chunk's gradients before the pass (the trainable names in the clipped sums' leaf order, their shapes
        and accumulation dtypes, the batch size, the error of the run's float32 products and the norm route) and the
        rows the model runs on (grouped: ``m k``)."""
        names = [path[0] for path in optree.tree_paths(params)]
        first = next(iter(params.values()))
        shapes = {k: v.shape for k, v in params.items()}
        dtypes = {k: accumulation_dtype(v.dtype) for k, v in params.items()}
        tensors = [x for x in leaves if isinstance(x, torch.Tensor) and x.dim()]
        sizes = {x.shape[0] for x in tensors}
        if len(sizes) != 1:
            raise ConfigurationError(f"batched tensors need one leading batch dimension, got sizes {sorted(sizes)}.")
        m = rows = sizes.pop()
        if self.grouped:
            slots = {x.shape[1] if x.dim() > 1 else 0 for x in tensors}
            if len(slots) != 1 or not min(slots) > 0:
                shapes_seen = sorted({tuple(x.shape) for x in tensors})
                raise ConfigurationError(
                    f"grouped examples need every batched tensor [m, k, ...] with one k >= 1 (the rows of an "
                    f"example), got shapes {shapes_seen}. Give every example k rows (fill a slot with one of the "
                    "example's own rows with loss weight 0), or use grouped=False for one row per example."
                )
            rows = m * slots.pop()
        error = product_error(matmul_precision(first.device))
        gradients = Gradients(names, shapes, dtypes, m, first.device, product_error=error, norm_route=self.norm_route)
        return gradients, rows

    def _backward(
        self, result: Any, out: Gradients, calls: list[Call], anchor: torch.Tensor, *, instantiate: bool
    ) -> Any:
        """The backward of the batched pass to ``anchor``: the hooks, still in place, record every layer's gradients
        (a checkpointed layer's recompute runs its forward hooks in the backward)."""
        losses, aux = result if isinstance(result, tuple) else (result, None)
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            raise ConfigurationError(f"batch_loss must return per-example losses [m], got {losses!r:.80}.")
        if losses.shape[0] != out.m:
            raise ConfigurationError(f"batch_loss returned {losses.shape[0]} losses for a batch of {out.m} examples.")
        if not instantiate:
            out.ghost.update(ghost_names(calls, out, self.ghost_advantage))
            if tied := tied_names(calls, out, self.ghost_advantage):  # (most models tie nothing: no allocation)
                # the heads' norms are zeros until the backward records them
                zeros = torch.zeros(out.m, dtype=torch.float64, device=out.device)
                out.ghost.update({name: (head, zeros) for name, (head, _) in tied.items()})
                out.tied.update(dict.fromkeys(tied))  # the embedding's part, once recorded
        used = {name for call in calls for name in call.names.values()}
        out.group([name for name in out.names if name in used and name not in out.ghost])
        if losses.requires_grad:
            torch.autograd.backward(losses.sum(), inputs=[anchor])
        if aux is None:
            return out, losses.detach()
        return out, (losses.detach(), optree.tree_map(torch.Tensor.detach, aux))
