"""The clipping engine of a trainer's step (:class:`~opake_core.clipping.Engine`), chosen from the arguments.

* Per-example gradients: the layerwise engine (one batched forward and backward, :mod:`opake_torch.layerwise`) where
  ``per_example_gradients`` allows it and the model is served by it, checked once against ``grad`` of the
  per-example loss; otherwise ``vmap(grad)``, with the fused Triton norms and scaled sums on CUDA.
* How each chunk runs: captured as CUDA graphs (``cuda_graphs``), compiled (``torch_compile``: the layerwise engine
  as its traced pass, :mod:`opake_torch.layerwise.compiled`, in one graph), or as it is.
* Activation offloading (``activation_offloading``, :mod:`opake_torch.offloading`): the layerwise engine runs under
  the saved-tensor hooks that hold what autograd saves in host memory; ``vmap(grad)``, which refuses such hooks,
  offloads the inputs its checkpointed layers keep, and so needs ``gradient_checkpointing``.
* Whichever engine serves the run, :func:`independent` then checks that the records stay independent under it (the
  neighbour test of :mod:`.coupling`), before any step.

:func:`step_factory` builds the run's core step (``dp_sgd``, or ``dp_ftrl`` for a correlated-noise plan) on that
engine.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from opake_core.clipping import Engine, MaterializedGradients, VmapGradients
from opake_core.errors import ConfigurationError
from opake_core.step import dp_ftrl, dp_sgd
from opake_torch.layerwise import LayerwiseGradients, unsupported_parameters
from opake_torch.layerwise.compiled import KINDS, MIN_TORCH, CompiledLayerwise, torch_supported, unserved
from opake_torch.offloading import VMAP_NEEDS_CHECKPOINTING, OffloadedGradients
from opake_torch.patches.kernels import FusedGradients
from opake_torch.transformers import coupling
from opake_torch.transformers.compile import CudaGraphChunk, compile_chunk
from opake_torch.transformers.users import LIVE

__all__ = [
    "CHECK_POSITIONS",
    "chunk_transform",
    "engine",
    "independent",
    "layerwise_engine",
    "neighbour_rtol",
    "step_factory",
    "verified",
]

logger = logging.getLogger(__name__)


def layerwise_engine(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    args: Any,
    batch_losses: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor],
    *,
    reasons: list[str],
) -> LayerwiseGradients | None:
    """The layerwise engine on ``batch_losses(params, batch) -> [m]`` (run under bf16 autocast with ``args.bf16``,
    ghost norms weighed by ``args.layerwise_ghost_advantage``), or None when ``per_example_gradients`` is ``'vmap'``
    or the run cannot use it (``reasons``: the caller's own, such as an overridden loss). ``'layerwise'`` raises
    instead of falling back."""
    mode = args.per_example_gradients
    if mode == "vmap":
        return None
    reasons = unsupported_parameters(model, params) + reasons
    if reasons:
        if mode == "layerwise":
            raise ConfigurationError(
                f"per_example_gradients='layerwise' cannot serve this run: {'; '.join(reasons[:5])}. Use "
                "per_example_gradients='vmap' (or 'auto', which picks it)."
            )
        logger.info("per-example gradients by vmap(grad): %s", "; ".join(reasons[:5]))
        return None

    def loss(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            return batch_losses(p, batch)

    # under privacy_unit="user" a batch is users x slots, and a user's rows are one example
    grouped = args.privacy_unit == "user"
    return LayerwiseGradients(model, loss, ghost_advantage=args.layerwise_ghost_advantage, grouped=grouped)


CHECK_POSITIONS = 1024
"""The positions (tokens) of each example that the layerwise engine's check runs on."""


def _first_positions(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with every tensor of more than :data:`CHECK_POSITIONS` entries in its positions dimension (1 in the
    ``[batch, positions, ...]`` layout of text batches, 2 in the ``[users, k, positions, ...]`` one of a user-level
    batch) cut to its first ones."""
    dim = 2 if LIVE in batch else 1
    long = lambda v: isinstance(v, torch.Tensor) and v.dim() > dim and v.shape[dim] > CHECK_POSITIONS  # noqa: E731
    return {k: v.narrow(dim, 0, CHECK_POSITIONS) if long(v) else v for k, v in batch.items()}


def verified(
    layerwise: LayerwiseGradients | None,
    *,
    args: Any,
    model: nn.Module,
    params: dict[str, torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    batch: dict[str, torch.Tensor],
    check: Callable[..., float] | None = None,
) -> LayerwiseGradients | None:
    """``layerwise`` after comparing it with ``grad`` of the per-example loss ``loss_fn`` on ``batch`` (two training
    examples, cut to their first :data:`CHECK_POSITIONS` positions: the check runs without dropout, hence without
    checkpointing, and must fit where a step does). ``check(layerwise, params, loss_fn, batch, rtol=)``: how to
    compare (default :meth:`~opake_torch.layerwise.LayerwiseGradients.check`; FSDP2 passes the sharded one). On a
    mismatch, or any error of the layerwise pass, ``'auto'`` falls back to ``vmap(grad)`` (returns None) with a
    warning and ``'layerwise'`` raises."""
    if layerwise is None:
        return None
    check = check or (lambda engine, *rest, rtol: engine.check(*rest, rtol=rtol))
    try:
        check(layerwise, params, loss_fn, _first_positions(batch), rtol=5e-2 if _low_precision(args, model) else 1e-2)
    except Exception as exc:  # a mismatch, or a model the batched pass cannot run: auto falls back
        if args.per_example_gradients == "layerwise":
            raise
        logger.warning("per-example gradients fall back to vmap(grad): %s: %s", type(exc).__name__, exc)
        return None
    return layerwise


def _low_precision(args: Any, model: nn.Module) -> bool:
    return args.bf16 or any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())


def neighbour_rtol(args: Any, model: nn.Module) -> float:
    """The neighbour test's tolerance: the rounding of two passes of one engine on batches of different shapes
    (other kernels, other summation orders), relative to a row's gradient."""
    if _low_precision(args, model):
        return 5e-2
    if all(p.dtype == torch.float64 for p in model.parameters()):
        return 1e-6
    tf32 = args.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return 1e-2 if tf32 else 1e-3


def independent(
    layerwise: LayerwiseGradients | None,
    *,
    args: Any,
    model: nn.Module,
    params: dict[str, torch.Tensor],
    loss_fn: Callable[..., Any],
    has_aux: bool,
    batch_of: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    sample: tuple[list[dict[str, Any]], dict[str, Any]] | None,
    microbatch: int,
) -> LayerwiseGradients | None:
    """``layerwise`` after the neighbour test (:func:`.coupling.check_neighbours`) on ``sample`` (from
    :func:`.coupling.neighbour_rows`; None: too few rows, nothing to test), with the engine the step will use, in its
    chunks of at most ``microbatch`` rows.

    A failure of the layerwise engine falls back to ``vmap(grad)`` with a warning under ``'auto'`` (returns None
    once ``vmap`` passes too) and raises under ``'layerwise'``; a failure under ``vmap`` raises: ConfigurationError
    naming the leaf and the module that moved. Cost: two passes of the engine on at most
    :data:`~.coupling.ROWS` + 1 rows (see :mod:`.coupling`).
    """
    if sample is None:
        return layerwise
    common = dict(model=model, params=params, loss_fn=loss_fn, has_aux=has_aux, batch_of=batch_of, rows=sample[0],
                  extra=sample[1], microbatch=microbatch, rtol=neighbour_rtol(args, model))  # fmt: skip
    if layerwise is not None:
        try:
            coupling.check_neighbours(layerwise, batch_loss=layerwise.batch_loss, engine_name="layerwise", **common)
            return layerwise
        except Exception as exc:  # coupled in the batched pass, or a batch it cannot run: auto falls back
            if args.per_example_gradients == "layerwise":
                raise
            logger.warning("per-example gradients fall back to vmap(grad): %s: %s", type(exc).__name__, exc)
    gradients = engine(args, None, None, microbatch=1).gradients
    coupling.check_neighbours(gradients, batch_loss=None, engine_name="vmap", **common)
    return None


def chunk_transform(args: Any, keep: Callable[[CudaGraphChunk], None]) -> Callable[[Any], Any] | None:
    """The wrapper of the per-chunk clip function that ``cuda_graphs`` or ``torch_compile`` ask for, else None.

    Chunks are padded with dead rows (which add nothing) to a few shapes (:func:`engine`), so that Poisson batches of
    any size replay the same graphs. ``keep`` receives the
    :class:`~opake_torch.transformers.compile.CudaGraphChunk` holding the captures.
    """
    if args.cuda_graphs:

        def capture(chunk: Any) -> CudaGraphChunk:
            graphs = CudaGraphChunk(chunk, args.cuda_graphs)
            keep(graphs)
            return graphs

        return capture
    if args.torch_compile:
        return lambda chunk: compile_chunk(chunk, backend=args.torch_compile_backend, mode=args.torch_compile_mode)
    return None


def engine(
    args: Any, layerwise: LayerwiseGradients | None, transform: Callable[[Any], Any] | None, *, microbatch: int
) -> Engine:
    """The step's engine for chunks of at most ``microbatch`` rows: layerwise gradients when available (compiled:
    their traced pass, :class:`~opake_torch.layerwise.compiled.CompiledLayerwise`, or the hook engine eagerly with a
    warning for a model with layer kinds that pass does not serve), else ``vmap(grad)`` with the fused Triton norms
    and scaled sums on CUDA (the identical torch path where they cannot run), but not inside a captured or compiled
    chunk.

    Rows: with ``transform`` and ``cuda_graphs = k``, each chunk is rounded up to a multiple of
    ``ceil(microbatch / k)`` (dead rows), so that Poisson draws of any size meet at most ``k`` shapes, one captured
    graph each; compiled ``vmap(grad)`` chunks are padded to ``microbatch`` (vmap fixes the shapes it traces); the
    compiled layerwise pass and chunks without ``transform`` round to ``args.per_example_row_multiple`` (1: the real
    rows only), the compiled pass with two rows at least.

    With ``activation_offloading``: the layerwise engine under
    :class:`~opake_torch.offloading.OffloadedGradients`; ``vmap(grad)`` as it is (its checkpointed layers offload
    their inputs), and ConfigurationError without ``gradient_checkpointing``, where it would offload nothing.
    """
    offload = getattr(args, "activation_offloading", False)
    if transform is None:
        row_multiple = args.per_example_row_multiple
    elif args.cuda_graphs:
        row_multiple = -(-microbatch // args.cuda_graphs)
    else:
        row_multiple = microbatch
    if layerwise is not None:
        if transform is not None and args.torch_compile:
            compiled = _compiled_layerwise(layerwise)
            if compiled is None:  # layer kinds the traced pass does not serve: the hook engine, eagerly
                return Engine(gradients=layerwise, transform=None, row_multiple=args.per_example_row_multiple)
            backend, mode = args.torch_compile_backend, args.torch_compile_mode
            transform = lambda chunk: compile_chunk(chunk, backend=backend, mode=mode, around=compiled.around)  # noqa: E731
            # the traced pass keeps the rows and positions of a chunk symbolic: the real rows only, but a chunk of one
            # row takes a dead one, since Dynamo specializes a size of 1 (a second compilation, minutes)
            return Engine(gradients=compiled, transform=transform, row_multiple=args.per_example_row_multiple,
                          min_rows=2)  # fmt: skip
        gradients = OffloadedGradients(layerwise) if offload else layerwise
        return Engine(gradients=gradients, transform=transform, row_multiple=row_multiple)
    if offload and not args.gradient_checkpointing:
        raise ConfigurationError(VMAP_NEEDS_CHECKPOINTING)
    fused = args.device.type == "cuda" and transform is None
    gradients = VmapGradients(FusedGradients if fused else MaterializedGradients)
    return Engine(gradients=gradients, transform=transform, row_multiple=row_multiple)


def _compiled_layerwise(layerwise: LayerwiseGradients) -> CompiledLayerwise | None:
    """The traced pass of ``layerwise`` for a compiled chunk, or None (with a warning) for a model with layer kinds
    it does not serve or a torch release it is not verified on."""
    if not torch_supported():
        warnings.warn(
            f"torch_compile compiles the layerwise engine's step on torch {MIN_TORCH} or newer; this is "
            f"{torch.__version__}, so the step runs eagerly. Set torch_compile=False to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    kinds = unserved(layerwise)
    if not kinds:
        return CompiledLayerwise(layerwise)
    warnings.warn(
        f"torch_compile compiles the layerwise engine's step for the layer kinds {KINDS}; this model has {kinds}, so "
        "its step runs eagerly. Set torch_compile=False to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def step_factory(
    plan: Any,
    args: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    params: dict[str, torch.Tensor],
    optimizer: Any,
    clipping: Any,
    key: Any,
    engine: Engine,
    topology: Any,
    has_aux: bool = False,
    perf: Any = None,
) -> Callable[[int | None], tuple[Any, Any]]:
    """``make_step(microbatch_size) -> (step_fn, dp_state)``: the plan's core step on ``engine``, with the noise
    key ``key``. Under DDP the clipped sums, normalized by the cluster's expected batch, are summed across ranks and
    noised once (``topology.reduce``); under FSDP2 they are reduce-scattered and each rank noises its own rows.
    ``perf``: a :class:`.step_perf.StepPerf` whose gradients phase ends after that reduction (None: no mark)."""
    common = {
        "optimizer": optimizer,
        "clipping_norm": clipping,
        "noise_multiplier": plan.noise_multiplier,
        "key": key,
        "expected_batch_size": plan.expected_batch_size,
        "compute_dtype": args.privacy_noise_mechanism_kwargs.get("compute_dtype", torch.float32),
        "engine": engine,
        "reduce": topology.reduce if perf is None else perf.timed_reduce(topology.reduce),
        "has_aux": has_aux,  # loss_fn returns (loss, per-example log values): they reach metrics.aux
        # the run gives up each step's inputs: noise, optimizer state and weights are updated in their own tensors
        # (not under auto_find_microbatch_size, whose retry after an out-of-memory error reruns a step's inputs)
        "donate": not args.auto_find_microbatch_size,
    }
    if topology.is_sharded:  # FSDP2: the sum formed in the global shapes, reduce-scattered, noised on the rank's rows
        common.update(sum_like=topology.sum_like, shard=topology.layout)

    def make_step(microbatch_size: int | None) -> tuple[Any, Any]:
        if plan.strategy is None:
            return dp_sgd(loss_fn, reduce_count=topology.reduce_count, microbatch_size=microbatch_size, **common)
        return dp_ftrl(
            loss_fn,
            params=params,
            strategy=plan.strategy,
            n_steps=plan.total_steps,
            microbatch_size=microbatch_size,
            **common,
        )

    return make_step
