"""Sharded data parallel on PyTorch's FSDP2 (``fully_shard``): each rank holds ``1/W`` of every trainable parameter.

One private step on ``W`` ranks (``docs/distributed.md``):

    rank r: its share of one global Poisson draw -> the layerwise engine on the FSDP module (weights all-gathered
            layer by layer, as in non-private training) -> per-example norms (local: a rank's examples are whole on
            it) -> its clipped sum, full-size
    all ranks: reduce-scatter of the clipped sums -> each rank the cross-rank sum of its own rows of every weight
    rank r: the noise of its rows only (the one-process draw, coordinate by coordinate) -> optimizer on its shard

The layout is FSDP2's ``Shard(0)``: a weight of ``d0`` rows is cut into chunks of ``ceil(d0 / W)`` rows, rank ``r``
holding chunk ``r`` (possibly short or empty), which :meth:`opake_core.sharding.Shard.rows` describes for the noise.
No per-example gradient and no gradient is ever all-gathered. Optimizers that are not elementwise (Adafactor's
factored moments) would see one shard of a weight and are refused.

The adapter is the only place that touches ``torch.distributed.fsdp``; the core sees plain local tensors, the
``reduce`` collective and the rank's :class:`~opake_core.sharding.Shard`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch import nn

from opake_core.errors import ConfigurationError
from opake_core.sharding import Shard
from opake_core.tree import Clipped, Noised

__all__ = [
    "FSDP_CONFIG_KEYS",
    "FSDP_OPTIONS",
    "check_layerwise",
    "full_state_dict",
    "leaf_names",
    "local_params",
    "parse_fsdp",
    "parse_fsdp_config",
    "reduce_scatter",
    "shard_layout",
    "shard_model",
    "stand_ins",
]

# Hugging Face's fsdp options, and what each does here
FSDP_OPTIONS = {
    "full_shard": "parameters sharded, re-gathered for the backward (reshard_after_forward=True)",
    "shard_grad_op": "parameters sharded, kept gathered from the forward to the backward (reshard_after_forward=False)",
    "auto_wrap": "one FSDP unit per transformer layer (the model's _no_split_modules), always on",
}
_REFUSED_OPTIONS = {
    "hybrid_shard": "hybrid sharding (replicas of shard groups) is not supported yet; use full_shard",
    "hybrid_shard_zero2": "hybrid sharding (replicas of shard groups) is not supported yet; use full_shard",
    "offload": "CPU offload of the parameters is not supported yet; use full_shard on more ranks",
    "no_shard": "no_shard is data parallelism: launch with torchrun without fsdp (the built-in DDP)",
}
# fsdp_config keys (Hugging Face's names, with or without the "fsdp_" prefix) -> what they mean here
FSDP_CONFIG_KEYS = {
    "transformer_layer_cls_to_wrap": "class names of the modules that become FSDP units (default: _no_split_modules)",
    "reshard_after_forward": "overrides full_shard / shard_grad_op",
    "version": "must be 2 (FSDP2)",
}
# keys of FSDP1 or of accelerate that FSDP2 has no use for: accepted, no effect
_INERT_KEYS = (
    "backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states",
    "cpu_ram_efficient_loading", "state_dict_type", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt",
)  # fmt: skip


# keys Hugging Face documents that this path does not serve yet, refused when set, with what to do instead
_REFUSED_KEYS = {
    "activation_checkpointing": "use gradient_checkpointing=True, whose recompute the layerwise engine taps",
    "cpu_offload": "CPU offload of the parameters is not supported yet; use full_shard on more ranks",
    "offload_params": "CPU offload of the parameters is not supported yet; use full_shard on more ranks",
    "auto_wrap_policy": "only TRANSFORMER_BASED_WRAP (one unit per transformer layer) is supported",
}


def parse_fsdp(value: Any) -> tuple[str, ...]:
    """Hugging Face's ``fsdp`` argument (``""``, ``"full_shard auto_wrap"``, a list of options, True) as the sorted
    options it names; ConfigurationError for one that is not supported, saying why and what to use."""
    if value in (None, False, "", [], ()):
        return ()
    if value is True:
        return ("full_shard",)
    words = value.split() if isinstance(value, str) else [str(getattr(v, "value", v)) for v in value]
    options = sorted({word.strip().lower() for word in words if word.strip()})
    for option in options:
        if option in _REFUSED_OPTIONS:
            raise ConfigurationError(f"fsdp={value!r}: {_REFUSED_OPTIONS[option]}.")
        if option not in FSDP_OPTIONS:
            raise ConfigurationError(
                f"fsdp={value!r}: unknown option {option!r}; the options are {sorted(FSDP_OPTIONS)} "
                f"(not supported yet: {sorted(_REFUSED_OPTIONS)})."
            )
    if "full_shard" in options and "shard_grad_op" in options:
        raise ConfigurationError(f"fsdp={value!r} names both full_shard and shard_grad_op; choose one.")
    if not {"full_shard", "shard_grad_op"} & set(options):
        options = sorted({*options, "full_shard"})  # auto_wrap alone: full sharding, as Hugging Face
    return tuple(options)


def parse_fsdp_config(value: Any) -> dict[str, Any]:
    """Hugging Face's ``fsdp_config`` (a dict, the path of a JSON file, or a JSON object's text as the command line
    gives ``to_dict()``'s value) with the keys of :data:`FSDP_CONFIG_KEYS` only (prefix ``fsdp_`` dropped);
    ConfigurationError for another key or value."""
    if value in (None, "", {}):
        return {}
    if isinstance(value, (str, Path)):
        try:
            text = value if str(value).lstrip().startswith("{") else Path(value).read_text()
            value = json.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"fsdp_config={str(value)!r} is not a readable JSON file: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigurationError(f"fsdp_config must be a dict or a JSON file path, got {type(value).__name__}.")
    out: dict[str, Any] = {}
    for raw, item in value.items():
        key = raw.removeprefix("fsdp_")
        if key in _INERT_KEYS:
            continue
        if (key == "min_num_params" and not item) or (key == "auto_wrap_policy" and item == "TRANSFORMER_BASED_WRAP"):
            continue  # Hugging Face's defaults: wrapping by transformer layer, which is what happens here
        if key in _REFUSED_KEYS and item:
            raise ConfigurationError(f"fsdp_config {raw}={item!r}: {_REFUSED_KEYS[key]}.")
        if key in _REFUSED_KEYS:
            continue
        if key not in FSDP_CONFIG_KEYS:
            raise ConfigurationError(
                f"fsdp_config key {raw!r} is not supported; the keys are {sorted(FSDP_CONFIG_KEYS)} (FSDP1's "
                f"{sorted(_INERT_KEYS)} are accepted and have no effect). Wrapping by size (min_num_params) is "
                "not supported: name the layer classes in transformer_layer_cls_to_wrap."
            )
        out[key] = item
    if out.get("version", 2) not in (2, "2"):
        raise ConfigurationError(f"fsdp_config version={out['version']!r}: only FSDP2 (version 2) is supported.")
    layers = out.get("transformer_layer_cls_to_wrap")
    if isinstance(layers, str):
        out["transformer_layer_cls_to_wrap"] = [name.strip() for name in layers.split(",") if name.strip()]
    elif layers is not None and not (isinstance(layers, list) and all(isinstance(n, str) for n in layers)):
        raise ConfigurationError(f"fsdp_config transformer_layer_cls_to_wrap must be class names, got {layers!r}.")
    if "reshard_after_forward" in out and not isinstance(out["reshard_after_forward"], bool):
        raise ConfigurationError(
            f"fsdp_config reshard_after_forward must be True or False, got {out['reshard_after_forward']!r}."
        )
    return out


def _unit_classes(model: nn.Module, config: dict[str, Any]) -> set[str]:
    """The class names of the modules that become FSDP units: ``transformer_layer_cls_to_wrap``, else the model's
    ``_no_split_modules`` (as Hugging Face wraps); ConfigurationError when a named class is not in the model."""
    names = config.get("transformer_layer_cls_to_wrap")
    base = getattr(model, "get_base_model", lambda: model)()
    if names is None:
        names = list(getattr(base, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(set(names) - present)
    if missing:
        raise ConfigurationError(
            f"fsdp_config transformer_layer_cls_to_wrap names {missing}, which {type(base).__name__} does not have; "
            f"its layer classes include {sorted(present)[:12]}."
        )
    return set(names)


def shard_model(model: nn.Module, *, options: tuple[str, ...], config: dict[str, Any], device: torch.device) -> None:
    """Apply ``fully_shard`` to every transformer layer of ``model`` (:func:`_unit_classes`), then to the model, on a
    one-dimensional mesh of all ranks; the parameters become DTensors sharded on dim 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    reshard = config.get("reshard_after_forward", "shard_grad_op" not in options)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units = _unit_classes(model, config)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in units:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def local_params(model: nn.Module, names: Any) -> dict[str, torch.Tensor]:
    """``{name: the rank's rows of the parameter}`` for the trainable ``names``: plain tensors sharing the storage of
    the FSDP module's shards, detached."""
    own = dict(model.named_parameters())
    return {name: _local(own[name]).detach() for name in names}


def stand_ins(model: nn.Module, names: Any) -> dict[str, torch.Tensor]:
    """Zero-stride tensors of the global shapes of the trainable ``names`` (no memory): the tree in which the engine
    forms the full-size clipped sum (``dp_step(sum_like=...)``)."""
    own = dict(model.named_parameters())
    out = {}
    for name in names:
        local = _local(own[name])
        out[name] = torch.zeros((), dtype=local.dtype, device=local.device).expand(own[name].shape)
    return out


def shard_layout(model: nn.Module, names: Any) -> Shard:
    """This rank's :class:`~opake_core.sharding.Shard` of the trainable parameters (in ``optree`` order), checked
    against the shards FSDP2 actually holds."""
    own = dict(model.named_parameters())
    ordered = leaf_names(names)
    shapes = [tuple(own[name].shape) for name in ordered]
    shard = Shard.rows(shapes, rank=dist.get_rank(), world_size=dist.get_world_size())
    for name, expected in zip(ordered, shard.local_shapes, strict=True):
        if tuple(_local(own[name]).shape) != tuple(expected):
            raise ConfigurationError(
                f"{name}: FSDP2 holds local shape {tuple(_local(own[name]).shape)} on rank {dist.get_rank()}, the "
                f"dim-0 layout expects {tuple(expected)}; a custom shard placement is not supported."
            )
    return shard


def reduce_scatter(shard: Shard, world_size: int) -> Callable[[Clipped], Clipped]:
    """The ``reduce`` of a sharded step: the ranks' full-size clipped sums summed, each rank receiving its own rows
    of every leaf (``shard``'s layout), in one ``reduce_scatter_tensor`` per accumulation dtype."""
    chunks = [math.ceil(shape[0] / world_size) if shape else 1 for shape in shard.shapes]

    def reduce(clipped: Clipped) -> Clipped:
        if isinstance(clipped, Noised) or not isinstance(clipped, Clipped):
            raise ConfigurationError(
                f"the sharded reduce takes the clipped, un-noised sum (a Clipped), got {type(clipped).__name__}."
            )
        leaves, treedef = optree.tree_flatten(clipped.value)
        out: list[torch.Tensor | None] = [None] * len(leaves)
        for dtype in sorted({leaf.dtype for leaf in leaves}, key=str):
            members = [i for i, leaf in enumerate(leaves) if leaf.dtype == dtype]
            widths = [chunks[i] * math.prod(shard.shapes[i][1:]) for i in members]  # a rank's padded rows, flat
            stacked = leaves[members[0]].new_zeros(world_size, sum(widths))  # [W, this dtype's rows of a rank]
            for i, block in zip(members, stacked.split(widths, dim=1), strict=True):
                _scatter_rows(leaves[i], block.view(world_size, chunks[i], -1))
            mine = stacked.new_empty(stacked.shape[1])
            dist.reduce_scatter_tensor(mine, stacked.view(-1))
            for i, piece in zip(members, mine.split(widths), strict=True):
                start, stop = shard.ranges[i]
                out[i] = piece[: stop - start].view(shard.local_shapes[i])
        return Clipped(optree.tree_unflatten(treedef, out), clipped.sensitivity)

    return reduce


def _scatter_rows(leaf: torch.Tensor, block: torch.Tensor) -> None:
    """Copy ``leaf``'s dim-0 rows into ``block`` ``[W, chunk, row]`` (zeros past the last row), rank by rank, without
    a padded copy of the leaf."""
    rows = leaf.reshape(leaf.shape[0] if leaf.dim() else 1, -1)
    chunk = block.shape[1]
    whole = rows.shape[0] // chunk
    block[:whole] = rows[: whole * chunk].view(whole, chunk, -1)
    if rows.shape[0] > whole * chunk:
        block[whole, : rows.shape[0] - whole * chunk] = rows[whole * chunk :]


def leaf_names(names: Any) -> list[str]:
    """The trainable ``names`` in ``optree``'s leaf order of a ``{name: tensor}`` tree (the order of a
    :class:`~opake_core.sharding.Shard`'s leaves)."""
    return [path[0] for path in optree.tree_paths(dict.fromkeys(names, 0))]


def check_layerwise(
    layerwise: Any,
    loss_fn: Callable[..., torch.Tensor],
    batch: Any,
    *,
    model: nn.Module,
    sum_like: dict[str, torch.Tensor],
    shard: Shard,
    rtol: float,
) -> float:
    """The layerwise engine against ``grad`` of the per-example loss ``loss_fn(params, example)`` on a sharded model,
    example by example on ``batch`` (a few examples, the same on every rank); returns the largest relative error.

    The reference is plain autograd through the FSDP module, one example at a time: the weights gathered as in
    training, the gradient reduce-scattered (each rank gets its rows, averaged over ranks that all ran the same
    example). The engine's gradient of example ``i`` is its clipped sum with weight 1 on row ``i`` and 0 on the others,
    from the batched pass, formed in the global shapes (``sum_like``), of which each rank compares its rows. The
    squared differences are summed over ranks, so every rank reaches the same verdict. Memory: one full-size sum, as in
    a step, and this rank's rows of one gradient. ConfigurationError, as
    :meth:`~opake_torch.layerwise.LayerwiseGradients.check`, beyond ``rtol``."""
    from opake_core.clipping.microbatching import batch_size
    from opake_core.clipping.rules import accumulators

    ordered = leaf_names(sum_like)
    own = dict(model.named_parameters())
    trainable = [own[name] for name in ordered]
    m = batch_size((batch,))
    training = model.training
    model.eval()  # no dropout: both passes see the same function
    try:
        reference = []
        try:
            for parameter in trainable:
                parameter.requires_grad_(True)
            for i in range(m):
                with torch.enable_grad():
                    loss_fn(sum_like, optree.tree_map(lambda x, i=i: x[i], batch)).backward()
                reference.append([_grad_rows(p) for p in trainable])
                for parameter in trainable:
                    parameter.grad = None
        finally:
            for parameter in trainable:
                parameter.grad = None
                parameter.requires_grad_(False)
        squares = torch.zeros(2, m, dtype=torch.float64)  # [difference, reference] squared, per example
        for i in range(m):
            grads, _ = layerwise(None, (sum_like, batch), (1,))
            sums = accumulators(optree.tree_leaves(sum_like))
            one = torch.zeros(1, m, dtype=torch.float64, device=sums[0].device)
            one[0, i] = 1.0
            grads.add_scaled({dtype: one.to(dtype).expand(len(sums), m) for dtype in {s.dtype for s in sums}}, sums)
            for total, (start, stop), ref in zip(sums, shard.ranges, reference[i], strict=True):
                ours = total.reshape(-1)[start:stop].double()
                squares[0, i] += (ours - ref).square().sum().cpu()
                squares[1, i] += ref.square().sum().cpu()
            del grads, sums
    finally:
        model.train(training)
    if dist.get_backend() == "nccl":
        squares = squares.cuda()
    dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    worst = (squares[0].sqrt() / squares[1].sqrt().clamp(min=1e-30)).max().item()
    if not worst <= rtol:
        raise ConfigurationError(  # no number: the check may run on private records, and messages reach logs
            f"layerwise per-example gradients differ from grad of the per-example loss by more than rtol={rtol} "
            "(relative) on the sharded model: a parameter is used outside a supported layer, or examples interact in "
            "the batched pass. Drop fsdp and use per_example_gradients='vmap' for this model."
        )
    return worst


def _grad_rows(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``parameter``'s gradient, flat, in float64 (zeros where the loss did not reach it)."""
    if parameter.grad is None:
        return torch.zeros(_local(parameter).numel(), dtype=torch.float64, device=_local(parameter).device)
    return _local(parameter.grad).double().reshape(-1)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU, gathered from the shards (a collective: every rank calls it; every rank
    gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
