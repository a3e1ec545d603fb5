"""The explicit state of a sampler: how many steps were drawn, and the configuration that drew them.

A state is a frozen value; ``sample(key, state)`` returns a new one, holding everything the next draw needs.
``to_json``/``from_json`` give plain dicts, and a sampler refuses (StateError) a state made by another configuration
or for another dataset size, so a resumed run continues the identical sequence or fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opake_core.errors import StateError

__all__ = ["SamplerState", "check_state"]


@dataclass(frozen=True)
class SamplerState:
    """``step``: the number of batches drawn so far; ``config``: the sampler's public configuration; ``carry``: what
    a sampler with memory needs to draw the next batch (b-min-sep's cooldowns), as a base64 string, else None.

    Example: a state goes to JSON and back, and only a sampler of the same configuration accepts it.

        >>> from opake_core import StateError, random, sampling
        >>> sampler = sampling.poisson(dataset_size=1_000, sample_rate=0.05)
        >>> _, state = sampler.sample(random.key(0), sampler.init())
        >>> saved = state.to_json()
        >>> saved["step"], sampling.SamplerState.from_json(saved) == state
        (1, True)
        >>> try:
        ...     sampling.poisson(dataset_size=999, sample_rate=0.05).sample(random.key(0), state)
        ... except StateError:
        ...     print("refused: another dataset size")
        refused: another dataset size
    """

    step: int
    config: tuple[tuple[str, Any], ...]
    carry: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"step": self.step, "config": dict(self.config)}
        return out if self.carry is None else {**out, "carry": self.carry}

    @staticmethod
    def from_json(obj: Any) -> SamplerState:
        if (
            not isinstance(obj, dict)
            or not {"step", "config"} <= set(obj) <= {"step", "config", "carry"}
            or not isinstance(obj["config"], dict)
        ):
            raise StateError(
                f"a sampler state is {{'step': int, 'config': dict[, 'carry': str]}}, got {str(obj)[:200]!r}."
            )
        step, carry = obj["step"], obj.get("carry")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"a sampler state needs an int step >= 0, got {step!r}.")
        if carry is not None and not isinstance(carry, str):
            raise StateError(f"a sampler state's carry is a base64 string, got {type(carry).__name__}.")
        return SamplerState(step, tuple(sorted(obj["config"].items())), carry)


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
