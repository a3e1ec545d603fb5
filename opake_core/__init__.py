"""Opake core: pure functions and frozen states for differentially private training.

The names a researcher composes with are importable from here (``from opake_core import dp_sgd``) and listed in
``__all__``; ``docs/api.md`` documents exactly these. Two kinds:

* single concepts, by name: the composed steps (``dp_sgd``, ``dp_ftrl``, ``dp_step``), per-example clipping
  (``clipped_grad``, ``clipped_fun``, the rules ``auto_s`` and ``adaptive``, the ``Engine`` seam), the Gaussian
  mechanisms (``gaussian_noise``, ``mf_gaussian_noise``), the typed trees (``Clipped``, ``Noised``, ``per_group``),
  a rank's part of a sharded tree (``Shard``), the one-run audits of a trained model (``one_run_audit``,
  ``fdp_audit``) and the errors;
* families, by module, whose ``__all__`` is their face: ``accounting`` (processes, ``epsilon`` / ``delta``,
  calibration, the ledger), ``sampling`` (the samplers), ``mf`` (the DP-FTRL strategies), ``optim`` (optimizers and
  schedules), ``plan`` (sampler, mechanism and accountant chosen together), ``random`` (keys) and ``testing`` (the
  statistical checks of a mechanism).

Example: DP-SGD on a toy least-squares problem, batches drawn by Poisson sampling, and the epsilon of the run from
the sampler's own accounting process.

    >>> import torch
    >>> from opake_core import accounting, dp_sgd, optim, random, sampling
    >>> x = torch.randn(1_000, 3, generator=torch.Generator().manual_seed(0))
    >>> y = x @ torch.tensor([1.0, -2.0, 0.5])
    >>> sampler, sgd = sampling.poisson(dataset_size=1_000, sample_rate=0.05), optim.sgd(lr=0.5)
    >>> step_fn, dp_state = dp_sgd(lambda w, x, y: (x @ w - y) ** 2, clipping_norm=1.0, noise_multiplier=2.0,
    ...                            key=random.key(0), optimizer=sgd, expected_batch_size=50.0)
    >>> w, keys, draws = torch.zeros(3), random.key(1), sampler.init()
    >>> opt_state = sgd.init(w)
    >>> for _ in range(20):
    ...     batch, draws = sampler.sample(keys, draws)
    ...     w, opt_state, dp_state, metrics = step_fn(w, opt_state, dp_state, (x[batch], y[batch]))
    >>> metrics.noise_std  # noise multiplier * clipping norm / expected batch size
    0.04
    >>> bool(((x @ w - y) ** 2).mean() < 0.1 * (y**2).mean())  # it learned
    True
    >>> epsilon = accounting.epsilon(sampler.process(noise_multiplier=2.0, steps=20), delta=1e-5)
    >>> round(epsilon.value, 2), epsilon.accountant
    (0.51, 'pld')

The core never imports the adapter (``opake_torch``), ``transformers`` or ``torch.distributed``, never touches a
file, and never uses the global random state. Its names load on first use, so ``import opake_core`` (and the import of
any one module) stays cheap: torch, SciPy and dp-accounting are imported by the first name that needs them.
"""

from __future__ import annotations

from opake_core import _lazy, errors

__version__ = "0.1.0.dev0"

# Families, used through their module (``accounting.epsilon``, ``sampling.poisson``); each module's __all__ is its face.
_FAMILIES = ("accounting", "mf", "optim", "plan", "random", "sampling", "testing")

# Single concepts, each re-exported from the public module that holds it.
_CONCEPTS = {
    "opake_core.step": ("DPState", "StepMetrics", "dp_ftrl", "dp_sgd", "dp_step"),
    "opake_core.clipping": (
        "ClipDiagnostics",
        "Engine",
        "MaterializedGradients",
        "OutputDiagnostics",
        "PerExampleGradients",
        "VmapGradients",
        "adaptive",
        "auto_clipped_fun",
        "auto_s",
        "clipped_fun",
        "clipped_grad",
    ),
    "opake_core.noise": ("add_gaussian_noise", "gaussian_noise", "mf_gaussian_noise"),
    "opake_core.tree": ("Clipped", "Noised", "PerGroup", "per_group"),
    "opake_core.sharding": ("Shard",),
    "opake_core.auditing": ("fdp_audit", "one_run_audit"),
    "opake_core.errors": tuple(errors.__all__),
}
_HOME = {name: module for module, names in _CONCEPTS.items() for name in names}

__all__ = sorted([*_FAMILIES, *_HOME])


__getattr__, __dir__ = _lazy.exports(__name__, _HOME, _FAMILIES)
