"""Microbatch sizing: retry a logical batch with a smaller vmap chunk after a CUDA out-of-memory error.

The chunk size (``microbatch_size``) only changes how many examples ``vmap(grad)`` processes at once; the clipped
sum does not depend on it beyond float summation order (:func:`opake_core.clipping.clipped_grad`). Retrying the
**same** logical batch (same sampled indices, same noise key and step) with a smaller chunk therefore releases
exactly what a run configured with the smaller chunk would have released: the retry is privacy-neutral. What must
never happen is resampling the batch or redrawing the noise after a failure, which would leak through the retry;
the caller guarantees it by passing a closure over one batch and one step state.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from opake_core.errors import ConfigurationError

__all__ = ["ShrinkingStep", "is_out_of_memory", "retry_eval_batch", "run_with_oom_retry"]

T = TypeVar("T")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA (or other accelerator) out-of-memory error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_size(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}.")
    return value


class ShrinkingStep:
    """A DP step function whose vmap chunk halves after an out-of-memory error, rerunning the same inputs (batch,
    step state, keys: privacy-neutral, see the module docstring); the chunk that fit is kept for later steps.

    ``make_step(microbatch_size) -> (step_fn, dp_state)`` builds the step for a chunk size; ``step_fn`` is the one
    already built for ``microbatch_size`` (None: the whole batch as one chunk).
    """

    def __init__(self, make_step: Callable[[int | None], tuple[Any, Any]], step_fn: Any, microbatch_size: int | None):
        self.microbatch_size = microbatch_size
        self._make_step, self._first, self._steps = make_step, step_fn, {}

    def __call__(self, inputs: tuple[Any, ...], batch_size: int) -> tuple[Any, int | None]:
        """``(step_fn(*inputs), the smaller chunk it converged to or None)`` for a batch of ``batch_size``."""
        current = self.microbatch_size or batch_size

        def attempt(chunk: int) -> Any:
            if chunk == current and self._first is not None:
                return self._first(*inputs)
            if chunk not in self._steps:
                self._steps[chunk] = self._make_step(chunk)[0]
            return self._steps[chunk](*inputs)

        outputs, chunk = run_with_oom_retry(attempt, microbatch_size=current, batch_size=batch_size)
        if chunk >= current:
            return outputs, None
        self.microbatch_size, self._first = chunk, self._steps[chunk]
        return outputs, chunk


def run_with_oom_retry(
    step: Callable[[int], T],
    *,
    microbatch_size: int,
    batch_size: int,
    on_shrink: Callable[[int, int], None] | None = None,
) -> tuple[T, int]:
    """Run ``step(chunk)``, halving ``chunk`` after each out-of-memory error; returns ``(result, chunk)``.

    Args:
        step: runs the **same** logical step with vmap chunks of the given size (rebuild the step function for the
            chunk, reuse the batch, the noise key and the step state). It must not have mutated any state when it
            raises (the core step functions are pure).
        microbatch_size: the first chunk size to try; chunks start at ``min(microbatch_size, batch_size)``.
        batch_size: the realized batch size (0 is allowed: an empty batch is still a step).
        on_shrink: ``on_shrink(old, new)`` after each halving (for a warning or a log line).

    Returns:
        The step's result and the chunk size that succeeded: pass it as ``microbatch_size`` to later steps, so
        the search happens once per run, not once per step.

    Raises:
        ConfigurationError: when the step runs out of memory with a chunk of 1 (the original error is chained).
    """
    chunk = max(1, min(_check_size(microbatch_size, "microbatch_size"), max(batch_size, 1)))
    while True:
        try:
            return step(chunk), chunk
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            if chunk == 1:
                raise ConfigurationError(
                    "out of memory with microbatch_size=1: one example's per-example gradient does not fit. Enable "
                    "gradient_checkpointing, bf16, LoRA, or lower max_length."
                ) from exc
        # the failed attempt's tensors are released only after leaving the except block
        _release_memory()
        new = max(1, chunk // 2)
        if on_shrink is not None:
            on_shrink(chunk, new)
        chunk = new


def retry_eval_batch(
    evaluate: Callable[[int, int], T],
    *,
    start: int,
    stop: int,
    batch_size: int,
    on_shrink: Callable[[int, int], None] | None = None,
) -> tuple[list[T], int]:
    """Evaluate examples ``[start, stop)`` in sub-batches of ``batch_size``, halving it on out-of-memory errors.

    ``evaluate(lo, hi)`` evaluates examples ``[lo, hi)`` and returns its piece of the result. Evaluation releases
    nothing private, so the only requirement is that every example is evaluated exactly once: a failed sub-batch is
    retried from its own start, and finished pieces are kept. Returns the pieces in order and the batch size that
    worked last.
    """
    size = _check_size(batch_size, "batch_size")
    pieces: list[T] = []
    lo = start
    while lo < stop:
        hi = min(lo + size, stop)
        try:
            pieces.append(evaluate(lo, hi))
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            if size == 1:
                raise ConfigurationError(
                    "out of memory evaluating one example; lower max_length or set bf16_full_eval=True."
                ) from exc
        else:
            lo = hi
            continue
        _release_memory()
        new = max(1, size // 2)
        if on_shrink is not None:
            on_shrink(size, new)
        size = new
    return pieces, size
