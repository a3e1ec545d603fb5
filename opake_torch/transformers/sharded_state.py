"""The private state of a sharded (FSDP2) checkpoint: one pair of safetensors files per rank, read back on any world
size.

Every rank writes its own rows (:mod:`opake_torch.state_files`, nothing pickled): ``dp_state-<r>-of-<W>.safetensors``
holds its parameters' rows, its step state (DP-FTRL buffers, clipping state) and its torch RNG state,
``dp_optimizer-<r>-of-<W>.safetensors`` its optimizer state. They are staged in a hidden folder next to the
checkpoint, moved into it by the writing rank and sealed with the other files (:func:`.checkpoint_folder.write_state`),
so a checkpoint is complete or absent. ``dp_state.json`` records, under ``shards``, the world size and which leaf of
each tree holds rows of which parameter (:func:`layout`); the other leaves (step counters) are the same on every rank.

Read back on the same world size, each rank loads its own files (bit-exact, checked against its fresh state's
structure); on another world size, or in one process, the rows of every rank are put together and cut again in
FSDP2's layout for the reading rank (:func:`read`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import optree
import torch

from opake_core.errors import CheckpointError
from opake_core.sharding import Shard
from opake_torch.state_files import load_tree, save_tree

__all__ = ["STATE_FILES", "layout", "rank_files", "read", "stage", "staging", "unstage"]

STATE_FILES = ("dp_state", "dp_optimizer")  # the two trees of a rank: step state (with parameters), optimizer state
NAMESPACE = "opake"  # the optree namespace of the core's state classes


def rank_files(rank: int, world_size: int) -> tuple[str, str]:
    """The file names of rank ``rank``'s step state and optimizer state."""
    return tuple(f"{stem}-{rank:05d}-of-{world_size:05d}.safetensors" for stem in STATE_FILES)  # type: ignore[return-value]


def layout(tree: Any, names: list[str]) -> list[str | None]:
    """For each leaf of ``tree`` (``optree`` order, core namespace): the trainable parameter whose rows it holds, or
    None (a leaf every rank holds whole). ``names``: the trainable names in ``optree`` order. A leaf under a dict
    key that is a parameter name holds that parameter's rows (optimizer moments, the parameters themselves); a leaf
    of a DP-FTRL noise buffer holds those of the parameter at its index."""
    known = set(names)
    out: list[str | None] = []
    for path in optree.tree_paths(tree, namespace=NAMESPACE):
        owner = next((entry for entry in reversed(path) if isinstance(entry, str) and entry in known), None)
        if owner is None and "buffers" in path and isinstance(path[-1], int):
            owner = names[path[-1]]
        out.append(owner)
    return out


def staging(output_dir: str | Path, folder: Path) -> Path:
    """The hidden folder where every rank writes its files for checkpoint ``folder`` before it is sealed."""
    return Path(output_dir) / f".{folder.name}.shards"


def stage(where: Path, *, rank: int, world_size: int, step_tree: Any, opt_tree: Any) -> None:
    """Write this rank's two files into ``where`` (created by whichever rank comes first)."""
    where.mkdir(parents=True, exist_ok=True)
    step_file, opt_file = rank_files(rank, world_size)
    save_tree(where / step_file, step_tree)
    save_tree(where / opt_file, opt_tree)


def unstage(where: Path, into: Path, world_size: int) -> None:
    """Move every rank's files from ``where`` into the checkpoint's temporary folder ``into``; CheckpointError when
    a rank's files are missing."""
    expected = [name for rank in range(world_size) for name in rank_files(rank, world_size)]
    missing = [name for name in expected if not (where / name).is_file()]
    if missing:
        raise CheckpointError(f"{where} lacks {missing[:4]}: a rank did not write its part of the checkpoint.")
    for name in expected:
        os.replace(where / name, into / name)
    shutil.rmtree(where, ignore_errors=True)


def _check_shards(folder: Path, shards: Any) -> tuple[int, dict[str, list[str | None]]]:
    try:
        world, owners = int(shards["world_size"]), {k: list(shards["layout"][k]) for k in STATE_FILES}
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}/dp_state.json has an invalid 'shards' entry: {exc!r}") from None
    if world < 1:
        raise CheckpointError(f"{folder}/dp_state.json records a world size of {world}.")
    if not all(owner is None or isinstance(owner, str) for stem in owners for owner in owners[stem]):
        raise CheckpointError(f"{folder}/dp_state.json: its 'shards' layout names a parameter by something else.")
    return world, owners


def read(
    folder: Path,
    shards: Any,
    *,
    templates: tuple[Any, Any],
    shard: Shard | None,
    names: list[str],
    rank: int,
    world_size: int,
    device: Any,
) -> tuple[Any, Any]:
    """``(step tree, optimizer tree)`` of this rank from a sharded checkpoint ``folder`` (``shards``: its record in
    ``dp_state.json``), shaped like ``templates`` (this run's fresh trees). ``shard``: this rank's layout (None: one
    process, which reads the whole rows). CheckpointError when a file is damaged or the trees do not match."""
    saved_world, owners = _check_shards(folder, shards)
    if saved_world == world_size and shard is not None:  # the same layout: this rank's own files
        files = rank_files(rank, world_size)
        return tuple(  # type: ignore[return-value]
            load_tree(folder / name, template=template, device=device)
            for name, template in zip(files, templates, strict=True)
        )
    trees = []
    for k, (stem, template) in enumerate(zip(STATE_FILES, templates, strict=True)):
        parts = [load_tree(folder / rank_files(r, saved_world)[k], device="cpu") for r in range(saved_world)]
        trees.append(_reassembled(folder / stem, parts, owners[stem], template, shard, names, device))
    return trees[0], trees[1]


def _reassembled(
    where: Path,
    parts: list[Any],
    owners: list[str | None],
    template: Any,
    shard: Shard | None,
    names: list[str],
    device: Any,
) -> Any:
    """The tree of the reading rank from the saved ranks' trees: each parameter's rows concatenated over the ranks
    then cut to the reading rank's rows (all of them in one process); the other leaves, and what the structure
    holds besides leaves (step counters), from the first rank."""
    leaves_of = [optree.tree_leaves(part, namespace=NAMESPACE) for part in parts]
    wanted = optree.tree_leaves(template, namespace=NAMESPACE)
    treedef = optree.tree_structure(parts[0], namespace=NAMESPACE)
    if any(len(leaves) != len(wanted) for leaves in leaves_of) or len(owners) != len(wanted):
        raise CheckpointError(f"{where}: the saved ranks' states do not match this run's state (leaf counts differ).")
    rows = dict(zip(names, shard.ranges, strict=True)) if shard is not None else {}
    out = []
    for i, (owner, like) in enumerate(zip(owners, wanted, strict=True)):
        if owner is None:
            value = leaves_of[0][i]
        else:
            whole = torch.cat([leaves[i].reshape(-1) for leaves in leaves_of])
            if owner in rows:
                start, stop = rows[owner]
                whole = whole[start:stop]
            value = whole.view(like.shape) if whole.numel() == like.numel() else None
            if value is None:
                raise CheckpointError(
                    f"{where}: the rows saved for {owner!r} ({whole.numel()} values) do not fit this run's "
                    f"{tuple(like.shape)}: the checkpoint belongs to another model."
                )
        if isinstance(like, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
                raise CheckpointError(f"{where}: a saved leaf does not match this run's state ({tuple(like.shape)}).")
            value = value.to(device)
        out.append(value)
    return optree.tree_unflatten(treedef, out)
