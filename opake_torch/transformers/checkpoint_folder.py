"""Checkpoint folders: layout, integrity, atomic writes, discovery and rotation.

A checkpoint is a folder ``checkpoint-<step>`` holding

========================== ===========================================================================
``model.safetensors``      the model weights (Hugging Face layout; PEFT models save their adapters)
``dp_state.json``          the DP runtime: step counters, the privacy ledger, the sampler state, the **secret**
                           noise and sampler keys, the run configuration, the fingerprint of the training data,
                           the SHA-256 of every other file, and a checksum of its own content
``dp_state.safetensors``   the step state (clipping and DP-FTRL noise buffers) and the torch RNG state
``dp_optimizer.safetensors`` the optimizer state
``ref_model.safetensors``  DPO with ``sync_ref_model`` only: the synced reference's parameters
``accountant.json``        the public privacy record: the ledger and the epsilon spent (when accounted)
``trainer_state.json``     Hugging Face ``TrainerState`` (log history, best metric, ...)
``training_args.json``     the arguments of the run (secrets masked)
========================== ===========================================================================

Nothing is pickled: tensors are safetensors, everything else JSON, and the structures are rebuilt from the code
(:mod:`opake_torch.state_files`), so a crafted file cannot run code. ``dp_state.json`` holds the noise key, which
turns the released weights back into un-noised updates: a checkpoint folder is as private as the training data.
Publish the folder :meth:`DPTrainer.save_model` writes, never a checkpoint.

The checkpoint is tamper-evident: every file is covered by a SHA-256 in ``dp_state.json``, which carries the SHA-256
of its own canonical JSON (an HMAC-SHA256 under the key in :data:`KEY_ENV` when that is set), and a resume
cross-checks the ledger with ``accountant.json``. Whoever can rewrite every file and recompute the plain checksums
is not detected: that takes the keyed seal (docs/checkpoints.md states the threat model).

Writes are atomic: files go to a hidden sibling folder that is renamed to ``checkpoint-<step>`` only once every
file is complete, so a crash part way never leaves a folder that looks complete. Hidden folders are ignored by
discovery and removed by the next successful write.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from opake_core import accounting
from opake_core.errors import CheckpointError, ConfigurationError, OpakeError
from opake_core.plan import is_horizon
from opake_torch.state_files import load_tree, read_json, save_tree, sha256, write_json

__all__ = [
    "ACCOUNTANT",
    "DP_OPTIMIZER",
    "DP_STATE",
    "DP_TENSORS",
    "KEY_ENV",
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
    "seal",
    "seal_key",
    "write_atomically",
    "write_state",
]

PREFIX = "checkpoint"
DP_STATE = "dp_state.json"
DP_TENSORS = "dp_state.safetensors"
DP_OPTIMIZER = "dp_optimizer.safetensors"
FORMAT = "opake.dp_state/4"
ACCOUNTANT = "accountant.json"
TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.json"
KEY_ENV = "OPAKE_CHECKPOINT_KEY"  # a secret that turns the manifest's checksum into an HMAC (see seal)
WEIGHTS = ("model.safetensors", "adapter_model.safetensors")
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
    sharded = any(folder.glob("dp_state-00000-of-*.safetensors"))  # the ranks' files of a sharded run
    needed = [DP_STATE, TRAINER_STATE] if sharded else [DP_STATE, DP_TENSORS, DP_OPTIMIZER, TRAINER_STATE]
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
    "step_perf",
    "save_strategy", "save_steps", "save_total_limit", "save_safetensors", "save_on_each_node", "save_only_model",
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "restore_callback_states_from_checkpoint",
    "resume_from_checkpoint", "eval_strategy", "eval_steps", "eval_on_start", "eval_delay", "prediction_loss_only",
    "include_for_metrics", "per_device_eval_batch_size", "bf16_full_eval", "dataloader_num_workers",
    "dataloader_pin_memory", "push_to_hub", "hub_model_id", "hub_token", "hub_private_repo", "privacy_accounting",
    "privacy_allow_large_delta", "ddp_timeout", "local_rank", "do_train", "do_eval", "do_predict", "log_level",
    "log_level_replica", "log_on_each_node", "project", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id",
    "enable_jit_checkpoint",
    "ignore_data_skip",  # no effect: a resume never skips data (resume.resumed_data)
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
    "dataset": (dict,),
    "checksum": (dict,),
}
# present only for a run with the MoE router release, and for a sharded (FSDP2) run (.sharded_state)
_OPTIONAL = {"router_release": (dict,), "shards": (dict,)}


def write_state(
    folder: Path,
    manifest: dict[str, Any],
    *,
    step_state: Any,
    opt_state: Any,
    rng_state: Any,
    router_state: Any = None,
    sharded: bool = False,
) -> None:
    """Write the DP state files into ``folder``, last of the checkpoint's files: the tensors as safetensors, then
    ``dp_state.json`` with the SHA-256 of every other file of the folder (weights, states, records), sealed with
    the checksum of its own content (:func:`seal`). ``router_state``: the MoE router release's state (without its
    key), with the step state. ``sharded``: the ranks' files are in ``folder`` already (:mod:`.sharded_state`),
    and the manifest's ``shards`` entry says how to read them; no whole-state files are written."""
    tree = {"step_state": step_state, "torch_rng_state": rng_state}
    if router_state is not None:
        tree["router_state"] = router_state
    if not sharded:
        save_tree(folder / DP_TENSORS, tree)
        save_tree(folder / DP_OPTIMIZER, opt_state)
    files = {path.name: sha256(path) for path in sorted(folder.iterdir()) if path.is_file()}
    write_json(folder / DP_STATE, seal({**manifest, "format": FORMAT, "files": files}))


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its ``checksum``: the SHA-256 of its canonical JSON (sorted keys, no spaces) without that
    field, or the HMAC-SHA256 under the secret in the environment variable :data:`KEY_ENV` when it is set.

    The plain checksum detects an edit of the manifest by anyone who does not also recompute it; the keyed one, an
    edit by anyone who does not know the key.
    """
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != "checksum"}))  # as it reads back
    key = seal_key()
    algorithm = "sha256" if key is None else "hmac-sha256"
    return {**body, "checksum": {"algorithm": algorithm, "digest": _digest(body, key)}}


def seal_key() -> bytes | None:
    """The checkpoint key in the environment variable :data:`KEY_ENV` (None when unset); ConfigurationError for a
    key shorter than 16 characters."""
    secret = os.environ.get(KEY_ENV, "")
    if not secret:
        return None
    if len(secret) < 16:
        raise ConfigurationError(
            f"{KEY_ENV} holds {len(secret)} characters: a checkpoint key is a secret of at least 16 characters (for "
            f"example 32 random hex digits). Set a longer one, or unset {KEY_ENV} for plain checksums."
        )
    return secret.encode("utf-8")


def _digest(body: dict[str, Any], key: bytes | None) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if key is None:
        return hashlib.sha256(canonical).hexdigest()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def _check_seal(path: Path, manifest: dict[str, Any]) -> None:
    """CheckpointError unless ``manifest`` (read from ``path``) matches its own checksum (:func:`seal`)."""
    found = manifest.get("checksum")
    if (
        not isinstance(found, dict)
        or set(found) != {"algorithm", "digest"}
        or found["algorithm"] not in ("sha256", "hmac-sha256")
        or not isinstance(found["digest"], str)
    ):
        raise CheckpointError(f"{path} has no valid checksum of its own content (got {str(found)[:100]!r}).")
    key = seal_key()
    if found["algorithm"] == "hmac-sha256" and key is None:
        raise CheckpointError(
            f"{path} is sealed with a checkpoint key (HMAC-SHA256): set {KEY_ENV} to the key the run was written "
            "with to resume it."
        )
    if found["algorithm"] == "sha256" and key is not None:
        raise CheckpointError(
            f"{path} carries a plain SHA-256, but {KEY_ENV} is set: a checkpoint written under the key carries its "
            f"HMAC, so this one was written without the key or its seal was replaced. Resume from a checkpoint "
            f"written under the key, or unset {KEY_ENV} only if you trust this folder."
        )
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    if not hmac.compare_digest(_digest(body, key), found["digest"]):
        raise CheckpointError(
            f"{path} does not match its own checksum: it was edited or damaged after the checkpoint was written. "
            "Resume from another checkpoint."
        )


def read_manifest(folder: Path) -> dict[str, Any]:
    """``dp_state.json`` of ``folder``, verified: its own checksum, its fields type-checked, the checksum of every
    file of the folder (every file but hidden ones must be listed, the weights among them), and its ledger
    cross-checked with ``accountant.json``.

    Raises CheckpointError naming the file and the problem: an edited manifest, a missing or extra field, a value of
    the wrong type, a file of the checkpoint that is missing, unlisted or was changed after the checkpoint was
    written, a public record that disagrees with the private one.
    """
    folder = Path(folder)
    path = folder / DP_STATE
    manifest = read_json(path)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(manifest).__name__}.")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}; this version reads {FORMAT!r}.")
    _check_seal(path, manifest)
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
    _check_files(folder, manifest["files"])
    _check_records(folder, manifest)
    return manifest


def _check_files(folder: Path, files: dict[str, Any]) -> None:
    """Every file listed in ``dp_state.json`` matches its SHA-256, every other (non-hidden) file of the folder is
    listed, and so are the weights."""
    path = folder / DP_STATE
    for name, digest in files.items():
        if Path(name).name != name or name in ("", ".", "..", DP_STATE) or not isinstance(digest, str):
            raise CheckpointError(f"{path}: unexpected entry {name!r} in its list of files.")
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name} is missing: the checkpoint is incomplete.")
        if sha256(folder / name) != digest:
            raise CheckpointError(
                f"{folder / name} does not match the checksum recorded in {path}: the file was changed or "
                "damaged after the checkpoint was written. Resume from another checkpoint."
            )
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.name != DP_STATE and not file.name.startswith(".") and file.name not in files:
            raise CheckpointError(
                f"{file} is not covered by the checksums in {path}: it was added, or its entry removed, after the "
                "checkpoint was written. Resume from another checkpoint."
            )
    if not set(WEIGHTS) & set(files):
        raise CheckpointError(
            f"{path} lists no weights file ({' or '.join(WEIGHTS)}) among its checksums: the entry was removed, or "
            "the weights were not saved as safetensors (save_safetensors=False), which a resume cannot read."
        )


# the fields accountant.json and dp_state.json both hold, which must be equal
_RECORDED = ("noise_multiplier", "calibration_source", "delta", "expected_batch_size", "sampling_mode", "mechanism")


def _check_records(folder: Path, manifest: dict[str, Any]) -> None:
    """The ledger of ``dp_state.json`` is valid and, when the run was accounted, equal to that of ``accountant.json``,
    whose multiplier, delta, batch, sampler, mechanism and step count agree with ``dp_state.json`` too."""
    path = folder / DP_STATE
    try:
        ledger = accounting.Ledger.from_json(manifest["ledger"])
    except OpakeError as exc:
        raise CheckpointError(f"{path}: its privacy ledger is invalid ({exc}).") from exc
    if ACCOUNTANT not in manifest["files"]:  # a run with privacy_accounting=False writes no public record
        return
    record = read_json(folder / ACCOUNTANT)
    if not isinstance(record, dict):
        raise CheckpointError(f"{folder / ACCOUNTANT} must hold a JSON object, got {type(record).__name__}.")
    horizon = is_horizon(manifest["mechanism"], manifest["sampling_mode"])
    expected = {
        **{name: manifest[name] for name in _RECORDED},
        "ledger": manifest["ledger"],
        "horizon": horizon,
        "steps": manifest["total_steps"] if horizon else ledger.releases,
    }
    differ = sorted(name for name, value in expected.items() if name not in record or record[name] != value)
    if differ:
        raise CheckpointError(
            f"{folder / ACCOUNTANT} disagrees with {path} on {differ}: the public record and the private state of "
            "one checkpoint always hold the same ledger and parameters, so one of them was edited. Resume from "
            "another checkpoint."
        )


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
