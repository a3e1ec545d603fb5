"""The DP refusal rule, implemented once for every optimizer.

An optimizer built here accepts a :class:`~opake_core.tree.Noised` tree and unwraps its ``value``. It refuses
a :class:`~opake_core.tree.Clipped` tree that was not noised, and a plain tree of tensors unless it was built
with ``non_private=True``. It also labels every call for the profiler (``opake::optim.<name>``) and runs the
wrapped transformation out of place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
from torch.profiler import record_function

from opake_core.errors import ConfigurationError, InputTypeError
from opake_core.optim._apply import apply_updates
from opake_core.tree import Clipped, Noised, PerGroup, leaf_paths


class NoiseAwareTransformation(NamedTuple):
    """A torchopt-style pair whose ``update`` also takes ``noise_std``: a tree like ``updates`` whose leaves
    are the standard deviation (float, in the units of the updates) of the Gaussian noise in each leaf."""

    init: Any
    update: Any


def leaf_noise_std(value: Any, noise_std: float | PerGroup) -> Any:
    """A tree like ``value`` holding each leaf's noise standard deviation (float)."""
    paths = leaf_paths(value)
    if isinstance(noise_std, PerGroup):
        group_of, value_of = noise_std.group_of, noise_std.value_of
        missing = [p for p in paths if p not in group_of]
        if missing:
            raise InputTypeError(
                f"noise_std is per group, but leaves {missing[:5]} of the noised tree have no group; build "
                "the PerGroup from the same tree of parameters the gradients come from."
            )
        stds = [value_of[group_of[p]] for p in paths]
    else:
        stds = [float(noise_std)] * len(paths)
    return optree.tree_unflatten(optree.tree_structure(value), stds)


@dataclass(frozen=True)
class Optimizer:
    """A functional optimizer: ``init(params) -> state`` and ``update(updates, state, *, params=None) ->
    (updates, new_state)``; apply the result with :func:`opake_core.optim.apply_updates`.

    Attributes:
        name: the optimizer's name, used in messages and in the profiler label ``opake::optim.<name>``.
        transform: a torchopt ``GradientTransformation`` (or a :class:`NoiseAwareTransformation` when
            ``noise_aware``).
        non_private: accept plain trees of tensors (an explicitly non-private run).
        needs_params: ``update`` needs ``params`` (weight decay, parameter-scaled steps).
        noise_aware: pass each leaf's noise standard deviation to ``transform.update`` (0 for a plain tree).
        eval_fn: ``(state, params) -> weights`` for an optimizer whose trained parameters are not the weights
            to evaluate and publish (schedule-free: the averaged iterate ``x``); None for every other optimizer.
        in_place: ``transform`` honours ``inplace=True``: every transform in it writes the new state into the old
            state's tensors and the updates into its input updates' tensors, with the bits of the out-of-place
            computation, and returns no tensor of its state as updates. Other optimizers run out of place whatever
            :meth:`update` is asked.
        needs_whole_leaves: the update of an entry reads statistics over its whole leaf (Adafactor's row and column
            factors and per-leaf RMS, StableAdamW's per-tensor RMS), so it needs every entry of a weight: run on some
            rows of it (a rank's shard under FSDP) it computes another update. False: entry by entry, from the
            entry's own gradient, state and parameter and the leaf's scalars (its noise std, the step count).
        fused: None, or ``(gradient leaves, state, parameter leaves) -> new state or None``: the update applied to
            the parameters in one fused kernel, writing them and the state in place (None: it did not apply, and
            wrote nothing); used by :meth:`apply_in_place` (Adam and AdamW: :mod:`opake_core.optim._fused`).
    """

    name: str
    transform: Any
    non_private: bool
    needs_params: bool = False
    noise_aware: bool = False
    eval_fn: Any = None
    in_place: bool = False
    needs_whole_leaves: bool = False
    fused: Any = None

    def init(self, params: Any) -> Any:
        """The initial state for a tree of parameter tensors (moments shaped like the parameters)."""
        with record_function(f"opake::optim.{self.name}.init"):
            return self.transform.init(params)

    def update(self, updates: Any, state: Any, *, params: Any = None, inplace: bool = False) -> tuple[Any, Any]:
        """Transform noised gradients into parameter updates (to be added to the parameters).

        Args:
            updates: a :class:`~opake_core.tree.Noised` tree of gradients; a plain tree of tensors only when
                built with ``non_private=True``.
            state: the state from :meth:`init` or the previous ``update``; never modified unless ``inplace``.
            params: the current parameters (same tree as the gradients); needed for weight decay and by
                adafactor.
            inplace: the caller gives up ``updates`` and ``state`` (neither is read after the call): an optimizer
                built ``in_place`` writes the new state and the updates into their tensors instead of new ones
                (same values; no model-sized allocation). Ignored by the others.

        Returns:
            ``(updates, new_state)``: a plain tree of tensors shaped like the gradients, and the next state.

        Raises:
            InputTypeError: a clipped-but-not-noised tree, or a plain tree for a private optimizer.
            ConfigurationError: ``params`` missing where needed.
        """
        with record_function(f"opake::optim.{self.name}"):
            value, noise_std = self._unwrap(updates)
            if self.needs_params and params is None:
                raise ConfigurationError(
                    f"{self.name}.update needs params (weight decay or parameter scaling); call "
                    "update(updates, state, params=params)."
                )
            if self.noise_aware:
                stds = leaf_noise_std(value, noise_std)
                return self.transform.update(value, state, params=params, noise_std=stds)
            return self.transform.update(value, state, params=params, inplace=inplace and self.in_place)

    def apply_in_place(self, updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        """The donated step's update: ``(params, new_state)`` with the parameters moved in their own tensors, where
        their dtypes allow (as :func:`~opake_core.optim.apply_updates` with ``inplace=True``); ``updates`` and
        ``state`` are given up. By the optimizer's fused kernel where it has one and it applies (see ``fused``),
        else :meth:`update` with ``inplace=True`` and then :func:`~opake_core.optim.apply_updates`."""
        if self.fused is not None and self.in_place:
            with record_function(f"opake::optim.{self.name}"):
                value, _ = self._unwrap(updates)
                new_state = self.fused(optree.tree_leaves(value), state, optree.tree_leaves(params))
            if new_state is not None:
                return params, new_state
        steps, state = self.update(updates, state, params=params, inplace=True)
        return apply_updates(params, steps, inplace=True), state

    def eval_params(self, state: Any, params: Any) -> Any:
        """The weights to evaluate and publish, given the optimizer ``state`` and the trained ``params``.

        ``params`` itself (the same tree) for every optimizer but the schedule-free one, whose training
        parameters are its interpolation sequence ``y`` and whose published weights are the average ``x``
        (:func:`opake_core.optim.schedule_free_adamw`). Pure: neither input is modified.
        """
        if self.eval_fn is None:
            return params
        with record_function(f"opake::optim.{self.name}.eval_params"):
            return self.eval_fn(state, params)

    def _unwrap(self, updates: Any) -> tuple[Any, float | PerGroup]:
        if isinstance(updates, Noised):
            return updates.value, updates.noise_std
        if isinstance(updates, Clipped):
            raise InputTypeError(
                f"{self.name}.update received a Clipped tree (sensitivity {updates.sensitivity}) that is "
                "clipped but not noised: pass it through opake_core.noise.gaussian_noise first; use "
                "noise_multiplier=0 for an explicitly non-private run."
            )
        if not self.non_private:
            raise InputTypeError(
                f"{self.name}.update received a plain {type(updates).__name__}, not a Noised tree: pass "
                "clipped gradients through opake_core.noise.gaussian_noise first, or build the optimizer "
                "with non_private=True for an explicitly non-private run."
            )
        return updates, 0.0
