"""The explicit state of a sampler: how many steps were drawn, and the configuration that drew them.

A state is a frozen value; ``sample(key, state)`` returns a new one. ``to_json``/``from_json`` give plain
dicts, and a sampler refuses (StateError) a state made by another configuration or for another dataset size,
so a resumed run continues the identical sequence or fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opake_core.errors import StateError

__all__ = ["SamplerState", "check_state"]


@dataclass(frozen=True)
class SamplerState:
    """``step``: the number of batches drawn so far; ``config``: the sampler's public configuration."""

    step: int
    config: tuple[tuple[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "config": dict(self.config)}

    @staticmethod
    def from_json(obj: Any) -> SamplerState:
        if not isinstance(obj, dict) or set(obj) != {"step", "config"} or not isinstance(obj["config"], dict):
            raise StateError(f"a sampler state is {{'step': int, 'config': dict}}, got {str(obj)[:200]!r}.")
        step = obj["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"a sampler state needs an int step >= 0, got {step!r}.")
        return SamplerState(step, tuple(sorted(obj["config"].items())))


def check_state(state: Any, config: tuple[tuple[str, Any], ...]) -> SamplerState:
    """``state`` if it belongs to a sampler with ``config``; StateError naming the differences otherwise."""
    if isinstance(state, dict):
        state = SamplerState.from_json(state)
    if not isinstance(state, SamplerState):
        raise StateError(f"expected a SamplerState (from sampler.init()), got {type(state).__name__}.")
    if state.config != config:
        ours, theirs = dict(config), dict(state.config)
        diff = {
            k: (theirs.get(k), ours.get(k)) for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)
        }
        raise StateError(
            f"this state was made by another sampler configuration; (state, sampler) values differ: {diff}. "
            "Resume with the sampler (and dataset size) that produced the state, or start from "
            "sampler.init()."
        )
    return state
