"""Publishing a trained model: what may leave the machine.

An output folder holds more than weights. ``runs/`` holds exact training statistics (outside the privacy
guarantee), and a checkpoint's ``dp_state.json`` holds the secret keys that generated the noise: whoever has them can
recompute the noise and remove it. ``*_results.json`` and ``*_results.txt`` (what ``save_metrics`` and example
scripts write: training loss, evaluation metrics, predictions) are exact statistics of the data too. The model card
(``README.md``) and ``accountant.json`` state the guarantee and are published with the weights.
:func:`publishable_files` lists what an upload may contain, and :func:`strip_private_state` deletes the rest from a
folder before it is shared by other means.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "PRIVATE_FILES",
    "PRIVATE_FOLDERS",
    "publishable_files",
    "push_to_hub",
    "push_trainer",
    "strip_private_state",
]

PRIVATE_FOLDERS = ("runs",)
PRIVATE_FILES = (
    "dp_state.*",
    "dp_optimizer.*",
    "rng_state*.pth",
    "trainer_state.json",
    "training_args.json",
    "*_results.json",
    "*_results.txt",
)


def _private(relative: str) -> bool:
    parts = relative.split("/")
    if parts[0] in PRIVATE_FOLDERS or parts[0].startswith("checkpoint-"):
        return True
    if any(part.startswith((".", "_")) for part in parts):
        return True
    return any(fnmatch.fnmatch(parts[-1], pattern) for pattern in PRIVATE_FILES)


def publishable_files(folder: str | Path) -> list[str]:
    """The files under ``folder`` (relative POSIX paths, sorted) that an upload may include.

    Excluded: ``runs/`` (training logs outside the guarantee), every ``checkpoint-*`` folder (keys, optimizer and
    sampler state), ``dp_state.*``, ``dp_optimizer.*``, RNG snapshots, trainer state and arguments, and hidden or
    underscore-prefixed files, and ``*_results.json`` / ``*_results.txt`` (``save_metrics``, predictions).
    ``accountant.json`` and ``README.md`` (the privacy guarantee itself) and the weights stay.
    """
    root = Path(folder)
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            relative = path.relative_to(root).as_posix()
            if not _private(relative):
                found.append(relative)
    return sorted(found)


def strip_private_state(folder: str | Path) -> list[str]:
    """Delete from ``folder`` everything :func:`publishable_files` excludes; returns the removed relative paths."""
    root = Path(folder)
    keep = set(publishable_files(root))
    removed = []
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        relative = path.relative_to(root).as_posix()
        if path.is_file() and relative not in keep:
            path.unlink()
            removed.append(relative)
        elif path.is_dir() and not any(path.iterdir()):
            shutil.rmtree(path)
    return sorted(removed)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = True,
    commit_message: str | None = "Opake",
    revision: str | None = None,
) -> object:
    """Upload the publishable files of ``folder`` to a Hugging Face Hub repository (needs ``huggingface_hub``)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        allow_patterns=publishable_files(folder),
        commit_message=commit_message or "Opake",
        revision=revision,
    )


def push_trainer(
    trainer: Any,
    commit_message: str | None = "End of training",
    blocking: bool = True,
    token: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
    **kwargs: Any,
) -> object:
    """``DPTrainer.push_to_hub`` with Hugging Face's arguments: save the model, the tokenizer, ``accountant.json``
    and the model card to ``output_dir`` (``kwargs`` go to ``create_model_card``; ``model_name`` defaults to the
    repository's name), then upload its publishable files to ``args.hub_model_id`` (default: ``output_dir``'s
    name). The repository is created private unless ``private`` (or ``args.hub_private_repo``) is False. The upload
    always blocks (``blocking`` is accepted for compatibility); other ranks only save."""
    args = trainer.args
    repo = args.hub_model_id or Path(args.output_dir).name
    folder = trainer.save_model()
    if not trainer.is_world_process_zero():
        return None
    trainer.create_model_card(model_name=kwargs.pop("model_name", None) or repo.split("/")[-1], **kwargs)
    private = private if private is not None else args.hub_private_repo is not False
    return push_to_hub(
        folder,
        repo,
        token=token or args.hub_token,
        private=private,
        commit_message=commit_message,
        revision=revision,
    )
