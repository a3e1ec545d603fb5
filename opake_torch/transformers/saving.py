"""What a trainer writes: its checkpoints, the exported weights, and the public ``accountant.json``.

A checkpoint folder (:mod:`.checkpoint_folder`: layout, integrity, atomic writes) holds the weights
(``model.safetensors`` or the PEFT adapter), the tokenizer, Hugging Face's ``trainer_state.json`` and
``training_args.json``, the public ``accountant.json``, and (unless ``save_only_model``) the private DP state:
``dp_state.json`` (counters, keys, ledger, configuration, the fingerprint of the training data) with the step and
optimizer tensors. :mod:`.resume` reads it back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from opake_core import accounting
from opake_core.step import unkeyed
from opake_torch.state_files import write_json
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers import routers, sharded_state
from opake_torch.transformers.privacy import PrivacyPlan, resume_fields
from opake_torch.transformers.run_state import Run, ledger_result

__all__ = [
    "accountant_record",
    "copy_into",
    "mechanism_fields",
    "save",
    "save_weights",
    "update_best",
    "write_accountant",
]


def copy_into(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """The trainable parameters ``params`` copied into ``model`` (which the step functions never modify); under FSDP2
    ``params`` are this rank's rows, copied into the module's shards (the next forward gathers them)."""
    with torch.no_grad():
        own = dict(model.named_parameters())
        for name, value in params.items():
            target = own[name]
            (target.to_local() if hasattr(target, "to_local") else target).copy_(value)


def save(
    run: Run,
    *,
    args: Any,
    state: Any,
    model: nn.Module,
    processing_class: Any,
    topology: Any,
    metrics: dict[str, float] | None,
    files: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` under ``output_dir`` atomically (on the writing rank), then rotate old ones.
    ``files``: a trainer's own state, ``{file name: {name: tensor}}``, written as safetensors with the DP state (not
    under ``save_only_model``) and sealed with it."""
    folder = Path(args.output_dir) / f"{ckpt.PREFIX}-{state.global_step}"
    copy_into(model, run.params)
    update_best(args, state, folder, metrics)
    whole = topology.full_state(model)  # FSDP2: gathered from the shards on every rank
    shards = None
    if topology.is_sharded and not args.save_only_model:  # every rank writes its rows, sealed by the writer below
        shards = topology.stage_state(sharded_state.staging(args.output_dir, folder), run)

    def write(tmp: Path) -> None:
        save_weights(model, processing_class, tmp, safe=args.save_safetensors, state_dict=whole)
        if run.plan.accounted:
            write_accountant(tmp, args, run.plan, run.ledger)
        state.save_to_json(str(tmp / ckpt.TRAINER_STATE))
        (tmp / ckpt.TRAINING_ARGS).write_text(json.dumps(args.to_dict(), indent=2, default=str))
        if not args.save_only_model:
            for name, tensors in (files or {}).items():
                save_file(tensors, str(tmp / name))
            manifest = _manifest(args, state.global_step, run)
            if shards is not None:
                sharded_state.unstage(sharded_state.staging(args.output_dir, folder), tmp, args.world_size)
                manifest["shards"] = shards
            ckpt.write_state(
                tmp,
                manifest,
                step_state=unkeyed(run.dp_state),  # the keys are stored in dp_state.json only
                opt_state=run.opt_state,
                rng_state=torch.get_rng_state(),
                router_state=None if run.router_state is None else routers.unkeyed(run.router_state),
                sharded=shards is not None,
            )

    def write_and_rotate() -> None:
        ckpt.write_atomically(folder, write)
        protect = (Path(state.best_model_checkpoint),) if state.best_model_checkpoint else ()
        ckpt.rotate(args.output_dir, args.save_total_limit, protect=protect)

    topology.write(args.should_save, write_and_rotate, "checkpoint save")
    return folder


def accountant_record(args: Any, plan: PrivacyPlan, ledger: accounting.Ledger) -> dict[str, Any]:
    """The public record of what was released and the epsilon it costs (no keys): ``accountant.json``, and what the
    model card states. Epsilon is the string ``"inf"`` for a non-private run, and None (with no accountant) when
    the run is not accounted (``privacy_accounting=False``)."""
    result = ledger_result(ledger, plan.delta) if plan.accounted else None
    epsilon = None if result is None else result.value if math.isfinite(result.value) else "inf"
    return {
        "epsilon": epsilon,
        "delta": plan.delta,
        "accountant": None if result is None else result.accountant,
        "adjacency": accounting.default_adjacency(plan.release),
        "steps": plan.total_steps if plan.horizon else ledger.releases,
        "ledger": ledger.to_json(),
        "noise_multiplier": plan.noise_multiplier,
        "calibration_source": plan.calibration_source,
        "sample_rate": plan.sample_rate,
        "expected_batch_size": plan.expected_batch_size,
        "sampling_mode": args.sampling_mode,
        "ddp_shard": getattr(plan.sampler, "sharding", "per_rank"),  # what was accounted ("per_rank" on one process)
        "mechanism": args.privacy_noise_mechanism,
        "horizon": plan.horizon,
        **unit_record(args, plan),
    }


def unit_record(args: Any, plan: PrivacyPlan) -> dict[str, Any]:
    """The privacy unit in the public record: ``"record"``, or ``"user"`` with the number of users (the plan's sample
    rate and expected batch are per user then), the cap on a user's rows per step and how they are combined."""
    privacy = args.privacy
    if not privacy.user_level:
        return {"privacy_unit": "record"}
    return {
        "privacy_unit": "user",
        "user_column": privacy.privacy_user_column,
        "users": plan.sampler.num_users,
        "max_rows_per_user": privacy.privacy_max_rows_per_user,
        "user_reduction": privacy.privacy_user_reduction,
    }


def write_accountant(folder: Path, args: Any, plan: PrivacyPlan, ledger: accounting.Ledger) -> dict[str, Any]:
    """Write ``accountant.json`` (:func:`accountant_record`) into ``folder``; returns the record."""
    record = accountant_record(args, plan, ledger)
    write_json(folder / ckpt.ACCOUNTANT, record)
    return record


def update_best(args: Any, state: Any, folder: Path, metrics: dict[str, float] | None) -> None:
    """Record ``folder`` as the best checkpoint in ``state`` when ``metrics`` improve ``metric_for_best_model``."""
    name = args.metric_for_best_model
    if not metrics or name is None or name not in metrics:
        return
    value, best = metrics[name], state.best_metric
    if best is None or (value > best if args.greater_is_better else value < best):
        state.best_metric = value
        state.best_global_step = state.global_step
        state.best_model_checkpoint = str(folder)


def save_weights(
    model: nn.Module,
    processing_class: Any,
    folder: Path,
    *,
    safe: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """The model (``save_pretrained``, or ``model.safetensors``) and the tokenizer, into ``folder``; ``state_dict``:
    the whole model's tensors when its own are shards (FSDP2)."""
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(folder, safe_serialization=safe, state_dict=state_dict)
    elif state_dict is not None:
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(folder / "model.safetensors"))
    else:
        from safetensors.torch import save_model

        save_model(model, str(folder / "model.safetensors"))
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(folder)


def mechanism_fields(args: Any, plan: PrivacyPlan) -> dict[str, Any]:
    """What a horizon run cannot change on resume (saved in ``dp_state.json``), from ``args.privacy`` only."""
    return resume_fields(args.privacy, plan)


def _manifest(args: Any, global_step: int, run: Run) -> dict[str, Any]:
    """The JSON part of the private DP state (``dp_state.json``): counters, keys, ledger, configuration."""
    plan = run.plan
    return {
        "global_step": global_step,
        **run.keys.to_json(),
        "ledger": run.ledger.to_json(),
        "sampler_state": run.sampler_state.to_json(),
        "configuration": ckpt.configuration(args),
        "dataset": run.dataset.to_json(),
        "calibration_source": plan.calibration_source,
        "delta": plan.delta,
        "world_size": args.world_size,
        "versions": accounting.library_versions(),
        **mechanism_fields(args, plan),
        **({} if run.router_release is None else {"router_release": run.router_setup.settings()}),
    }
