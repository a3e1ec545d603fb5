"""Per-example gradient clipping: :func:`clipped_grad`.

Modules, one concept each:

* :mod:`~opake_core.clipping.rules`: the rules (a fixed or per-group bound, :func:`auto_s`, :func:`adaptive`), their
  states and sensitivities, and the clipped sum of one chunk from its per-example norms.
* :mod:`~opake_core.clipping.engine`: the :class:`Engine` seam, how a chunk's per-example gradients are formed
  (``vmap(grad)`` by default) and how the chunk runs.
* :mod:`~opake_core.clipping.microbatching`: a batch as chunks of ``microbatch_size`` examples, padded to one shape
  where a chunk transform asks for it.
* :mod:`~opake_core.clipping.grad`: :func:`clipped_grad`, which composes the three (``second_moment=True`` also
  releases the clipped sum of squares, :mod:`opake_core.moments`).
* :mod:`~opake_core.clipping.outputs`: :func:`clipped_fun` and :func:`auto_clipped_fun`, the same rules applied to
  the per-example outputs of any function.
* :mod:`~opake_core.clipping.users`: :func:`user_loss`, one user's rows as one example (group clipping, for
  user-level privacy).
"""

from opake_core.clipping.engine import (
    VMAP,
    Engine,
    MaterializedGradients,
    PerExampleGradients,
    SquaringGradients,
    VmapGradients,
)
from opake_core.clipping.grad import ClipDiagnostics, clipped_grad
from opake_core.clipping.outputs import OutputDiagnostics, auto_clipped_fun, clipped_fun
from opake_core.clipping.rules import (
    ADAPTIVE_STREAM,
    AdaptiveClipState,
    AdaptiveRule,
    AutoSRule,
    FixedClipState,
    adaptive,
    auto_s,
    clip_scales,
)
from opake_core.clipping.users import user_loss

__all__ = [
    "ADAPTIVE_STREAM",
    "VMAP",
    "AdaptiveClipState",
    "AdaptiveRule",
    "AutoSRule",
    "ClipDiagnostics",
    "Engine",
    "FixedClipState",
    "MaterializedGradients",
    "OutputDiagnostics",
    "PerExampleGradients",
    "SquaringGradients",
    "VmapGradients",
    "adaptive",
    "auto_clipped_fun",
    "auto_s",
    "clip_scales",
    "clipped_fun",
    "clipped_grad",
    "user_loss",
]
