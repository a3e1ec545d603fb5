"""The ledger: what a run actually released, in order, and the epsilon of exactly that.

A training run can be resumed with other settings, or trained twice, so the privacy it spent is a property of its
history, not of its current arguments. A :class:`Ledger` is that history: an ordered tuple of ``(process, count)``
entries, each a per-step process (``poisson(gaussian(z), q)``, ...) repeated ``count`` times, or one whole-horizon
process (DP-FTRL, k-out-of-t) recorded once. Its :meth:`~Ledger.process` is

    compose(repeat(p_1, n_1), repeat(p_2, n_2), ...)

so its epsilon is that of a fresh accountant fed the same per-step history of (mechanism, multiplier, rate). A
ledger is a frozen value: :meth:`~Ledger.record` returns a new one, merging a step into the last entry when the
process is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opake_core import validate
from opake_core.accounting.processes import Process, compose, repeat
from opake_core.accounting.queries import Result, epsilon
from opake_core.accounting.serialization import _build, _node, library_versions
from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["LEDGER_FORMAT", "Ledger"]

LEDGER_FORMAT = "opake.accounting.ledger/1"


@dataclass(frozen=True)
class Ledger:
    """The releases of a run: ``entries[i] = (process, count)``, oldest first (see the module docstring).

    Example: 600 steps, then 400 more with more noise after a resume; the ledger's epsilon is that of the whole
    history, and it survives a round trip through JSON.

        >>> from opake_core import accounting
        >>> ledger = accounting.Ledger().record(accounting.poisson(accounting.gaussian(1.0), 0.01), 600)
        >>> ledger = ledger.record(accounting.poisson(accounting.gaussian(3.0), 0.01), 400)
        >>> ledger.releases, len(ledger.entries)
        (1000, 2)
        >>> history = accounting.compose(accounting.repeat(accounting.poisson(accounting.gaussian(1.0), 0.01), 600),
        ...                               accounting.repeat(accounting.poisson(accounting.gaussian(3.0), 0.01), 400))
        >>> ledger.epsilon(delta=1e-5, accountant="rdp") == accounting.epsilon(history, delta=1e-5, accountant="rdp")
        True
        >>> accounting.Ledger.from_json(ledger.to_json()) == ledger
        True
    """

    entries: tuple[tuple[Any, int], ...] = ()

    def __post_init__(self) -> None:
        for entry in self.entries:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise InputTypeError(f"a ledger entry is a (process, count) pair, got {entry!r}.")
            validate.integer("count", entry[1], minimum=1)

    def record(self, process: Any, count: int = 1) -> Ledger:
        """The ledger after ``count`` more releases of ``process`` (merged into the last entry when equal)."""
        count = validate.integer("count", count, minimum=1)
        _node(process)  # refuses anything that is not a process
        if self.entries and self.entries[-1][0] == process:
            last, n = self.entries[-1]
            return Ledger((*self.entries[:-1], (last, n + count)))
        return Ledger((*self.entries, (process, count)))

    @property
    def releases(self) -> int:
        """How many releases were recorded (steps, for per-step processes)."""
        return sum(count for _, count in self.entries)

    def process(self) -> Process | None:
        """The composition of the whole history (None for an empty ledger)."""
        if not self.entries:
            return None
        parts = [p if n == 1 else repeat(p, n) for p, n in self.entries]
        return parts[0] if len(parts) == 1 else compose(*parts)  # a whole-horizon MF process composes with nothing

    def epsilon(self, *, delta: float, **query: Any) -> Result:
        """Epsilon of the whole history at ``delta`` (0 for an empty ledger, inf if any release was noise-free)."""
        process = self.process()
        if process is None:
            return Result(0.0, "none")
        try:
            return epsilon(process, delta=delta, **query)
        except ConfigurationError as exc:
            raise ConfigurationError(
                f"this history cannot be accounted as one composition ({exc}) A whole-horizon process (DP-FTRL "
                "with a Monte Carlo accountant, k-out-of-t) composes with nothing else: run it as its own ledger."
            ) from exc

    def to_json(self) -> dict[str, Any]:
        """``{"format": ..., "entries": [{"process": <node>, "count": n}, ...], "versions": {...}}``."""
        entries = [{"process": _node(p), "count": n} for p, n in self.entries]
        return {"format": LEDGER_FORMAT, "entries": entries, "versions": library_versions()}

    @staticmethod
    def from_json(obj: Any) -> Ledger:
        """The ledger of a dict made by :meth:`to_json`; every node is rebuilt and validated like user input."""
        if not isinstance(obj, dict) or obj.get("format") != LEDGER_FORMAT or not isinstance(obj.get("entries"), list):
            raise ConfigurationError(
                f"a ledger document has format {LEDGER_FORMAT!r} and a list of entries, got {str(obj)[:200]!r}."
            )
        entries = []
        for item in obj["entries"]:
            if not isinstance(item, dict) or set(item) != {"process", "count"}:
                raise ConfigurationError(f"a ledger entry is {{'process': ..., 'count': n}}, got {str(item)[:200]!r}.")
            entries.append((_build(item["process"]), item["count"]))
        return Ledger(tuple(entries))
