"""The training side of privacy audits: canaries, runs, observations, scores, and the checks of what canaries
cannot see.

The statistics live in the core, :mod:`opake_core.auditing`: the one-run epsilon point of Steinke, Nasr and Jagielski
(2023) and the f-DP test of Mahloujifar, Melis and Chaudhuri (2025, Gaussian trade-off curves). An audit:

1. draws a fair coin per canary (:func:`opake_core.auditing.coin_flips`) and puts the heads in the training data;
2. trains once (a core DP-SGD or DP-FTRL loop, or a :class:`~opake_torch.transformers.DPTrainer`);
3. scores every canary from what the threat model lets the auditor see;
4. turns the scores into lower bounds and reports them next to the theoretical epsilon of the run.

Two kinds of canaries and two threat models (Nasr et al., "Tight Auditing of Differentially Private Machine
Learning", USENIX Security 2023):

* input-space canaries (:func:`~opake_torch.auditing.canaries.make_canaries`): examples with random inputs and random
  labels, scored by their loss on the final model (black-box; :func:`~opake_torch.auditing.core_runs.audit_core_run`,
  :func:`~opake_torch.auditing.trainer_runs.audit_trainer`) or by the alignment of each update with their gradient
  (white-box, every update);
* Dirac gradient canaries (:func:`~opake_torch.auditing.canaries.dirac_canaries`): canary ``j``'s gradient is
  ``gradient_norm * e_j`` on a parameter block that the real loss never touches, so each canary has a coordinate of
  its own and the canaries do not interfere. :func:`~opake_torch.auditing.core_runs.audit_dirac_run` (the core step)
  and :func:`~opake_torch.auditing.trainer_runs.audit_trainer_dirac` (``DPTrainer``) observe either every privatized
  update (all iterates) or only the final model. The core step's engine,
  :class:`~opake_torch.auditing.dirac_engine.DiracGradients`, writes the canaries' per-example gradients down instead
  of materializing them, so a step costs in proportion to the batch, not the batch times the canaries.

A lower bound above the theoretical epsilon (beyond the stated false-alarm rate ``1 - confidence``) means the
mechanism leaks more than it claims. A correct private run gives a bound below its epsilon; a non-private run on
memorizable canaries gives a clearly positive one.

Scope: the Dirac canaries see only their own block, and the audit tests the mechanism against the claim it is given.
Noise missing on the real parameters, or an accountant that counts other steps than the ones that ran, passes it;
:mod:`~opake_torch.auditing.scope_checks` checks both.

Modules: :mod:`~opake_torch.auditing.canaries`, :mod:`~opake_torch.auditing.dirac_engine`,
:mod:`~opake_torch.auditing.scoring`, :mod:`~opake_torch.auditing.core_runs`,
:mod:`~opake_torch.auditing.trainer_runs`, :mod:`~opake_torch.auditing.scope_checks`.
"""

from opake_torch.auditing.canaries import (
    CANARY_FIELD,
    CANARY_LEAF,
    CANARY_WEIGHT,
    Canaries,
    DiracCanaries,
    canary_rows,
    dirac_canaries,
    make_canaries,
    with_canary_block,
    with_dirac_canaries,
)
from opake_torch.auditing.core_runs import Observer, audit_core_run, audit_dirac_run
from opake_torch.auditing.dirac_engine import DiracGradients
from opake_torch.auditing.scope_checks import audit_trainer_accounting, audit_trainer_noise, check_noise_scale
from opake_torch.auditing.scoring import (
    AuditReport,
    CanaryAuditReport,
    gradient_scores,
    loss_scores,
    planned_guess_sets,
)
from opake_torch.auditing.trainer_runs import audit_trainer, audit_trainer_dirac

__all__ = [
    "CANARY_FIELD",
    "CANARY_LEAF",
    "CANARY_WEIGHT",
    "AuditReport",
    "Canaries",
    "CanaryAuditReport",
    "DiracCanaries",
    "DiracGradients",
    "Observer",
    "audit_core_run",
    "audit_dirac_run",
    "audit_trainer",
    "audit_trainer_accounting",
    "audit_trainer_dirac",
    "audit_trainer_noise",
    "canary_rows",
    "check_noise_scale",
    "dirac_canaries",
    "gradient_scores",
    "loss_scores",
    "make_canaries",
    "planned_guess_sets",
    "with_canary_block",
    "with_dirac_canaries",
]
