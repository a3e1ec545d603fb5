"""Guards on a privacy budget that depend on the dataset size.

Delta is the probability that the guarantee fails outright. The mechanism that publishes one uniformly chosen
record in the clear is ``(0, 1/N)``-DP on ``N`` records, so a delta of ``1/N`` or more allows exactly such a leak
and certifies nothing about any one person. :func:`check_delta` refuses it unless the caller overrides explicitly,
and warns above ``1/(10 N)``, where the failure probability is still a sizeable fraction of "one record leaks".
The usual choice, and the trainer's default, is ``1 / N**1.1``.
"""

from __future__ import annotations

import warnings

from opake_core import validate
from opake_core.errors import PrivacyBudgetError

__all__ = ["check_delta"]


def check_delta(delta: float, *, dataset_size: int, allow_large: bool = False) -> float:
    """``delta`` checked against ``1/dataset_size``: PrivacyBudgetError at or above it (unless ``allow_large``),
    a warning above ``1/(10 dataset_size)``; returns it as a float.

    Example:

        >>> from opake_core import PrivacyBudgetError, accounting
        >>> accounting.check_delta(1e-6, dataset_size=10_000)
        1e-06
        >>> try:
        ...     accounting.check_delta(1e-3, dataset_size=10_000)  # one record in the clear would satisfy it
        ... except PrivacyBudgetError:
        ...     print("refused")
        refused
    """
    value = validate.delta("delta", delta)
    n = validate.integer("dataset_size", dataset_size, minimum=1)
    if value >= 1 / n and not allow_large:
        raise PrivacyBudgetError(
            f"delta={value:.3g} is >= 1/N = {1 / n:.3g} for N={n} records: at that delta, publishing one random "
            f"record in the clear satisfies the guarantee. Use delta < 1/N (the default is 1/N**1.1 = "
            f"{n**-1.1:.3g}), or set the explicit override (privacy_allow_large_delta=True, --allow-large-delta) "
            "if you accept that."
        )
    if value > 1 / (10 * n):
        warnings.warn(
            f"delta={value:.3g} is above 1/(10 N) = {1 / (10 * n):.3g} for N={n} records: the guarantee fails with "
            f"a probability close to that of leaking one record. The usual choice is 1/N**1.1 = {n**-1.1:.3g}.",
            stacklevel=2,
        )
    return value
