"""How a ``train()`` call starts: everything a resume decides, in :func:`resume`, and the checkpoint read back.

A call continues either a checkpoint (``resume_from_checkpoint``; the files: :mod:`.checkpoint_folder`, written by
:mod:`.saving`) or the trainer's own history. :func:`resume` decides, in one place, what it continues: the ledger
(the checkpoint's, else the trainer's), the plan (delta and multiplier kept where the run continues), the keys (kept
or a new segment), and, for a checkpoint, the tensors, counters, sampler state and trainer state, after checking that
the counters agree and that a horizon run's configuration is unchanged.

A resume keeps the checkpoint's noise and sampler keys only when it continues the checkpoint's trajectory exactly:
the same arguments (:func:`.checkpoint_folder.configuration`) *and* the same training data (:mod:`.fingerprint`).
Anything else is a new segment with new keys, composed in the ledger with what ran before: noise already drawn for
one trajectory is never added to another, where the difference of the two would reveal the records that differ.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from opake_core import accounting
from opake_core.errors import CheckpointError, ConfigurationError, OpakeError, PrivacyBudgetError
from opake_core.sampling.state import SamplerState
from opake_core.step import rekeyed
from opake_torch import sharded
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers import routers, sharded_state
from opake_torch.transformers.fingerprint import DatasetFingerprint, dataset_fingerprint
from opake_torch.transformers.keys import RunKeys, next_keys
from opake_torch.transformers.privacy import PrivacyPlan, build_plan, check_next_segment, resolve_delta
from opake_torch.transformers.run_state import DPTrainerState, Run
from opake_torch.transformers.saving import copy_into, mechanism_fields
from opake_torch.transformers.users import Users

__all__ = [
    "check_replay",
    "check_router_resume",
    "check_same_run",
    "planned",
    "restore",
    "restore_weights",
    "resume",
    "resume_point",
    "resumed_data",
    "resumed_delta",
    "resumed_keys",
    "saved_ledger",
]

logger = logging.getLogger(__name__)


def resume(
    resume_from_checkpoint: str | bool | None,
    *,
    args: Any,
    dataset: Any,
    columns: set[str] | None,
    ledger: accounting.Ledger,
    keys: RunKeys,
    trained: bool,
    router_settings: dict[str, Any] | None,
    model: nn.Module,
    topology: Any,
    start: Callable[[PrivacyPlan, RunKeys, accounting.Ledger], Run],
    users: Users | None = None,
) -> Run:
    """The run of a ``train()`` call on ``dataset`` (the rows' ``columns`` kept), at the step it continues from.

    ``resume_from_checkpoint`` is a checkpoint folder, True for the latest one under ``output_dir``, or nothing:
    the call then continues the trainer's ``ledger`` with its ``keys``, or with new ones when it already ``trained``
    (a second call is a new segment). ``router_settings`` are the MoE router release's (None: off), which a resume
    may not change. ``start(plan, keys, ledger)`` builds the run's step and the :class:`.run_state.Run` before its
    first step, from the ledger it starts with (a horizon run's whole release recorded at its start); a
    checkpoint's state is then loaded into it (:func:`restore`), and every DDP rank must agree on the result.
    ``users``: the dataset's users under ``privacy_unit="user"`` (the plan is over them, and their column is part of
    the data a resume compares).
    """
    folder, saved = resume_point(resume_from_checkpoint, args.output_dir)
    if saved is None and trained:
        check_next_segment(args)
    check_router_resume(saved, folder, router_settings)
    if saved is not None:
        ledger = saved_ledger(saved, folder)
    unchanged = saved is not None and saved["configuration"] == ckpt.configuration(args)
    unchanged = unchanged and saved["world_size"] == args.privacy.world_size  # other ranks draw other batches
    if users is not None and columns is not None:
        columns = {*columns, users.column}
    data = dataset_fingerprint(dataset, columns)  # one pass: what a resume compares
    same_data = resumed_data(args, saved, folder, data)
    plan = planned(
        args, len(dataset), ledger, saved=saved, folder=folder, continued=unchanged and same_data, users=users
    )
    fresh = lambda: next_keys(args, released=ledger.releases, share=topology.shared_key)  # noqa: E731
    if saved is None:  # the trainer's keys, or new ones for its next segment
        keys = fresh() if trained else keys
    else:
        keys = resumed_keys(args, saved, folder, plan, unchanged=unchanged, same_data=same_data, fresh=fresh)
    run = start(plan, keys, ledger if saved or not plan.horizon else ledger.record(plan.release))
    run.dataset = data
    if saved is not None:
        restore(folder, saved, run, args=args, model=model, topology=topology)
    topology.check_agree(**run.agreement(args, 0 if run.restored is None else run.restored.global_step))
    return run


def planned(
    args: Any,
    dataset_size: int,
    ledger: accounting.Ledger,
    *,
    saved: dict[str, Any] | None = None,
    folder: Path | None = None,
    continued: bool = False,
    users: Users | None = None,
) -> PrivacyPlan:
    """The plan of a ``train()`` call on ``dataset_size`` records after ``ledger``: without ``saved`` (a checkpoint's
    ``dp_state.json``, in ``folder``), that of a call that resumes nothing; with it, the checkpoint's steps are done
    and its delta kept (:func:`resumed_delta`), and its multiplier too when the call ``continued`` its trajectory
    (same arguments, same data). With ``users`` (``privacy_unit="user"``), the plan is over the users."""
    units = dataset_size if users is None else users.count
    return build_plan(
        args,
        dataset_size,
        spent=ledger,
        done=saved["global_step"] if saved else 0,
        resumed_multiplier=saved["noise_multiplier"] if saved and continued else None,
        delta=resumed_delta(args, saved, folder, units),
        users=users,
    )


def resume_point(resume_from_checkpoint: str | bool | None, output_dir: str) -> tuple[Path | None, dict | None]:
    """``(folder, its dp_state.json)`` for ``train(resume_from_checkpoint=...)``: a folder, True for the latest
    checkpoint under ``output_dir``, or nothing (``(None, None)``); CheckpointError when it cannot be resumed.
    A bad checkpoint key (:data:`.checkpoint_folder.KEY_ENV`) is refused here, before any step rather than at the first
    save."""
    ckpt.seal_key()
    if resume_from_checkpoint is True:
        folder = ckpt.latest_checkpoint(output_dir)
        if folder is None:
            raise CheckpointError(f"resume_from_checkpoint=True but {output_dir} holds no checkpoint.")
    elif not resume_from_checkpoint:
        return None, None
    else:
        folder = Path(resume_from_checkpoint)
    ckpt.require_resumable(folder)
    return folder, ckpt.read_manifest(folder)


def resumed_data(args: Any, saved: dict[str, Any] | None, folder: Path | None, data: DatasetFingerprint) -> bool:
    """Whether this ``train()`` trains on the data of the checkpoint it resumes (True without one); ``data``: the
    fingerprint of its training data.

    Changed data (another number of rows, or any row changed) is logged as a warning: the run continues as a new
    segment with new keys (:func:`resumed_keys`). ``ignore_data_skip=True`` is warned about, since it has no effect:
    the batch of step ``t`` is drawn from the sampler key and ``t``, so a resume neither skips nor replays data.
    """
    if args.ignore_data_skip:
        logger.warning(
            "ignore_data_skip=True has no effect: a DP resume skips no data (the batch of each step is drawn from the "
            "sampler key and the step number), so it continues the checkpoint's batches as it would with False."
        )
    if saved is None:
        return True
    before = DatasetFingerprint.from_json(saved["dataset"], f"{folder}/{ckpt.DP_STATE}")
    if before == data:
        return True
    change = (
        f"{before.size} rows then, {data.size} now"
        if before.size != data.size
        else f"the same number of rows, {data.size}, with different content"
    )
    logger.warning(
        "the training data differ from those %s was trained on (%s): the run continues as a new segment with new "
        "noise and sampler keys, and its ledger composes the new steps (at the sampling rate of the new data) with "
        "those already taken. The weights still carry what the earlier steps learned from the old data.",
        folder,
        change,
    )
    return False


def resumed_delta(args: Any, saved: dict[str, Any] | None, folder: Path | None, dataset_size: int) -> float | None:
    """The delta of a resumed run: the checkpoint's, unless ``privacy_target_delta`` is set (None: the plan
    resolves it from the arguments, as for a new run).

    A run states every epsilon at one delta, so the default ``1/N**1.1`` is not recomputed when a resume trains on
    another number of records ``N``: the checkpoint's delta is kept (with a warning when the default would differ),
    and refused with PrivacyBudgetError at or above ``1/N`` of the new data unless ``privacy_allow_large_delta``.
    """
    if saved is None or args.privacy_target_delta is not None:
        return None
    delta, default = saved["delta"], resolve_delta(args, dataset_size)
    if delta == default:
        return delta
    if delta >= 1 / dataset_size and not args.privacy_allow_large_delta:
        raise PrivacyBudgetError(
            f"{folder} states its guarantee at delta={delta:.3g}, which is >= 1/N = {1 / dataset_size:.3g} for the "
            f"{dataset_size} records this run trains on. Set privacy_target_delta below 1/N (1/N**1.1 = "
            f"{default:.3g}) to state the epsilon of the whole run at that delta, or privacy_allow_large_delta=True "
            "to accept it."
        )
    logger.warning(
        "the resumed run keeps the delta of %s, %.3g, rather than 1/N**1.1 = %.3g for the %d records it trains on "
        "now, so that every epsilon of the run is stated at one delta; set privacy_target_delta to state the whole "
        "run at another delta.",
        folder,
        delta,
        default,
        dataset_size,
    )
    return delta


def resumed_keys(
    args: Any,
    saved: dict[str, Any],
    folder: Path,
    plan: PrivacyPlan,
    *,
    unchanged: bool,
    same_data: bool,
    fresh: Callable[[], RunKeys],
) -> RunKeys:
    """The keys of a resumed run: the checkpoint's for an unchanged resume (same arguments, same multiplier, same
    data: :func:`resumed_data`), else ``fresh()`` (a new segment), after refusing a resume that
    :func:`check_same_run` refuses, a horizon run on changed data, and an unchanged resume whose checkpoint does not
    hold what its configuration released (:func:`check_replay`)."""
    check_same_run(args, saved, plan, folder)
    keys = RunKeys.from_json(saved, f"{folder}/{ckpt.DP_STATE}")  # read even when unused: a damaged file is refused
    if not same_data:
        if plan.horizon:
            raise CheckpointError(
                f"{folder} belongs to a {args.privacy_noise_mechanism!r} / {args.sampling_mode!r} run, accounted once "
                "for its whole horizon with noise correlated across its steps, and the training data changed: its "
                "horizon cannot continue on other data. Resume with the same data, or start a new run."
            )
        return fresh()
    if unchanged:
        check_replay(saved, plan, saved_ledger(saved, folder), folder)
        if plan.noise_multiplier == saved["noise_multiplier"]:
            return keys
    logger.info("the configuration changed since %s: the run continues with new noise and sampler keys", folder)
    return fresh()


def check_replay(saved: dict[str, Any], plan: PrivacyPlan, ledger: accounting.Ledger, folder: Path) -> None:
    """CheckpointError unless a checkpoint resumed with its own arguments and data holds what they release.

    Such a checkpoint was written by this very configuration, so its batch, horizon and delta, its multiplier (when
    fixed) and the last release of its per-step ledger are what this plan recomputes from the arguments and the
    data; a difference means that ``dp_state.json`` was edited.
    """
    recomputed = {"expected_batch_size": plan.expected_batch_size, "total_steps": plan.total_steps, "delta": plan.delta}
    if plan.calibration_source == "fixed":
        recomputed["noise_multiplier"] = plan.noise_multiplier
    differ = {name: (saved[name], value) for name, value in recomputed.items() if saved[name] != value}
    last = ledger.entries[-1][0] if ledger.entries else None
    if not plan.horizon and plan.noise_multiplier == saved["noise_multiplier"] and last != plan.release:
        differ["ledger (last release)"] = (last, plan.release)
    if differ:
        raise CheckpointError(
            f"{folder}/{ckpt.DP_STATE} does not hold what its own arguments and data release; (saved, recomputed): "
            f"{differ}. The file was edited after the checkpoint was written. Resume from another checkpoint."
        )


def restore(folder: Path, saved: dict[str, Any], run: Run, *, args: Any, model: nn.Module, topology: Any) -> None:
    """Load the checkpoint's tensors, weights and trainer state (``run.restored``) into ``run``, after checking that
    its step counters agree (CheckpointError otherwise)."""
    router = run.router_state
    if "shards" in saved:  # a sharded run's files, read on this run's layout (parameters included)
        step_tree, run.opt_state = read_sharded(folder, saved["shards"], run, args=args, topology=topology)
        step_state, rng_state, router_state = step_tree["step_state"], step_tree["torch_rng_state"], None
    else:
        step_state, run.opt_state, rng_state, router_state = ckpt.read_tensors(
            folder,
            step_template=run.dp_state,
            opt_template=run.opt_state,
            device=args.device,
            router_template=None if router is None else routers.unkeyed(router),
        )
    try:
        loaded = DPTrainerState.load_from_json(str(folder / ckpt.TRAINER_STATE))
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{folder / ckpt.TRAINER_STATE} is unreadable: {exc}") from exc
    sampler = SamplerState.from_json(saved["sampler_state"])
    counters = {
        f"{ckpt.DP_STATE} global_step": saved["global_step"],
        f"{ckpt.TRAINER_STATE} global_step": loaded.global_step,
        "step state": step_state.step,
        "sampler state": sampler.step,
        **({} if router_state is None else {"router state": router_state.step}),
    }
    if len(set(counters.values())) != 1 or (not run.plan.horizon and run.ledger.releases < sampler.step):
        raise CheckpointError(
            f"{folder}: the step counters disagree ({counters}; {run.ledger.releases} releases in the ledger), "
            "so the checkpoint was edited or assembled from different runs. Resume from another checkpoint."
        )
    if "shards" in saved:
        run.params = step_tree["params"]
        copy_into(model, run.params)
    else:
        run.params = restore_weights(model, folder, args.device, set(run.params))
    run.dp_state = rekeyed(step_state, run.dp_state)  # the keys of this segment (saved unkeyed)
    if router_state is not None:
        run.router_state = routers.rekeyed(router_state, router)
    torch.set_rng_state(rng_state)
    run.sampler_state = topology.sampler_state(sampler, run.sampler_state)
    run.restored, run.checkpoint = loaded, folder


def read_sharded(folder: Path, shards: Any, run: Run, *, args: Any, topology: Any) -> tuple[dict[str, Any], Any]:
    """``(step tree, optimizer state)`` of a sharded checkpoint for this run's layout: its own files on the same
    world size, the rows put together and cut again on another (or whole, in one process)."""
    names = sharded.leaf_names(run.params)
    template = {"params": run.params, "step_state": run.dp_state, "torch_rng_state": torch.get_rng_state()}
    return sharded_state.read(
        folder, shards, templates=(template, run.opt_state), shard=getattr(topology, "layout", None), names=names,
        rank=args.process_index, world_size=args.world_size, device=args.device,
    )  # fmt: skip


def check_router_resume(saved: dict[str, Any] | None, folder: Path | None, settings: dict[str, Any] | None) -> None:
    """Refuse a resume that switches the router release on or off, or changes its ``settings`` (None: off)."""
    if saved is None:
        return
    before = saved.get("router_release")
    if before != settings:
        raise ConfigurationError(
            f"{folder} was written with the router release {'off' if before is None else before}, this run has "
            f"it {'off' if settings is None else settings}: a resume may not switch the MoE router release "
            "(router_aux_loss_coef, router_aux_kwargs) on or off or change its settings, since its filtered "
            "state and accounting continue across the resume. Resume with the checkpoint's settings, or start a "
            "new run."
        )


def saved_ledger(saved: dict[str, Any], folder: Path | None) -> accounting.Ledger:
    """The privacy ledger of a checkpoint's ``dp_state.json``; CheckpointError when it is invalid."""
    try:
        return accounting.Ledger.from_json(saved["ledger"])
    except OpakeError as exc:
        raise CheckpointError(f"{folder}/{ckpt.DP_STATE}: its privacy ledger is invalid ({exc}).") from exc


def check_same_run(args: Any, saved: dict[str, Any], plan: PrivacyPlan, folder: Path | None) -> None:
    """Refuse a horizon resume whose world size, mechanism, horizon, multiplier, rate or clipping changed: a horizon
    is accounted as a whole and its noise is correlated across steps. (A per-step run resumed on another world size
    continues as a new segment, with new keys.)"""
    if not plan.horizon:
        return
    if saved["world_size"] != args.privacy.world_size:
        raise CheckpointError(
            f"{folder} was written with world size {saved['world_size']}, this run has {args.privacy.world_size}: "
            "a horizon run's cyclic sampling partitions the data by rank. Resume with the same number of processes."
        )
    changed = {k: (saved[k], v) for k, v in mechanism_fields(args, plan).items() if saved[k] != v}
    if changed:
        raise CheckpointError(
            f"{folder} belongs to another run configuration; (saved, now) values differ: {changed}. A horizon "
            "mechanism (DP-FTRL, k-out-of-t) is accounted for its whole horizon with correlated noise, so its "
            "mechanism, multiplier, horizon, batch and clipping cannot change on resume."
        )


def restore_weights(model: nn.Module, folder: Path, device: torch.device, trainable: set[str]) -> dict:
    """Load ``folder``'s weights (PEFT adapter or full model) into ``model``; returns copies of the ``trainable``
    parameters. CheckpointError when a file is damaged, has other shapes, or lacks a trainable parameter."""
    adapter = folder / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, _read_weights(adapter, device))
    else:
        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise CheckpointError(f"{folder} holds no model.safetensors or adapter_model.safetensors.")
        state = _read_weights(weights, device)
        own = dict(model.named_parameters())
        if trainable - set(state) - _tied_names(model) and (folder / "config.json").is_file():
            state = _converted_weights(model, folder, device) or state
        wrong = [k for k, v in state.items() if k in own and v.shape != own[k].shape]
        if wrong:
            raise CheckpointError(f"{weights} has tensors of other shapes than the model: {wrong[:5]}.")
        copy_into(model, {k: v for k, v in state.items() if k in own})
        missing = trainable - set(state) - _tied_names(model)
        if missing:
            raise CheckpointError(f"{weights} lacks trainable parameters {sorted(missing)[:5]}.")
    return {name: p.detach().clone() for name, p in model.named_parameters() if name in trainable}


def _converted_weights(model: nn.Module, folder: Path, device: torch.device) -> dict[str, torch.Tensor] | None:
    """The weights of ``folder`` under the model's own names where ``save_pretrained`` converted them (transformers 5
    saves the fused experts of a mixture-of-experts model one expert at a time), read back through
    ``from_pretrained``, which reverses the conversion; None for a model without ``from_pretrained``."""
    load = getattr(type(model), "from_pretrained", None)
    if load is None:
        return None
    dtype = next(model.parameters()).dtype
    try:  # safetensors only: nothing in a checkpoint folder is unpickled
        loaded = load(str(folder), dtype=dtype, use_safetensors=True)
    except (OSError, ValueError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{folder}: its weights cannot be read back with from_pretrained: {exc}") from exc
    return {name: value.to(device) for name, value in loaded.state_dict().items()}


def _read_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors weights file; CheckpointError when it is damaged or not safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc


def _tied_names(model: nn.Module) -> set[str]:
    all_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return all_names - {name for name, _ in model.named_parameters()}
