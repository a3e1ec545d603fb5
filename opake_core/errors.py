"""The error hierarchy of Opake.

Every refusal in the library raises one of these. The classes also derive from the matching builtin exception
(``ValueError``, ``TypeError``, ``RuntimeError``) so that generic handlers keep working. A message says what was
wrong, the value seen, and what to do instead.
"""

from __future__ import annotations

__all__ = [
    "CalibrationError",
    "CheckpointError",
    "ConfigurationError",
    "InputTypeError",
    "OpakeError",
    "PrivacyBudgetError",
    "StateError",
    "VmapCompatibilityError",
]


class OpakeError(Exception):
    """Root of every error Opake raises on purpose."""


class ConfigurationError(OpakeError, ValueError):
    """A parameter or a combination of parameters is invalid."""


class PrivacyBudgetError(ConfigurationError):
    """A privacy budget is invalid, unreachable, or already spent."""


class CalibrationError(PrivacyBudgetError):
    """Noise or step calibration cannot reach its target inside the allowed bounds."""


class InputTypeError(OpakeError, TypeError):
    """A value of the wrong type reached a function: for example an unclipped tree passed to a noise mechanism."""


class StateError(OpakeError, RuntimeError):
    """A state cannot be used: it does not match its template, was produced by another configuration, or ran out."""


class CheckpointError(StateError):
    """A checkpoint is incomplete, of an unsupported version, or does not match the run that resumes it."""


class VmapCompatibilityError(OpakeError, RuntimeError):
    """A loss function cannot run under ``torch.func.vmap``: in-place operations or data-dependent branches."""
