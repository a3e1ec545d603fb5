"""Pytrees that carry privacy metadata, and per-group values.

* :class:`Clipped` wraps a tree of clipped, summed gradients with its L2 ``sensitivity``: the most the tree can move
  when one example is added or removed (the clipping bound divided by the public normalizer).
* :class:`Noised` is a clipped tree that went through a noise mechanism; it also records the noise standard deviation.
* :class:`PerGroup` assigns every leaf to a named group and holds one value per group (per-group clipping bounds,
  sensitivities and noise standard deviations).

Leaves are addressed by their *path*: the keys from the root joined with dots (``"encoder.layer.0.weight"``), so a
flat ``dict(model.named_parameters())`` and the equivalent nested dict give the same paths.

Noise mechanisms accept only :class:`Clipped` trees; optimizers accept only :class:`Noised` ones. Both wrappers are
registered with optree in the ``"opake"`` namespace (``optree.tree_map(f, tree, namespace="opake")`` sees through
them and keeps the metadata).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optree
import torch

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = [
    "NAMESPACE",
    "Clipped",
    "Noised",
    "PerGroup",
    "effective",
    "leaf_paths",
    "per_group",
]

FALLBACK = "fallback"
NAMESPACE = "opake"


def size_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """The indices of ``sizes`` (leaves' element counts) in consecutive groups whose sizes sum to at most ``limit``
    (a larger one alone): the unit in which model-sized work is done a part at a time."""
    groups: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not groups or used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


def writable(leaves: list[torch.Tensor]) -> list[bool]:
    """Which leaves an in-place operation may write: contiguous (no zero-stride stand-in), non-empty, and sharing no
    memory with another leaf of the list (writing one would change the other's value)."""
    spans = []
    for i, leaf in enumerate(leaves):
        if leaf.numel():
            extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(leaf.shape, leaf.stride(), strict=True))
            spans.append((leaf.data_ptr(), leaf.data_ptr() + extent * leaf.element_size(), i))
    shared, end, owner = set(), -1, -1
    for start, stop, i in sorted(spans):
        if start < end:
            shared |= {i, owner}
        if stop > end:
            end, owner = stop, i
    return [leaf.is_contiguous() and leaf.numel() > 0 and i not in shared for i, leaf in enumerate(leaves)]


def leaf_paths(tree: Any) -> list[str]:
    """The dotted path of every leaf of ``tree``, in optree's flattening order."""
    paths, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    return [".".join(str(part) for part in path) for path in paths]


@dataclass(frozen=True)
class PerGroup:
    """One value per group of leaves.

    Attributes:
        groups: ``(leaf path, group name)`` pairs, one per tensor leaf, in flattening order.
        values: ``(group name, value)`` pairs, sorted by group name.

    Example (build one with :func:`per_group`, or directly):

        >>> from opake_core import PerGroup
        >>> bounds = PerGroup.build({"w": "body", "b": "head"}, {"body": 3.0, "head": 4.0})
        >>> bounds.leaf_values(), bounds.effective  # the joint bound is the L2 combination
        ([3.0, 4.0], 5.0)
    """

    groups: tuple[tuple[str, str], ...]
    values: tuple[tuple[str, float], ...]

    def __post_init__(self) -> None:
        names = {name for name, _ in self.values}
        missing = sorted({g for _, g in self.groups} - names)
        if missing:
            raise ConfigurationError(f"PerGroup assigns leaves to groups without a value: {missing}.")

    @classmethod
    def build(cls, groups: Mapping[str, str], values: Mapping[str, float]) -> PerGroup:
        """A PerGroup from a ``{leaf path: group}`` and a ``{group: value}`` mapping."""
        return cls(tuple(groups.items()), tuple(sorted((k, float(v)) for k, v in values.items())))

    @property
    def group_of(self) -> dict[str, str]:
        """``{leaf path: group name}``."""
        return dict(self.groups)

    @property
    def value_of(self) -> dict[str, float]:
        """``{group name: value}``."""
        return dict(self.values)

    @property
    def num_groups(self) -> int:
        return len(self.values)

    @property
    def effective(self) -> float:
        """The L2 combination ``sqrt(sum of squared values)``: the joint sensitivity of per-group bounds."""
        return math.sqrt(sum(v * v for _, v in self.values))

    def map(self, fn: Callable[[float], float]) -> PerGroup:
        """The same groups with ``fn`` applied to every value."""
        return PerGroup(self.groups, tuple((k, float(fn(v))) for k, v in self.values))

    def leaf_values(self) -> list[float]:
        """The value of each leaf's group, in leaf order."""
        value_of = self.value_of
        return [value_of[g] for _, g in self.groups]


def effective(value: float | PerGroup) -> float:
    """A scalar for a scalar, the L2 combination for a :class:`PerGroup`."""
    return value.effective if isinstance(value, PerGroup) else float(value)


@dataclass(frozen=True)
class Clipped:
    """A tree of clipped and summed values together with its L2 sensitivity.

    Attributes:
        value: the tree of tensors.
        sensitivity: the L2 sensitivity of ``value`` under adding or removing one example (a float, or a
            :class:`PerGroup` of per-group sensitivities).

    Example: :func:`~opake_core.clipping.clipped_grad` returns one; noise takes it and nothing else.

        >>> import torch
        >>> from opake_core import Clipped, gaussian_noise, random
        >>> clipped = Clipped({"w": torch.zeros(3)}, sensitivity=0.5)
        >>> noise_fn, state = gaussian_noise(noise_multiplier=2.0, key=random.key(0))
        >>> noised, state = noise_fn(clipped, state)
        >>> noised.noise_std  # noise multiplier times sensitivity
        1.0
    """

    value: Any
    sensitivity: float | PerGroup

    def __post_init__(self) -> None:
        _check_sensitivity(self.sensitivity, "sensitivity")


@dataclass(frozen=True)
class Noised(Clipped):
    """A clipped tree with Gaussian noise of standard deviation ``noise_std`` (a float or :class:`PerGroup`) added.

    Example: a noise mechanism returns one; the optimizers take it and refuse a clipped tree that was not noised.

        >>> import torch
        >>> from opake_core import Clipped, Noised, InputTypeError, optim
        >>> params = {"w": torch.ones(2)}
        >>> sgd = optim.sgd(lr=0.5)
        >>> updates, _ = sgd.update(Noised({"w": torch.ones(2)}, 1.0, noise_std=1.0), sgd.init(params))
        >>> updates["w"]
        tensor([-0.5000, -0.5000])
        >>> try:
        ...     sgd.update(Clipped({"w": torch.ones(2)}, 1.0), sgd.init(params))
        ... except InputTypeError:
        ...     print("refused")
        refused
    """

    noise_std: float | PerGroup = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_sensitivity(self.noise_std, "noise_std")


def _check_sensitivity(value: Any, name: str) -> None:
    scalars = value.leaf_values() if isinstance(value, PerGroup) else [value]
    for v in scalars:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise InputTypeError(f"{name} must be a float or PerGroup, got {type(v).__name__} {v!r}.")
        if not v >= 0:  # also refuses NaN
            raise ConfigurationError(f"{name} must be non-negative, got {v!r}.")


optree.register_pytree_node(
    Clipped,
    lambda c: ((c.value,), c.sensitivity, None),
    lambda sensitivity, children: Clipped(children[0], sensitivity),
    namespace=NAMESPACE,
)
optree.register_pytree_node(
    Noised,
    lambda n: ((n.value,), (n.sensitivity, n.noise_std), None),
    lambda meta, children: Noised(children[0], meta[0], meta[1]),
    namespace=NAMESPACE,
)


def _tensor_leaves(params: Any, where: str) -> tuple[list[str], list[torch.Tensor]]:
    paths, leaves, _ = optree.tree_flatten_with_path(params, none_is_leaf=False)
    names = [".".join(str(part) for part in path) for path in paths]
    for name, leaf in zip(names, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(f"{where} needs a tree of tensors; leaf {name!r} is a {type(leaf).__name__}.")
    if not leaves:
        raise ConfigurationError(f"{where} needs at least one tensor leaf, got an empty tree.")
    return names, leaves


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputTypeError(f"{what} must be a number, got {type(value).__name__} {value!r}.")
    if not value > 0:
        raise ConfigurationError(f"{what} must be positive, got {value!r}.")
    return float(value)


def per_group(
    params: Any,
    patterns: Mapping[str, float] | None = None,
    *,
    fallback: float | None = None,
    allow_unused_patterns: bool = False,
) -> PerGroup:
    """Assign every tensor leaf of ``params`` to a group by regular expressions on its dotted path.

    Args:
        params: a tree of tensors (for example ``dict(model.named_parameters())``).
        patterns: ``{regex: value}``; a leaf belongs to the group of the one pattern that ``re.search``-matches its
            path. The group is named after the pattern.
        fallback: value of the group ``"fallback"`` that collects leaves no pattern matches.
        allow_unused_patterns: accept patterns that match no leaf (an error otherwise, to catch typos).

    Returns:
        A :class:`PerGroup` whose values are the patterns' values (for example per-group clipping bounds).

    Raises:
        ConfigurationError: no pattern and no fallback; a value that is not positive; a leaf that matches several
            patterns, or none without a fallback; a pattern that matches nothing (unless allowed); an invalid regex.

    Example: bound the biases at 0.1 and every other parameter at 1.0.

        >>> import torch
        >>> from opake_core import per_group
        >>> params = {"layer.weight": torch.zeros(4, 3), "layer.bias": torch.zeros(4)}
        >>> bounds = per_group(params, {r"bias$": 0.1}, fallback=1.0)
        >>> bounds.group_of["layer.bias"], bounds.group_of["layer.weight"]
        ('bias$', 'fallback')
        >>> round(bounds.effective, 4)  # sqrt(0.1^2 + 1^2), the joint bound
        1.005
    """
    patterns = dict(patterns or {})
    if not patterns and fallback is None:
        raise ConfigurationError("per_group needs at least one pattern or a fallback value.")
    if FALLBACK in patterns:
        if fallback is not None:
            raise ConfigurationError("give the fallback either as patterns['fallback'] or as fallback=, not both.")
        fallback = patterns.pop(FALLBACK)
    values = {p: _positive(v, f"per-group value for {p!r}") for p, v in patterns.items()}
    if fallback is not None:
        values[FALLBACK] = _positive(fallback, "fallback")
    try:
        compiled = {p: re.compile(p) for p in patterns}
    except re.error as exc:
        raise ConfigurationError(f"per_group pattern is not a valid regular expression: {exc}.") from exc
    names, _ = _tensor_leaves(params, "per_group")
    groups: dict[str, str] = {}
    used: set[str] = set()
    for name in names:
        hits = [p for p, rx in compiled.items() if rx.search(name)]
        if len(hits) > 1:
            raise ConfigurationError(
                f"parameter {name!r} matched multiple patterns {hits}; each parameter must match exactly one."
            )
        if not hits and fallback is None:
            raise ConfigurationError(
                f"parameter {name!r} did not match any pattern of {sorted(patterns)}; "
                "add a pattern or fallback=<bound>."
            )
        group = hits[0] if hits else FALLBACK
        used.add(group)
        groups[name] = group
    unused = sorted(set(patterns) - used)
    if unused and not allow_unused_patterns:
        raise ConfigurationError(
            f"patterns did not match any parameter: {unused}. Sample parameter paths: {names[:5]}. "
            "Fix the patterns or pass allow_unused_patterns=True."
        )
    return PerGroup.build(groups, {g: v for g, v in values.items() if g in used})
