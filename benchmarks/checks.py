"""Same-batch correctness check: our clipped sum against a reference on the workload's batch, noise off.

Ours: ``clipped_grad(loss, clipping_norm=C, normalize_by=1)`` (the clipping inside ``dp_sgd``), in eval mode and
without TF32. Reference: Opacus's hooks with noise multiplier 0 and loss reduction "sum" (``"opacus_hooks"``) or,
without Opacus, a per-example autograd loop on a float64 copy of the model (``"float64_loop"``). The check passes
when the l2 relative difference is within :data:`TOLERANCE` for the dtype of the base weights.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from modes import core_parts, opacus_available, trainable
from settings import Settings
from timing import failure, free, tf32
from workloads import Workload, make_batch, per_example_losses

# l2 relative difference of the clipped sums accepted by the same-batch check, by the dtype of the base weights.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def reference_for(suite: str) -> str:
    """Opacus's hooks where Opacus is installed (the gpu suite asks for them regardless, and records a skip)."""
    return "opacus_hooks" if opacus_available() or suite != "smoke" else "float64_loop"


def ours_clipped_sum(workload: Workload, batch: dict[str, torch.Tensor], settings: Settings) -> dict[str, Any]:
    from opake_core.clipping import clipped_grad

    model, _, params, _, loss_fn = core_parts(workload, settings)
    dropout_off_hooks_on(model)
    grad_fn, state = clipped_grad(
        loss_fn,
        clipping_norm=settings.clipping_norm,
        normalize_by=1.0,
        microbatch_size=settings.microbatch_for(batch["input_ids"].shape[0]),
    )
    clipped, _ = grad_fn(params, batch, state=state)
    return {"model": model, "sums": {k: v.detach() for k, v in clipped.value.items()}}


def dropout_off_hooks_on(model: torch.nn.Module) -> None:
    """Deterministic forward for the same-batch check that Opacus can still hook.

    Opacus records activations only for modules in training mode, while any module in training mode may apply
    dropout (``nn.Dropout`` or an attention module's own dropout probability). So: everything in eval mode except
    the modules that own trainable parameters directly (linear, embedding, norm layers), which apply no dropout.
    """
    model.eval()
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            module.train()


def opacus_clipped_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], workload: Workload, bound: float):
    """Opacus hooks, noise multiplier 0, loss reduction "sum": ``p.grad`` after ``pre_step`` is the clipped sum."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
    params = trainable(model)
    dpo = DPOptimizer(
        torch.optim.SGD(params, lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=bound,
        expected_batch_size=batch["input_ids"].shape[0],
        loss_reduction="sum",
    )
    dpo.zero_grad(set_to_none=True)
    per_example_losses(gsm, batch, workload.task).sum().backward()
    dpo.pre_step()
    sums = {names[id(p)]: p.grad.detach().clone() for p in params}
    if hasattr(gsm, "_close"):
        gsm._close()
    return sums


def float64_clipped_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], workload: Workload, bound: float):
    """A per-example autograd loop on a float64 copy of the model: the exact clipped sum."""
    ref = copy.deepcopy(model).double().eval()
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    sums = {n: torch.zeros_like(p) for n, p in named}
    for i in range(batch["input_ids"].shape[0]):
        example = {k: v[i : i + 1] for k, v in batch.items()}
        loss = per_example_losses(ref, example, workload.task)[0]
        grads = torch.autograd.grad(loss, [p for _, p in named])
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        scale = torch.clamp(bound / norm, max=1.0)
        for (n, _), g in zip(named, grads, strict=True):
            sums[n] += scale * g
    return sums


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """l2 and max relative differences of two ``{name: tensor}`` sums, and the names only one of them has."""
    missing = sorted(set(ref) ^ set(ours))
    names = sorted(set(ref) & set(ours))
    diff_sq = ref_sq = 0.0
    max_abs = max_ref = 0.0
    for n in names:
        a, b = ours[n].double(), ref[n].double().to(ours[n].device)
        d = a - b
        diff_sq += d.square().sum().item()
        ref_sq += b.square().sum().item()
        max_abs = max(max_abs, d.abs().max().item())
        max_ref = max(max_ref, b.abs().max().item())
    return {
        "leaves_compared": len(names),
        "leaves_unmatched": missing[:10],
        "max_abs_diff": max_abs,
        "max_rel_diff": max_abs / max_ref if max_ref > 0 else math.inf,
        "l2_rel_diff": math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else math.inf,
    }


def check_clipped_sum(workload: Workload, settings: Settings, *, reference: str) -> dict[str, Any]:
    """Our clipped sum against ``reference`` ("opacus_hooks" or "float64_loop") on the workload's batch, noise off."""
    result: dict[str, Any] = {"workload": workload.name, "reference": reference, "ok": False}
    if reference == "opacus_hooks" and not opacus_available():
        return {**result, "skipped": True, "error": "opacus not installed"}
    free(settings.device)
    try:
        with tf32(False):
            batch = make_batch(workload, workload.batch, settings.device)
            ours = ours_clipped_sum(workload, batch, settings)
            model = ours.pop("model")
            if reference == "opacus_hooks":
                ref = opacus_clipped_sum(model, batch, workload, settings.clipping_norm)
            else:
                ref = float64_clipped_sum(model, batch, workload, settings.clipping_norm)
            stats = compare(ours["sums"], ref)
        tolerance = TOLERANCE.get(workload.dtype, 1e-4)
        passed = stats["l2_rel_diff"] <= tolerance and not stats["leaves_unmatched"]
        result.update(stats, tolerance_l2_rel=tolerance, ok=passed)
    except Exception as exc:
        result["error"] = failure(exc)
    free(settings.device)
    return result
