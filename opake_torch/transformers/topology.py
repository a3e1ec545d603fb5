"""Where a trainer runs: one process, DDP ranks or FSDP2 ranks under torchrun. Everything that differs lives here.

:class:`SingleProcess` makes every cross-rank operation the identity; :class:`DataParallel` implements them on
``torch.distributed`` (:mod:`opake_torch.distributed`): rank 0's weights and keys on every rank, the cross-rank SUM of
the clipped sums (and of adaptive clipping's counts) before the one noise draw, checks that the ranks agree, and one
writer for checkpoints whose failure stops every rank. :class:`ShardedDataParallel` shards the model with FSDP2
(:mod:`opake_torch.sharded`): the clipped sums are reduce-scattered, each rank noises and updates its own rows.
:func:`topology` picks one from the arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opake_core.clipping.microbatching import batch_size
from opake_core.errors import ConfigurationError
from opake_core.random import Key
from opake_core.sampling.state import SamplerState
from opake_core.step import unkeyed
from opake_torch import distributed, sharded
from opake_torch.transformers import sharded_state

__all__ = ["DataParallel", "ShardedDataParallel", "SingleProcess", "topology"]


class SingleProcess:
    """One process: collectives are the identity."""

    is_distributed = False
    is_sharded = False  # the trainable parameters are this rank's rows (FSDP2)
    reduce: Callable[..., Any] | None = None  # the cross-rank sum of the clipped sums (none here)
    reduce_count: Callable[..., Any] | None = None  # the cross-rank sum of adaptive clipping's counts

    def broadcast_params(self, params: dict[str, torch.Tensor]) -> None:
        """Rank 0's parameters on every rank, in place."""

    def shared_key(self, key: Key) -> Key:
        """Rank 0's key on every rank."""
        return key

    def check_agree(self, **fields: Any) -> None:
        """ConfigurationError naming the fields (keys, counters, configuration) that differ between ranks."""

    def check_params(self, params: dict[str, torch.Tensor]) -> None:
        """StateError when the ranks' parameters diverged."""

    def engine_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parameters the per-example engine forms gradients in: ``params`` (under FSDP2: stand-ins of their
        global shapes)."""
        return params

    def layerwise_check(self, model: torch.nn.Module) -> Callable[..., float] | None:
        """How the layerwise engine is compared with ``grad`` before a run (None: its own check)."""
        return None

    def full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict where the model is sharded (a collective: every rank calls it), else None
        (the model's own parameters are whole)."""
        return None

    def model_step(
        self, step_fn: Callable[..., Any], model: torch.nn.Module, *, microbatch: int, idle: Callable[[], Any]
    ) -> Callable[..., Any]:
        """The step of a run on this topology: ``step_fn``, whose new parameters are written into the model's own
        tensors, which the run then holds (:func:`in_model`): one copy of the weights, not two."""
        return in_model(step_fn, model)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a logged value over ranks."""
        return value

    def write(self, should_write: bool, write: Callable[[], Any], what: str) -> None:
        """``write()`` on the writing rank; under DDP a failure there stops every rank."""
        if should_write:
            write()

    def sampler_state(self, saved: SamplerState, fresh: SamplerState) -> SamplerState:
        """A checkpoint's sampler state for this run's sampler: the saved one, or (a per-step run resumed at another
        rate) this sampler continued at the saved step."""
        return saved if saved.config == fresh.config else SamplerState(saved.step, fresh.config)


class DataParallel(SingleProcess):
    """DDP ranks under torchrun on ``torch.distributed``."""

    is_distributed = True
    reduce = staticmethod(distributed.sum_gradients)
    reduce_count = staticmethod(distributed.sum_counts)

    def broadcast_params(self, params: dict[str, torch.Tensor]) -> None:
        distributed.broadcast_params(params)

    def shared_key(self, key: Key) -> Key:
        return distributed.broadcast_key(key)

    def check_agree(self, **fields: Any) -> None:
        distributed.check_synchronized(secret=frozenset({"dataset"}), **fields)

    def check_params(self, params: dict[str, torch.Tensor]) -> None:
        distributed.check_params_synchronized(params)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return distributed.reduce_mean(value)

    def write(self, should_write: bool, write: Callable[[], Any], what: str) -> None:
        try:
            if should_write:
                write()
        except BaseException:
            distributed.all_ok(False, what)
            raise
        distributed.all_ok(True, what)

    def sampler_state(self, saved: SamplerState, fresh: SamplerState) -> SamplerState:
        return distributed.local_sampler_state(saved, fresh)  # rank 0 wrote it; each rank keeps its own sampler


class ShardedDataParallel(DataParallel):
    """FSDP2 ranks under torchrun: the model sharded when the trainer is built (:meth:`shard`), before it reaches
    the device, so that it never has to fit one; the checks before a run compare the engine with ``grad`` on the
    sharded model, the clipped sums are reduce-scattered and each rank noises its own rows."""

    is_sharded = True

    def __init__(self, args: Any) -> None:
        unsupported = {  # attribute -> (what the user set, why)
            "torch_compile": ("torch_compile=True", "the compiled pass is not verified on sharded weights"),
            "cuda_graphs": ("cuda_graphs > 0", "a capture would hold one rank's gathered weights"),
            "router_release": ("router_aux_loss_coef > 0", "the MoE router release is not verified on shards"),
        }
        for name, (what, why) in unsupported.items():
            if getattr(args, name):
                raise ConfigurationError(f"{what} is not supported with fsdp yet: {why}. Turn it off, or drop fsdp.")
        self.options, self.config, self.device = args.fsdp.split(), args.fsdp_config, args.device
        self.layout: Any = None  # this rank's opake_core.sharding.Shard once the model is sharded
        self.sum_like: dict[str, torch.Tensor] | None = None  # the global shapes, for the full-size clipped sum

    @property
    def model_sharded(self) -> bool:
        return self.layout is not None

    def shard(self, model: torch.nn.Module, names: Any) -> dict[str, torch.Tensor]:
        """Shard ``model`` (once) and return this rank's rows of the trainable ``names``."""
        if self.layout is None:
            sharded.shard_model(model, options=tuple(self.options), config=self.config, device=self.device)
            for parameter in model.parameters():  # the engine differentiates the layers' outputs, never a weight
                parameter.requires_grad_(False)
            self.layout = sharded.shard_layout(model, names)
            self.sum_like = sharded.stand_ins(model, names)
            self.reduce = sharded.reduce_scatter(self.layout, distributed.get_world_size())
        return sharded.local_params(model, names)

    def check_params(self, params: dict[str, torch.Tensor]) -> None:
        """Nothing to compare: each rank holds other rows."""

    def broadcast_params(self, params: dict[str, torch.Tensor]) -> None:
        """The whole model is on every rank before it is sharded, where it may not fit one device: its weights are
        compared (a checksum per rank), not sent."""
        distributed.check_params_synchronized(params)

    def engine_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.sum_like

    def layerwise_check(self, model: torch.nn.Module) -> Callable[..., float] | None:
        def check(layerwise: Any, params: Any, loss_fn: Callable[..., Any], batch: Any, *, rtol: float) -> float:
            return sharded.check_layerwise(
                layerwise, loss_fn, batch, model=model, sum_like=self.sum_like, shard=self.layout, rtol=rtol
            )

        return check

    def full_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        return sharded.full_state_dict(model) if self.model_sharded else None

    def stage_state(self, where: Any, run: Any) -> dict[str, Any]:
        """Write this rank's rows of the run's state (parameters, step and RNG state, optimizer state) into
        ``where`` and wait for every rank; returns the ``shards`` record of ``dp_state.json``."""
        step_tree = {
            "params": run.params,
            "step_state": unkeyed(run.dp_state),
            "torch_rng_state": torch.get_rng_state(),
        }
        rank, world = distributed.get_rank(), distributed.get_world_size()
        try:
            sharded_state.stage(where, rank=rank, world_size=world, step_tree=step_tree, opt_tree=run.opt_state)
        except BaseException:
            distributed.all_ok(False, "writing a rank's checkpoint files")
            raise
        distributed.all_ok(True, "writing a rank's checkpoint files")
        names = sharded.leaf_names(run.params)
        owners = {
            "dp_state": sharded_state.layout(step_tree, names),
            "dp_optimizer": sharded_state.layout(run.opt_state, names),
        }
        return {"world_size": world, "layout": owners}

    def model_step(
        self, step_fn: Callable[..., Any], model: torch.nn.Module, *, microbatch: int, idle: Callable[[], Any]
    ) -> Callable[..., Any]:
        """The step of a sharded run: every rank runs as many forward and backward passes as the rank with the most
        chunks (FSDP2 gathers the weights inside each pass, so the ranks' passes must pair up), the missing ones as
        ``idle()`` passes whose result is dropped; then the new rows go into the module's shards, which the next
        forward gathers."""

        def lockstep(params: Any, opt_state: Any, dp_state: Any, batch: tuple[Any, ...]) -> Any:
            chunks = -(-batch_size(batch) // microbatch)
            for _ in range(distributed.max_over_ranks(chunks) - chunks):
                idle()
            return step_fn(params, opt_state, dp_state, batch)

        return in_model(lockstep, model)


def in_model(step_fn: Callable[..., Any], model: torch.nn.Module) -> Callable[..., Any]:
    """``step_fn`` whose new parameters are copied into the model's own tensors (this rank's rows under FSDP2); the
    step returns those tensors, so the next step starts from them and the previous values are freed. The model's
    tensors are looked up at the first step, not at every one."""
    own: dict[str, torch.Tensor] = {}

    def step(*inputs: Any) -> Any:
        params, *rest = step_fn(*inputs)
        if not own:
            own.update(sharded.local_params(model, params))
        # a donating step wrote the model's own tensors in place: only other tensors are copied
        moved = [name for name in params if params[name].data_ptr() != own[name].data_ptr()]
        if moved:
            with torch.no_grad():
                torch._foreach_copy_([own[name] for name in moved], [params[name] for name in moved])
        return (dict(own), *rest)

    return step


def topology(args: Any) -> SingleProcess:
    """The topology of a run: DDP under torchrun (``WORLD_SIZE > 1``, the process group initialized here), else one
    process; refuses what DDP cannot synchronize."""
    if args.world_size <= 1:
        if distributed.is_distributed():
            raise ConfigurationError(
                f"a process group of {distributed.get_world_size()} ranks is initialized but WORLD_SIZE is not set: "
                "launch with torchrun (or set WORLD_SIZE, RANK and LOCAL_RANK), so that sampling and accounting see "
                "the cluster."
            )
        return SingleProcess()
    if args.auto_find_microbatch_size:
        raise ConfigurationError(
            "auto_find_microbatch_size is not supported under DDP: an out-of-memory retry on one rank would "
            "desynchronize the cross-rank sum. Set microbatch_size explicitly."
        )
    if not distributed.init_process_group(args.ddp_backend, args.ddp_timeout, args.device):
        return SingleProcess()
    if distributed.get_rank() != args.process_index:
        raise ConfigurationError(
            f"the process group rank {distributed.get_rank()} differs from RANK={args.process_index}; launch with "
            "torchrun, whose RANK is the process group rank."
        )
    return ShardedDataParallel(args) if args.fsdp else DataParallel()
