"""Opake core: pure functions and frozen states for differentially private training.

Modules: ``random`` (keys), ``tree`` (pytrees with privacy metadata), ``clipping`` (per-example clipping),
``noise`` (Gaussian mechanism), ``optim`` (optimizers and schedules), ``step`` (composed steps),
``accounting`` and ``sampling``, ``errors``.

The core never imports the adapter (``opake_torch``), ``transformers`` or ``torch.distributed``, never touches a
file, and never uses the global random state.
"""

__version__ = "0.1.0.dev0"
