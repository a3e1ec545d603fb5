"""Checkpoint folders: layout, atomic writes, discovery and rotation.

A checkpoint is a folder ``checkpoint-<step>`` holding

========================== ===========================================================================
``model.safetensors``      the model weights (Hugging Face layout; PEFT models save their adapters)
``dp_state.json``          the DP runtime: step counters, the privacy ledger, the sampler state, the **secret**
                           noise and sampler keys, the run configuration, and the SHA-256 of every other file
``dp_state.safetensors``   the step state (clipping and DP-FTRL noise buffers) and the torch RNG state
``dp_optimizer.safetensors`` the optimizer state
``accountant.json``        the public privacy record: the ledger and the epsilon spent (when accounted)
``trainer_state.json``     Hugging Face ``TrainerState`` (log history, best metric, ...)
``training_args.json``     the arguments of the run (secrets masked)
========================== ===========================================================================

Nothing is pickled: tensors are safetensors, everything else JSON, and the structures are rebuilt from the code
(:mod:`opake_torch.state_files`), so a crafted file cannot run code. ``dp_state.json`` holds the noise key, which
turns the released weights back into un-noised updates: a checkpoint folder is as private as the training data.
Publish the folder :meth:`DPTrainer.save_model` writes, never a checkpoint.

Writes are atomic: files go to a hidden sibling folder that is renamed to ``checkpoint-<step>`` only once every
file is complete, so a crash part way never leaves a folder that looks complete. Hidden folders are ignored by
discovery and removed by the next successful write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from opake_core.errors import CheckpointError
from opake_torch.state_files import load_tree, read_json, save_tree, sha256, write_json

__all__ = [
    "ACCOUNTANT",
    "DP_OPTIMIZER",
    "DP_STATE",
    "DP_TENSORS",
    "PREFIX",
    "TRAINER_STATE",
    "TRAINING_ARGS",
    "checkpoints",
    "configuration",
    "latest_checkpoint",
    "read_manifest",
    "read_tensors",
    "require_resumable",
    "rotate",
    "write_atomically",
    "write_state",
]

PREFIX = "checkpoint"
DP_STATE = "dp_state.json"
DP_TENSORS = "dp_state.safetensors"
DP_OPTIMIZER = "dp_optimizer.safetensors"
FORMAT = "opake.dp_state/3"
ACCOUNTANT = "accountant.json"
TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.json"
_NAME = re.compile(rf"^{PREFIX}-(\d+)$")


def write_atomically(folder: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a hidden sibling folder, then rename it to ``folder`` (replacing an old one)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.parent / f".{folder.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        if folder.exists():
            old = folder.parent / f".{folder.name}.partial-old-{uuid.uuid4().hex[:8]}"
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders under ``output_dir``, oldest step first."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob(f"{PREFIX}-*") if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint with the highest step, or None."""
    found = checkpoints(output_dir)
    return found[-1] if found else None


def require_resumable(folder: Path) -> None:
    """Raise :class:`CheckpointError` unless ``folder`` is a complete DP checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"resume_from_checkpoint={str(folder)!r} is not a folder.")
    if (folder / "dp_state.pt").is_file() and not (folder / DP_STATE).is_file():
        raise CheckpointError(
            f"{folder} was written by an earlier version of Opake that stored its state with pickle; it is not "
            "loaded, since unpickling a file can run code. Start a new run (from these weights, if they cost no "
            "privacy), or resume it with the version that wrote it."
        )
    needed = [DP_STATE, DP_TENSORS, DP_OPTIMIZER, TRAINER_STATE]
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{folder} is not a complete DP checkpoint (missing {', '.join(missing)}): it holds weights only. "
            "To start a new DP run from these weights, load them as the model (model=...); the new run begins "
            "with a zero accountant, which is correct only if those weights cost no privacy."
        )


def rotate(output_dir: Path, limit: int | None, *, protect: tuple[Path, ...] = ()) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``, never one in ``protect``; returns the deleted folders."""
    if limit is None:
        return []
    found = checkpoints(output_dir)
    protected = {Path(p).resolve() for p in protect}
    keep_count = max(limit, len([p for p in found if p.resolve() in protected]))
    removable = [p for p in found if p.resolve() not in protected]
    excess = len(found) - keep_count
    deleted = removable[: max(excess, 0)]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


# Arguments that change what is written or shown, never what is computed: a resume may change them and keep its keys.
_OUTPUT_FIELDS = frozenset({
    "output_dir", "overwrite_output_dir", "logging_dir", "logging_strategy", "logging_first_step", "logging_steps",
    "disable_tqdm", "report_to", "run_name", "include_num_input_tokens_seen", "include_tokens_per_second",
    "save_strategy", "save_steps", "save_total_limit", "save_safetensors", "save_on_each_node", "save_only_model",
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "restore_callback_states_from_checkpoint",
    "resume_from_checkpoint", "eval_strategy", "eval_steps", "eval_on_start", "eval_delay", "prediction_loss_only",
    "include_for_metrics", "per_device_eval_batch_size", "bf16_full_eval", "dataloader_num_workers",
    "dataloader_pin_memory", "push_to_hub", "hub_model_id", "hub_token", "hub_private_repo", "privacy_accounting",
    "privacy_allow_large_delta", "ddp_timeout", "local_rank", "do_train", "do_eval", "do_predict", "log_level",
    "log_level_replica", "log_on_each_node", "project", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id",
})  # fmt: skip


def configuration(args: Any) -> str:
    """A fingerprint (SHA-256) of the arguments that determine a run's trajectory: all but the output settings."""
    fields = {k: v for k, v in args.to_dict().items() if k not in _OUTPUT_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


# dp_state.json: field -> the JSON types its value may have
_MANIFEST = {
    "format": (str,),
    "global_step": (int,),
    "noise_key": (dict,),
    "sampler_key": (dict,),
    "ledger": (dict,),
    "sampler_state": (dict,),
    "configuration": (str,),
    "noise_multiplier": (float,),
    "calibration_source": (str,),
    "delta": (float,),
    "total_steps": (int,),
    "expected_batch_size": (float,),
    "mechanism": (str,),
    "mechanism_kwargs": (dict,),
    "sampling_mode": (str,),
    "clipping_norm": (str,),
    "world_size": (int,),
    "versions": (dict,),
    "files": (dict,),
}
_OPTIONAL = {"router_release": (dict,)}  # present only for a run with the MoE router release


def write_state(
    folder: Path,
    manifest: dict[str, Any],
    *,
    step_state: Any,
    opt_state: Any,
    rng_state: Any,
    router_state: Any = None,
) -> None:
    """Write the DP state files into ``folder``, last of the checkpoint's files: the tensors as safetensors, then
    ``dp_state.json`` with the SHA-256 of every other file of the folder (weights, states, records). ``router_state``:
    the MoE router release's state (without its key), with the step state."""
    tree = {"step_state": step_state, "torch_rng_state": rng_state}
    if router_state is not None:
        tree["router_state"] = router_state
    save_tree(folder / DP_TENSORS, tree)
    save_tree(folder / DP_OPTIMIZER, opt_state)
    files = {path.name: sha256(path) for path in sorted(folder.iterdir()) if path.is_file()}
    write_json(folder / DP_STATE, {**manifest, "format": FORMAT, "files": files})


def read_manifest(folder: Path) -> dict[str, Any]:
    """``dp_state.json`` of ``folder``, its fields type-checked and the checksum of every state file verified.

    Raises CheckpointError naming the file and the problem: a missing or extra field, a value of the wrong type, a
    file of the checkpoint that is missing or was changed after the checkpoint was written.
    """
    path = Path(folder) / DP_STATE
    manifest = read_json(path)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(manifest).__name__}.")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this version reads {FORMAT!r}.")
    missing = sorted(set(_MANIFEST) - set(manifest))
    extra = sorted(set(manifest) - set(_MANIFEST) - set(_OPTIONAL))
    if missing or extra:
        raise CheckpointError(f"{path} lacks fields {missing} or has unknown fields {extra}.")
    for name, kinds in [*_MANIFEST.items(), *((n, k) for n, k in _OPTIONAL.items() if n in manifest)]:
        value = manifest[name]
        if float in kinds and type(value) is int:  # JSON writes 1.0 as 1 in some encoders
            value = manifest[name] = float(value)
        if type(value) not in kinds or (type(value) is int and value < 0):
            raise CheckpointError(f"{path}: field {name!r} has the wrong type or value {str(value)[:100]!r}.")
    for name, digest in manifest["files"].items():
        if Path(name).name != name or name in ("", ".", "..", DP_STATE) or not isinstance(digest, str):
            raise CheckpointError(f"{path}: unexpected entry {name!r} in its list of files.")
        if not (Path(folder) / name).is_file():
            raise CheckpointError(f"{Path(folder) / name} is missing: the checkpoint is incomplete.")
        if sha256(Path(folder) / name) != digest:
            raise CheckpointError(
                f"{Path(folder) / name} does not match the checksum recorded in {path}: the file was changed or "
                "damaged after the checkpoint was written. Resume from another checkpoint."
            )
    return manifest


def read_tensors(
    folder: Path, *, step_template: Any, opt_template: Any, device: Any, router_template: Any = None
) -> tuple[Any, Any, Any, Any]:
    """``(step_state, opt_state, torch_rng_state, router_state)`` of ``folder``, rebuilt on the structures of the
    templates (the states a fresh run of the same configuration starts from; ``router_state`` is None without a
    ``router_template``); CheckpointError when they differ."""
    template = {"step_state": step_template, "torch_rng_state": torch.get_rng_state()}
    if router_template is not None:
        template["router_state"] = router_template
    tensors = load_tree(Path(folder) / DP_TENSORS, template=template, device=device)
    opt_state = load_tree(Path(folder) / DP_OPTIMIZER, template=opt_template, device=device)
    return tensors["step_state"], opt_state, tensors["torch_rng_state"].cpu(), tensors.get("router_state")
