"""The model card of a privately trained model: ``README.md`` stating the guarantee and what lies outside it.

:func:`model_card` is a pure function of the public privacy record (what ``accountant.json`` holds, see
:func:`opake_torch.transformers.saving.accountant_record`), the arguments and the privacy unit; it returns
the markdown, with Hugging Face metadata (YAML front matter) on top. :func:`write_model_card` writes it as
``README.md``; for a PEFT adapter it keeps the metadata of the card peft wrote (``base_model``, ``library_name:
peft``, tags) and replaces peft's generic text. ``DPTrainer.save_model`` writes the card beside the weights, so
it is part of every upload (:mod:`opake_torch.hub`).

The card states epsilon and delta, the accountant and the neighbouring relation, the privacy unit (one example, one
sequence, one preference pair, one block of packed tokens: always one row of the training dataset; for packed blocks
it says that a document spanning several is protected at group level only), the sampler, the mechanism, clipping,
the noise multiplier and the number of steps, and lists what the guarantee does not cover.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "OUTSIDE_THE_GUARANTEE",
    "base_model_of",
    "model_card",
    "packing_note",
    "privacy_unit",
    "write_model_card",
    "write_trainer_card",
]

ACCOUNTANTS = {
    "pld": "privacy loss distributions (dp-accounting's `PLDAccountant`, pessimistic discretization: an upper bound)",
    "rdp": "Rényi DP (dp-accounting's `RdpAccountant`: an upper bound)",
    "monte_carlo": "a Monte Carlo estimate with a pessimistic confidence bound (failure probability 1e-6)",
    "analytic_gaussian": "the analytic Gaussian mechanism bound without amplification (Balle and Wang 2018)",
}
ADJACENCY = {
    "add_or_remove": "adding or removing one privacy unit",
    "replace_one": "replacing one privacy unit",
}
SAMPLERS = {
    "poisson": "Poisson sampling: every row joins each batch independently with probability q",
    "k_out_of_t": "k-out-of-t sampling: every row takes part in k of every t steps, at random",
    "fixed_size": "fixed-size batches: every batch is a uniformly random set of exactly B distinct rows",
    "sequential": "a fixed sequential order (no amplification; allowed for non-private runs only)",
    "cyclic_poisson": "cyclic Poisson sampling: the rows are split into bands, each sampled with Poisson in turn",
    "b_min_sep": "b-min-separation sampling: a row takes part at most once in any b consecutive steps",
    "balls_in_bins": "balls-in-bins: every row is assigned to one random batch of each epoch",
}
UNITS = {"causal_lm": "one sequence", "masked_lm": "one sequence"}  # task -> privacy unit; other tasks: one example
OUTSIDE_THE_GUARANTEE = (
    "**Logged metrics.** The training loss, clip rate and every other statistic in the logs (`runs/`, the "
    "reporting integrations, `train_results.json`, `trainer_state.json`) are exact statistics of the private data. "
    "Only the privacy parameters (epsilon, delta, noise multiplier, noise std, clipping bound) are public.",
    "**Evaluation.** Evaluation and prediction metrics are computed without noise; when the evaluation data is "
    "private, they are not covered.",
    "**Hyperparameter tuning.** The guarantee covers this one training run. Other runs on the same data (to choose "
    "learning rates, epochs, clipping) and the choice among them cost privacy too and are not accounted here.",
    "**The base model's pretraining data.** The guarantee covers only the rows of this training dataset; what the "
    "base model learned from its own data is not protected by it.",
    "**The dataset size and data preparation.** The number of rows (which sets the sampling rate and the default "
    "delta) is treated as public, and so is anything computed from the data outside the trainer (tokenizer, "
    "filtering, deduplication).",
)


def privacy_unit(task: str | None, declared: str | None = None, *, block: int | None = None) -> str:
    """The privacy unit a trainer names on its card: one block of ``block`` tokens where the training rows look like
    packed blocks of documents (:func:`.dataset_check.packed_block`), else ``declared`` (a trainer's
    ``privacy_unit`` attribute) or the one of its task (one sequence for a causal LM, else one example)."""
    if block is not None:
        return f"one block of {block} tokens"
    return declared or UNITS.get(task or "", "one example")


def packing_note(block: int) -> str:
    """What the card says of packed rows of ``block`` tokens: a document is protected at group level only."""
    return (
        f"**Packed rows.** Every training row holds exactly {block} tokens, without padding, labelled by its own "
        "tokens: the shape of blocks cut from concatenated documents (`run_clm.py`'s `group_texts`). The guarantee "
        f"protects one block of {block} tokens, not one document: a document spanning k blocks is protected only as "
        "a group of k units, by group privacy (k·ε, k·e^((k-1)ε)·δ). To protect documents, train on one document "
        "per row."
    )


def model_card(
    record: Mapping[str, Any] | None,
    args: Any,
    *,
    unit: str,
    metadata: Mapping[str, Any] | None = None,
    model_name: str | None = None,
    versions: Mapping[str, str] | None = None,
    block: int | None = None,
) -> str:
    """The markdown of the card: front matter from ``metadata``, then the guarantee of ``record`` (the public
    privacy record of the run; None when no private training ran) under ``args``, for the privacy unit ``unit``;
    ``block``: the training rows looked like packed blocks of that many tokens (:func:`packing_note`)."""
    lines = [_front_matter(metadata or {}), f"# {model_name or 'Model'} (differentially private)", ""]
    base = (metadata or {}).get("base_model")
    source = f" from [`{base}`](https://huggingface.co/{base})" if isinstance(base, str) and base else ""
    lines += [
        f"This model was fine-tuned{source} with differential privacy by Opake's `DPTrainer`. The privacy unit is "
        f"**{unit}**: {_scope(args)}.",
        "",
        "## Privacy guarantee",
        "",
        *_guarantee(record, args, unit),
        *(["", packing_note(block)] if block is not None else []),
        "",
        "## Outside the guarantee",
        "",
        *(f"- {item}" for item in OUTSIDE_THE_GUARANTEE),
        "",
        "## Training",
        "",
        "The public privacy record, with every release of the run in order, is `accountant.json` beside the "
        "weights; it holds no secret (the noise and sampler keys are never saved with the model).",
        "",
        "Framework versions: " + ", ".join(f"{k} {v}" for k, v in (versions or _versions()).items()) + ".",
        "",
    ]
    return "\n".join(lines)


def _guarantee(record: Mapping[str, Any] | None, args: Any, unit: str) -> list[str]:
    if record is None:
        return ["No private training run produced these weights: they carry no guarantee from Opake."]
    epsilon, delta = record.get("epsilon"), record["delta"]
    if record["noise_multiplier"] == 0 or epsilon in ("inf", math.inf):
        head = (
            "**None.** This run was not private (noise multiplier 0): epsilon is infinite. The weights may reveal "
            "any training row."
        )
    elif epsilon is None:
        head = (
            "Epsilon was not computed for this run (`privacy_accounting=False`). The mechanism below was applied; "
            "compute its epsilon with `opake privacy epsilon` and the values below."
        )
    else:
        relation = ADJACENCY.get(record.get("adjacency", "add_or_remove"), record.get("adjacency"))
        horizon = " for its whole declared horizon" if record.get("horizon") else ""
        differ = _scope(args, neighbours=True)
        head = (
            f"The training run is **(ε = {epsilon:.4g}, δ = {delta:.3g})-differentially private**{horizon} with "
            f"respect to {relation} ({unit}): for any two training datasets D and D' that differ in {differ} and any "
            f"set S of outcomes, P[M(D) ∈ S] ≤ e^ε · P[M(D') ∈ S] + δ, where M(D) is everything the run released "
            f"(the weights at every step, so every checkpoint's too)."
        )
    rows = [
        ("epsilon", "not computed" if epsilon is None else f"{_number(epsilon)} ({_span(record)})"),
        ("delta", _number(delta)),
        ("accountant", ACCOUNTANTS.get(record.get("accountant"), record.get("accountant") or "none")),
        ("neighbouring relation", ADJACENCY.get(record.get("adjacency", "add_or_remove"), "add or remove one")),
        ("privacy unit", f"{unit} ({_scope(args)})"),
        *_users(record),
        ("sampler", _sampler(record, args)),
        ("mechanism", _mechanism(record["mechanism"])),
        ("clipping", _clipping(args)),
        ("noise multiplier", f"{_number(record['noise_multiplier'])}{_calibration(record)}"),
        ("steps", f"{record['steps']}"),
        *_router_release(record, args),
    ]
    return [head, "", "| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]


def _scope(args: Any, *, neighbours: bool = False) -> str:
    """What one unit is in the dataset: one row, or (``privacy_unit="user"``) all the rows of one user."""
    if getattr(args, "privacy_unit", "record") != "user":
        return "one row" if neighbours else "one row of the training dataset"
    column = f"`{args.privacy_user_column}`"
    return f"all the rows of one {column}" if neighbours else f"all the rows sharing one value of {column}"


def _users(record: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The user-level rows of the table: how many users, and what one contributes to a step."""
    if record.get("privacy_unit") != "user":
        return []
    return [
        ("users", f"{record['users']} (the sample rate q is per user)"),
        ("rows of a user per step", f"at most {record['max_rows_per_user']}, the {record['user_reduction']} of "
                                    "their gradients clipped together"),
    ]  # fmt: skip


def _router_release(record: Mapping[str, Any], args: Any) -> list[tuple[str, str]]:
    """The MoE router release's row: every step also released the router load statistic, and epsilon accounts each
    step's pair as one Gaussian at ``z / sqrt(1 + ratio)`` (``accounting.moe_aux``)."""
    if not getattr(args, "router_release", False):
        return []
    kwargs = args.router_aux_kwargs
    ratio, z = float(kwargs["ratio"]), float(record["noise_multiplier"])
    return [
        (
            "MoE router release",
            f"every step also released the routers' load statistic with noise multiplier z / sqrt({ratio:g}) "
            f"(max_tokens {kwargs['max_tokens']}); epsilon accounts each step as one Gaussian with multiplier "
            f"z / sqrt(1 + {ratio:g}) = {_number(z / math.sqrt(1.0 + ratio))}",
        )
    ]


def _span(record: Mapping[str, Any]) -> str:
    if record.get("horizon"):
        return "the whole declared horizon"
    return "every step of the run, across resumes and train() calls"


def _number(value: Any) -> str:
    return "inf" if value in ("inf", math.inf) else f"{float(value):.6g}"


def _sampler(record: Mapping[str, Any], args: Any) -> str:
    mode = record["sampling_mode"]
    text = f"{SAMPLERS.get(mode, mode)}; q = {_number(record['sample_rate'])}"
    if record.get("privacy_unit") == "user":  # the sampler draws users, and each sampled user gives its rows
        text = text.replace(" rows", " users").replace(" row ", " user ").replace("every row", "every user")
    if record.get("expected_batch_size") is not None:
        text += f", expected batch {_number(record['expected_batch_size'])}"
    cap = (getattr(args, "sampling_kwargs", None) or {}).get("truncated_batch_size")
    return text + (f", truncated at {cap} rows" if cap else "")


def _mechanism(name: str) -> str:
    if name == "gaussian":
        return "the Gaussian mechanism with independent noise at every step (DP-SGD)"
    return f"DP-FTRL: the Gaussian matrix mechanism with correlated noise across steps (strategy `{name}`)"


def _clipping(args: Any) -> str:
    text = _example_clipping(args)
    if getattr(args, "privacy_unit", "record") == "user":
        rows = f"each user's gradient (the {args.privacy_user_reduction} of its rows')"
        return text.replace("each example's gradient", rows)
    return text


def _example_clipping(args: Any) -> str:
    bound, mode = args.clipping_norm, args.clipping_mode
    if isinstance(bound, dict):
        groups = ", ".join(f"`{k}`: {_number(v)}" for k, v in bound.items())
        return f"each example's gradient clipped per parameter group to L2 norms {groups}"
    if mode == "auto":
        return f"AUTO-S: each example's gradient scaled by R / (norm + γ), sensitivity R = {_number(bound)}"
    if mode == "adaptive":
        return (
            f"adaptive: each example's gradient clipped to a bound that tracks a private quantile of the norms "
            f"(initially {_number(bound)}; its noisy count is accounted)"
        )
    return f"each example's gradient clipped to L2 norm {_number(bound)}"


def _calibration(record: Mapping[str, Any]) -> str:
    source = record.get("calibration_source")
    return " (calibrated to the target epsilon)" if source == "calibrated" else ""


def _front_matter(metadata: Mapping[str, Any]) -> str:
    from huggingface_hub import ModelCardData

    return f"---\n{ModelCardData(**metadata).to_yaml()}\n---\n"


def _versions() -> dict[str, str]:
    import opake_torch

    found = {"opake": opake_torch.__version__}
    for name in ("transformers", "peft", "torch"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def write_model_card(
    folder: str | Path,
    record: Mapping[str, Any] | None,
    args: Any,
    *,
    unit: str,
    metadata: Mapping[str, Any] | None = None,
    model_name: str | None = None,
    block: int | None = None,
) -> Path:
    """Write :func:`model_card` to ``folder/README.md`` (``block``: packed rows, :func:`packing_note`). The metadata
    of a card already there (peft's, or an earlier one) is kept and extended: its tags are merged, ``metadata`` wins
    elsewhere; its text is replaced."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / "README.md"
    merged: dict[str, Any] = {}
    if path.is_file():
        from huggingface_hub import ModelCard

        merged = {k: v for k, v in ModelCard.load(path).data.to_dict().items() if v not in (None, [], "")}
    new = {k: v for k, v in (metadata or {}).items() if v not in (None, [], "")}
    tags = [*_as_list(merged.get("tags")), *_as_list(new.pop("tags", None)), "opake", "differential-privacy"]
    tags = [tag for tag in tags if not str(tag).endswith(":")]  # peft's "base_model:adapter:" without a base
    merged.update(new)
    merged["tags"] = list(dict.fromkeys(tags))
    merged.setdefault("library_name", "transformers")
    card = model_card(record, args, unit=unit, metadata=merged, model_name=model_name, block=block)
    path.write_text(card, encoding="utf-8")
    return path


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def base_model_of(model: Any) -> str | None:
    """The Hub id the model was loaded from (``config._name_or_path``; a PEFT model's base), or None for a local
    folder or a model built from a configuration."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, dict) and peft:
        name = getattr(next(iter(peft.values())), "base_model_name_or_path", None) or name
    if not isinstance(name, str) or os.path.exists(name) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        return None
    return name


def write_trainer_card(
    trainer: Any,
    folder: Path,
    *,
    language: str | None = None,
    license: str | None = None,
    tags: str | list[str] | None = None,
    model_name: str | None = None,
    finetuned_from: str | None = None,
    tasks: str | list[str] | None = None,
    dataset_tags: str | list[str] | None = None,
    dataset: str | list[str] | None = None,
    dataset_args: str | list[str] | None = None,
) -> Path:
    """The card of a :class:`~opake_torch.transformers.DPTrainer`'s last run (its plan and ledger), written to
    ``folder`` with Hugging Face's ``create_model_card`` arguments as metadata: ``finetuned_from`` (default: the
    model's Hub id) as ``base_model``, a single ``tasks`` as ``pipeline_tag``, ``dataset_tags`` (else ``dataset``)
    as ``datasets``. Hugging Face's table of training losses and evaluation results is left out: those are outside
    the guarantee. ``dataset_args`` is accepted and unused."""
    from opake_torch.transformers.saving import accountant_record

    plan, args = trainer.privacy_plan, trainer.args
    record = None if plan is None else accountant_record(args, plan, trainer.ledger)
    task = tasks[0] if isinstance(tasks, list) and len(tasks) == 1 else tasks
    metadata = {
        "language": language,
        "license": license,
        "tags": tags,
        "base_model": finetuned_from or base_model_of(trainer.model),
        "pipeline_tag": task if isinstance(task, str) else None,
        "datasets": _as_list(dataset_tags or dataset),
    }
    block = trainer.packed_block
    unit = "one user" if args.privacy.user_level else privacy_unit(trainer.task, trainer.privacy_unit, block=block)
    name = model_name or Path(folder).resolve().name
    return write_model_card(folder, record, args, unit=unit, metadata=metadata, model_name=name, block=block)
