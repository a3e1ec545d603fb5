"""One rank's part of a tree sharded over ranks: :class:`Shard`.

A sharded model (FSDP2) keeps on each rank a piece of every parameter. A :class:`Shard` says which: the global shape
of every leaf, in optree leaf order, and for each leaf the range ``(start, stop)`` of its row-major flattening that
the rank holds. Ranges are whole rows of dim 0, so a local piece is a tensor of shape ``(rows, *shape[1:])``.
:meth:`Shard.rows` gives FSDP2's layout; the noise mechanisms take a ``Shard`` to draw exactly the rank's
coordinates of the one-process noise (:func:`opake_core.random.normal_tree_shard`), and their streaming buffers
then hold only the rank's rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opake_core import validate
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["Shard"]


@dataclass(frozen=True)
class Shard:
    """The part of a tree of tensors that one rank holds: whole rows of dim 0 of every leaf.

    Attributes:
        shapes: the global shape of every leaf, in optree leaf order (tuples of ints; ``torch.Size`` is accepted).
        ranges: for each leaf, the range ``(start, stop)`` of its row-major flattening held here: ints with
            ``0 <= start <= stop <= size`` and both multiples of the size of one dim-0 row (a 0-d leaf: ``(0, 1)``
            held, ``(0, 0)`` not).

    Example: the second of two ranks holds the last 2 rows of a (5, 3) leaf and none of a scalar.

        >>> from opake_core import Shard
        >>> shard = Shard.rows([(5, 3), ()], rank=1, world_size=2)
        >>> shard.ranges, shard.local_shapes
        (((9, 15), (0, 0)), ((2, 3), (0,)))
        >>> Shard([(5, 3), ()], [(9, 15), (0, 0)]) == shard  # the same shard, spelled out
        True
    """

    shapes: tuple[tuple[int, ...], ...]
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        shapes = tuple(_shape(i, s) for i, s in enumerate(_sequence("shapes", self.shapes)))
        ranges = _sequence("ranges", self.ranges)
        if len(ranges) != len(shapes):
            raise ConfigurationError(
                f"Shard needs one (start, stop) range per leaf shape, got {len(shapes)} shapes and {len(ranges)} "
                "ranges; build it with Shard.rows(shapes, rank=..., world_size=...)."
            )
        object.__setattr__(self, "shapes", shapes)
        checked = tuple(_range(i, s, r) for i, (s, r) in enumerate(zip(shapes, ranges, strict=True)))
        object.__setattr__(self, "ranges", checked)

    @classmethod
    def rows(cls, shapes: Sequence[Sequence[int]], *, rank: int, world_size: int) -> Shard:
        """The shard of rank ``rank`` of ``world_size`` in FSDP2's layout: every leaf cut along dim 0 as
        ``torch.chunk`` does, ``chunk = ceil(d0 / world_size)`` rows, rank ``r`` holding rows
        ``[r * chunk, min((r + 1) * chunk, d0))`` (none for the trailing ranks past ``d0``); a 0-d leaf is held whole
        by rank 0.

        Example: 7 rows over 3 ranks are 3, 3 and 1 rows.

            >>> from opake_core import Shard
            >>> [Shard.rows([(7,)], rank=r, world_size=3).local_shapes for r in range(3)]
            [((3,),), ((3,),), ((1,),)]
        """
        world = validate.integer("world_size", world_size, minimum=1)
        rank = validate.integer("rank", rank, minimum=0)
        if rank >= world:
            raise ConfigurationError(f"rank must be in [0, world_size={world}), got {rank}.")
        shapes = tuple(_shape(i, s) for i, s in enumerate(_sequence("shapes", shapes)))
        ranges = []
        for shape in shapes:
            if not shape:
                ranges.append((0, 1) if rank == 0 else (0, 0))
                continue
            chunk, row = -(-shape[0] // world), math.prod(shape[1:])
            first, last = min(rank * chunk, shape[0]), min((rank + 1) * chunk, shape[0])
            ranges.append((first * row, last * row))
        return cls(shapes, tuple(ranges))

    @property
    def local_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each leaf's local piece: ``((stop - start) // row, *shape[1:])``; for a 0-d leaf ``()`` where
        held and ``(0,)`` (an empty vector) where not."""
        out = []
        for shape, (start, stop) in zip(self.shapes, self.ranges, strict=True):
            if not shape:
                out.append(() if stop > start else (0,))
            else:
                out.append(((stop - start) // math.prod(shape[1:]), *shape[1:]))
        return tuple(out)


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InputTypeError(f"Shard's {name} must be a sequence with one entry per leaf, got {value!r:.80}.")
    return tuple(value)


def _shape(index: int, shape: Any) -> tuple[int, ...]:
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence):
        raise InputTypeError(f"Shard: shapes[{index}] must be a tuple of ints, got {shape!r:.80}.")
    dims = tuple(validate.integer(f"shapes[{index}] dims", d, minimum=0) for d in shape)
    if dims and dims[0] and not math.prod(dims[1:]):
        raise ConfigurationError(
            f"Shard: leaf {index} of shape {dims} has {dims[0]} empty rows, which a flat range cannot place; leave "
            "such an empty tensor out of the tree."
        )
    return dims


def _range(index: int, shape: tuple[int, ...], leaf_range: Any) -> tuple[int, int]:
    if isinstance(leaf_range, str | bytes) or not isinstance(leaf_range, Sequence) or len(leaf_range) != 2:
        raise InputTypeError(f"Shard: ranges[{index}] must be a (start, stop) pair, got {leaf_range!r:.80}.")
    start = validate.integer(f"ranges[{index}] start", leaf_range[0], minimum=0)
    stop = validate.integer(f"ranges[{index}] stop", leaf_range[1], minimum=0)
    size = math.prod(shape)
    if not start <= stop <= size:
        raise ConfigurationError(
            f"Shard: ranges[{index}] = ({start}, {stop}) must satisfy 0 <= start <= stop <= {size}, the size of "
            f"leaf {index} of shape {shape}."
        )
    row = math.prod(shape[1:]) if shape else 1
    if start % row or stop % row:
        raise ConfigurationError(
            f"Shard: ranges[{index}] = ({start}, {stop}) cuts a row of leaf {index} of shape {shape}; a shard holds "
            f"whole dim-0 rows, so start and stop must be multiples of the row size {row}."
        )
    return start, stop
