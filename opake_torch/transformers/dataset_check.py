"""Every row of a dataset checked against what the model and the loss will read, in one pass before the first step.

A row the loss cannot take (a class label of 7 for 3 classes, a negative label, a token id past the vocabulary, no
label column) otherwise fails inside torch at the step that first samples it, after the earlier steps released their
noise and were charged. :func:`check_dataset` streams through the rows once and refuses the first bad one, naming its
index, the column, the value seen and the fix:

* ``input_ids`` (and every ``*_input_ids`` column): a sequence of integers in ``[0, vocab)``, ``vocab`` the rows of
  the model's input embedding (else ``config.vocab_size``); required for causal language modelling, whose labels
  derive from it;
* ``attention_mask`` (``*_attention_mask``): 0/1 (integers or bools), as long as its ``input_ids``;
  ``token_type_ids``: integers in ``[0, config.type_vocab_size)``, as long as ``input_ids``;
* the label column (``label_names[0]``, or ``label`` for ``labels``), required for the classification tasks and a
  custom ``compute_loss_func``: a class id in ``[0, num_labels)`` (sequence classification), or a vector of
  ``num_labels`` finite class probabilities; a finite float when ``num_labels == 1`` or ``problem_type ==
  "regression"`` (squared error); for token classification and causal language modelling a sequence as long as
  ``input_ids`` of ids in ``[0, num_labels)`` (respectively ``[0, vocab)`` of the output embedding) or -100.

Empty sequences pass: how an empty or all-padding record trains is the collate and loss layer's decision. A trainer
whose subclass replaces the loss (``compute_per_example_loss``) gets the token checks only; its labels are its own.

Cost: one read of every row, measured on 1M rows of 128 tokens with an attention mask and a class label (one core
of a shared CPU): a ``datasets.Dataset`` is read as Arrow columns, in batches of :data:`ARROW_ROWS`, with vectorized
checks, 0.6 s (2.5 s through the indices mapping of ``shuffle`` or ``select``); any other map-style dataset is read
through ``dataset[i]`` and checked in chunks of :data:`CHUNK_ROWS` rows, 5 s for rows of tensors, 18 s for rows of
Python lists (NumPy reads each list).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.transformers.loss import IGNORE_INDEX

__all__ = [
    "ARROW_ROWS",
    "CHUNK_ROWS",
    "DataSummary",
    "Schema",
    "check_dataset",
    "dataset_schema",
    "packed_block",
    "require_random_access",
]

CHUNK_ROWS = 4096
"""Rows gathered by ``dataset[i]`` before their values are checked together."""
ARROW_ROWS = 65536
"""Rows of a ``datasets.Dataset`` read as one Arrow table."""

_INTS, _FLOATS = "iu", "f"  # NumPy dtype kinds


@dataclass(frozen=True)
class Schema:
    """What every row must hold.

    Attributes:
        vocab_size: token ids lie in ``[0, vocab_size)`` (None: unchecked).
        type_vocab_size: ``token_type_ids`` lie in ``[0, type_vocab_size)`` (None: unchecked).
        label_column: the column the loss reads labels from (``label`` is accepted for ``labels``).
        label_kind: ``"class"`` (one class id per row), ``"value"`` (one float per row, regression), ``"tokens"``
            (a sequence as long as ``input_ids`` of ids or -100), ``"any"`` (a custom loss's labels: present only),
            or None (not the trainer's loss: labels unchecked).
        label_bound: classes (``"class"``, ``"tokens"`` of token classification) or the output vocabulary
            (``"tokens"`` of causal language modelling); None: unchecked.
        require_labels: a row without the label column is refused (training); evaluation and prediction may lack it.
        require_input_ids: a row without ``input_ids`` is refused (causal language modelling).
    """

    vocab_size: int | None = None
    type_vocab_size: int | None = None
    label_column: str = "labels"
    label_kind: str | None = None
    label_bound: int | None = None
    require_labels: bool = False
    require_input_ids: bool = False


@dataclass(frozen=True)
class DataSummary:
    """What the pass learnt: the number of rows, ``probe_row``, the row to run the model on once (the longest
    ``input_ids``; row 0 without that column; None for no rows, or when every ``input_ids`` is empty), and what
    :func:`packed_block` reads: ``unpadded_length``, the length every ``input_ids`` has when it is the same for all
    rows (two at least) and no ``attention_mask`` holds a 0 (else None), and ``labels_are_ids``, whether every
    row's sequence labels equal its ``input_ids`` (None: no sequence labels)."""

    rows: int
    probe_row: int | None
    unpadded_length: int | None = None
    labels_are_ids: bool | None = None


def dataset_schema(
    model: nn.Module, *, task: str | None, label_names: tuple[str, ...], own_loss: bool, require_labels: bool
) -> Schema:
    """The :class:`Schema` of a trainer's rows: ``task`` (``infer_task``'s, None with a ``compute_loss_func``),
    ``own_loss`` (the trainer's default loss, not a subclass's), ``require_labels`` (training; not evaluation)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    schema = Schema(
        vocab_size=_rows_of(base, "get_input_embeddings") or _config_int(config, "vocab_size"),
        type_vocab_size=_config_int(config, "type_vocab_size"),
        label_column=label_names[0],
        require_input_ids=own_loss and task == "causal_lm",
    )
    if not own_loss:
        return schema
    if task is None:
        return dataclasses.replace(schema, label_kind="any", require_labels=require_labels)
    if task in ("causal_lm", "masked_lm"):  # a masked LM's labels are drawn by its collator: not required here
        vocab = _rows_of(base, "get_output_embeddings") or _config_int(config, "vocab_size")
        return dataclasses.replace(schema, label_kind="tokens", label_bound=vocab)
    num_labels = _config_int(config, "num_labels")
    if task == "token_classification":
        return dataclasses.replace(schema, label_kind="tokens", label_bound=num_labels, require_labels=require_labels)
    if getattr(config, "problem_type", None) == "regression" and num_labels not in (None, 1):
        raise ConfigurationError(
            f"{type(base).__name__} has problem_type='regression' with num_labels={num_labels}; the per-example loss "
            "fits one regression output (squared error, num_labels=1) or class ids (cross-entropy). Set num_labels=1, "
            "or pass compute_loss_func=(logits, labels) -> scalar for one example."
        )
    kind = "value" if num_labels == 1 else "class"
    return dataclasses.replace(schema, label_kind=kind, label_bound=num_labels, require_labels=require_labels)


def _rows_of(model: nn.Module, getter: str) -> int | None:
    """The rows of the model's input (or output) embedding weight: the ids it can look up (or predict)."""
    get = getattr(model, getter, None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _config_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_dataset(dataset: Any, schema: Schema, *, keep: set[str] | None = None, name: str = "dataset") -> DataSummary:
    """Check every row of the map-style ``dataset`` against ``schema`` (module docstring); the columns outside
    ``keep`` (the trainer's ``remove_unused_columns`` drops them) are not read.

    Raises:
        InputTypeError: the dataset has no length or item access, a row is not a mapping, or a value has the wrong
            type or shape (a float token id, a nested sequence, a string label).
        ConfigurationError: a required column is missing, or a value is out of its range.
    """
    require_random_access(dataset, name)
    if isinstance(dataset, Mapping) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise InputTypeError(
            f"{name} must be a map-style dataset (len(dataset) and dataset[i] for i in range(len)), got "
            f"{type(dataset).__name__}; wrap an iterable dataset in a list or datasets.Dataset, and pass one dataset "
            "at a time."
        )
    size = len(dataset)
    checker = _Checker(schema, keep, name)
    if _arrow_readable(dataset):
        columns = None if dataset.format["output_all_columns"] else dataset.format["columns"]
        for start in range(0, size, ARROW_ROWS):
            table = _arrow_table(dataset, start, min(size, start + ARROW_ROWS))
            checker.chunk(start, _arrow_columns(table if columns is None else table.select(columns), start, checker))
    else:
        for start in range(0, size, CHUNK_ROWS):
            checker.chunk(start, _row_columns(dataset, start, min(size, start + CHUNK_ROWS), checker))
    if checker.columns is not None and "input_ids" not in checker.columns:
        return DataSummary(size, 0)
    return DataSummary(size, checker.longest_row, checker.unpadded_length(size), checker.labels_are_ids)


def packed_block(summary: DataSummary, task: str | None) -> int | None:
    """The block length when the rows look like packed blocks of documents (``run_clm.py``'s ``group_texts``
    concatenates the tokenized documents and cuts them into rows of ``block_size``): at least two rows, every
    ``input_ids`` of the same length, no padding in any ``attention_mask``, and labels equal to ``input_ids`` (or no
    label column, for a causal LM, whose labels are its ``input_ids``, and for a masked LM, whose collator draws them
    from its ``input_ids``: ``run_mlm.py`` groups texts the same way). None otherwise. Rows of one document each,
    all truncated to the same length, look the same: the caller warns, it does not refuse."""
    if summary.unpadded_length is None or summary.labels_are_ids is False:
        return None
    return summary.unpadded_length if summary.labels_are_ids or task in ("causal_lm", "masked_lm") else None


def require_random_access(dataset: Any, name: str) -> None:
    """InputTypeError for an iterable dataset (``torch.utils.data.IterableDataset``, which ``datasets``' streaming
    ``IterableDataset`` is, or any iterable without ``len`` and ``[i]``), with the reason and what to pass instead."""
    iterable = isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not isinstance(dataset, Mapping) and not hasattr(dataset, "__getitem__")
    )
    if not iterable:
        return
    raise InputTypeError(
        f"{name} is an iterable dataset ({type(dataset).__name__}), which has no size and no random access; "
        "DPTrainer needs both: Poisson sampling lets every row join each batch independently, which reads rows by "
        "index, and the dataset size sets the sampling rate q that epsilon is computed for (evaluation reads rows by "
        "index too). Pass a map-style dataset: load it without streaming=True, or materialize a finite one, e.g. "
        "datasets.Dataset.from_generator(lambda: (yield from ds), features=ds.features), or list(ds)."
    )


@dataclass
class _Column:
    """One column over a chunk of rows: the values (sequences concatenated) as int64 or float64, each row's length
    (None for one value per row), and ``show(row)``, the row's value as the dataset gave it (for the messages)."""

    values: np.ndarray
    lengths: np.ndarray | None
    show: Callable[[int], Any]

    def row_of(self, index: int) -> int:
        """The row (in the chunk) that holds flat value ``index``."""
        return index if self.lengths is None else int(np.searchsorted(np.cumsum(self.lengths), index, side="right"))


class _Checker:
    """The rules of :func:`check_dataset`, applied chunk by chunk; remembers the row with the longest ``input_ids``
    and the columns of the first row (every row must have the same)."""

    def __init__(self, schema: Schema, keep: set[str] | None, name: str) -> None:
        self.schema, self.keep, self.name = schema, keep, name
        self.columns: set[str] | None = None
        self.longest_row: int | None = None
        self.longest_length = 0
        self.lengths: tuple[int, int] | None = None  # the shortest and longest input_ids
        self.padded = False  # an attention mask holds a 0
        self.labels_are_ids: bool | None = None  # None: no sequence labels seen

    def role(self, column: str) -> str | None:
        """What ``column`` holds: ``"ids"``, ``"mask"``, ``"types"``, ``"labels"``, or None (not read here)."""
        if self.keep is not None and column not in self.keep:
            return None
        if column == "input_ids" or column.endswith("_input_ids"):
            return "ids"
        if column == "attention_mask" or column.endswith("_attention_mask"):
            return "mask"
        if column == "token_type_ids":
            return "types"
        if self.schema.label_kind is not None and column == self.label_column({column}):
            return "labels"
        return None

    def label_column(self, columns: set[str]) -> str | None:
        """The label column among ``columns``: ``label_column``, or ``label`` standing for ``labels``."""
        name = self.schema.label_column
        if name in columns:
            return name
        return "label" if name == "labels" and "label" in columns else None

    def check_columns(self, row: int, columns: set[str]) -> None:
        """ConfigurationError for a required column that is missing, or columns unlike those of the first row."""
        missing = []
        if self.schema.require_input_ids and "input_ids" not in columns:
            missing.append("'input_ids' (causal language modelling reads its labels from it)")
        if self.schema.require_labels and self.label_column(columns) is None:
            alias = " (or 'label')" if self.schema.label_column == "labels" else ""
            missing.append(f"{self.schema.label_column!r}{alias} (the loss reads each row's label from it)")
        if missing:
            raise ConfigurationError(
                f"{self.name} row {row} has no column {' and no column '.join(missing)}; its columns are "
                f"{sorted(columns)[:10]}. Add the column, or set label_names to the column that holds the labels."
            )
        read = {c for c in columns if self.role(c) is not None}
        if self.columns is None:
            self.columns = read
        elif read != self.columns:
            odd = sorted(read ^ self.columns)
            raise ConfigurationError(
                f"{self.name} row {row} has the columns {sorted(read)}, row 0 has {sorted(self.columns)} (differing: "
                f"{odd}); batches are collated from rows with the same columns. Give every row the same columns."
            )

    def fail(self, row: int, column: str, problem: str, value: Any, fix: str, error: type = ConfigurationError):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise error(f"{self.name} row {row}, column {column!r}: {problem}, got {shown}. {fix}")

    # -- values, checked together over a chunk ---------------------------------------------------------------------

    def chunk(self, start: int, columns: dict[str, _Column]) -> None:
        """Check one chunk (rows ``start, start + 1, ...``) whose types :meth:`check_type` passed."""
        ids = columns.get("input_ids")
        if ids is not None and ids.lengths is not None and len(ids.lengths):
            row = int(np.argmax(ids.lengths))
            if ids.lengths[row] > self.longest_length:
                self.longest_row, self.longest_length = start + row, int(ids.lengths[row])
            low, high = int(ids.lengths.min()), int(ids.lengths.max())
            seen = self.lengths or (low, high)
            self.lengths = (min(low, seen[0]), max(high, seen[1]))
        self.note_packing(columns, ids)
        vocab_fix = (
            "Tokenize with the model's own tokenizer, or resize the embeddings (model.resize_token_embeddings) to "
            "cover every id."
        )
        for name, col in columns.items():
            role = self.role(name)
            if role == "ids":
                self.in_range(start, name, col, self.schema.vocab_size, "token id", vocab_fix)
            elif role == "mask":
                self.same_length(start, name, col, columns.get(name.replace("attention_mask", "input_ids")))
                self.in_range(start, name, col, 2, "attention mask value", "Use 1 for a token, 0 for padding.")
            elif role == "types":
                self.same_length(start, name, col, ids)
                fix = "Use the token type ids of the model's tokenizer (or drop the column)."
                self.in_range(start, name, col, self.schema.type_vocab_size, "token type id", fix)
            elif role == "labels":
                self.labels(start, name, col, ids)

    def note_packing(self, columns: dict[str, _Column], ids: _Column | None) -> None:
        """Record what :func:`packed_block` reads: padding in ``attention_mask``, and whether the labels equal
        ``input_ids``."""
        mask = columns.get("attention_mask")
        if mask is not None and self.role("attention_mask") == "mask":
            self.padded = self.padded or bool((mask.values == 0).any())
        labels = next((col for name, col in columns.items() if self.role(name) == "labels"), None)
        if labels is None:
            return
        same = (
            ids is not None
            and labels.lengths is not None
            and ids.lengths is not None
            and np.array_equal(labels.lengths, ids.lengths)
            and np.array_equal(labels.values, ids.values)
        )
        self.labels_are_ids = same and self.labels_are_ids is not False

    def unpadded_length(self, rows: int) -> int | None:
        """:class:`DataSummary`'s ``unpadded_length`` of ``rows`` rows."""
        if rows < 2 or self.padded or self.lengths is None or self.lengths[0] != self.lengths[1]:
            return None
        return self.lengths[0] if self.lengths[0] > 1 else None

    def in_range(
        self, start: int, name: str, col: _Column, high: int | None, what: str, fix: str, ignore: int | None = None
    ) -> None:
        """The integer values lie in ``[0, high)`` (``high`` None: ``>= 0``), or equal ``ignore``."""
        values = col.values
        bad = (values < 0) if high is None else (values < 0) | (values >= high)
        if ignore is not None:
            bad &= values != ignore
        if bad.any():
            index = int(np.argmax(bad))
            allowed = (f"in [0, {high})" if high is not None else ">= 0") + (f" or {ignore}" if ignore else "")
            row = col.row_of(index)
            self.fail(start + row, name, f"{what} {int(values[index])} is not {allowed}", col.show(row), fix)

    def same_length(self, start: int, name: str, col: _Column, ids: _Column | None) -> None:
        if ids is None or col.lengths is None or ids.lengths is None:
            return
        differ = col.lengths != ids.lengths
        if differ.any():
            row = int(np.argmax(differ))
            problem = f"{col.lengths[row]} values for {ids.lengths[row]} input ids"
            self.fail(start + row, name, problem, col.show(row), "Give one value per token of input_ids.")

    def labels(self, start: int, name: str, col: _Column, ids: _Column | None) -> None:
        kind, bound = self.schema.label_kind, self.schema.label_bound
        if kind == "class" and col.lengths is None:
            fix = f"Use class ids 0..{bound - 1}: map the labels to the model's config.num_labels={bound} classes."
            self.in_range(start, name, col, bound, "class id", fix if bound else "Use class ids >= 0.")
        elif kind == "class" or kind == "value":  # class probabilities, or regression targets: finite floats
            if kind == "class" and bound is not None and (col.lengths != bound).any():
                row = int(np.argmax(col.lengths != bound))
                fix = f"Give a class id, or exactly {bound} class probabilities per row."
                self.fail(start + row, name, f"{col.lengths[row]} class probabilities", col.show(row), fix)
            bad = ~np.isfinite(col.values)
            if bad.any():
                row = col.row_of(int(np.argmax(bad)))
                self.fail(start + row, name, "a non-finite label", col.show(row), "Give finite labels.")
        elif kind == "tokens":
            self.same_length(start, name, col, ids)
            fix = f"Use label ids below {bound} at the positions with a target and {IGNORE_INDEX} at the others."
            self.in_range(start, name, col, bound, "label", fix, ignore=IGNORE_INDEX)

    # -- types, read once per row (or once per Arrow column) -------------------------------------------------------

    def check_type(self, row: int, name: str, kind: str, ndim: int, size: int, value: Any) -> None:
        """InputTypeError when a value (``value``, read as NumPy dtype kind ``kind``, ``ndim`` dimensions and ``size``
        entries) has the wrong type or shape for its column."""
        role, label_kind, bound = self.role(name), self.schema.label_kind, self.schema.label_bound
        sequence = ndim == 1 and (kind in _INTS or size == 0)  # [] has no dtype of its own
        if role == "ids":
            ok, what = sequence, "a sequence of integer token ids"
        elif role == "mask":
            ok, what = sequence or (ndim == 1 and kind == "b"), "a sequence of 0/1 integers or bools"
        elif role == "types":
            ok, what = sequence, "a sequence of integer token type ids"
        elif label_kind == "class":
            ok = (ndim == 0 and kind in _INTS) or (ndim == 1 and kind in _FLOATS)
            what = f"a class id (an integer below {bound})" if bound else "a class id (an integer)"
        elif label_kind == "value":
            if ndim == 0 and kind in _INTS:
                self.fail(
                    row,
                    name,
                    "an integer label for a model with num_labels=1 (regression: squared error on a float target)",
                    value,
                    "Give float targets for regression, or set num_labels to the number of classes.",
                    InputTypeError,
                )
            ok, what = ndim == 0 and kind in _FLOATS, "one float target (num_labels=1: regression)"
        elif label_kind == "tokens":
            ok, what = sequence, "a sequence of integer labels (-100 where no loss is taken)"
        else:  # a custom loss's labels: numbers
            ok, what = kind in _INTS + _FLOATS + "b" or size == 0, "numbers"
        if not ok:
            self.fail(row, name, f"expected {what}", value, _type_fix(role, kind, ndim), InputTypeError)


def _type_fix(role: str | None, kind: str, ndim: int) -> str:
    if ndim > 1:
        return "Give one flat sequence per row (the trainer batches and pads the rows itself)."
    if kind in "USO":
        return "Tokenize the text, and map string labels to class ids (datasets.ClassLabel) before training."
    if role in ("ids", "types", "mask") or ndim == 1:
        return "Convert the column to integers (for example dataset.cast_column, or tensors of dtype torch.long)."
    return "Convert the column to the type the loss takes."


_TORCH_KINDS = {torch.bool: "b", torch.uint8: "u"}


def _read(value: Any) -> tuple[str, int, int, Any]:
    """``(dtype kind, ndim, size, values)`` of a row's value, ``values`` a tensor or NumPy array; what NumPy cannot
    read as a flat or rectangular array of numbers reads as a 2-D object array, which every rule refuses."""
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
        kind = "f" if dtype.is_floating_point else "c" if dtype.is_complex else _TORCH_KINDS.get(dtype, "i")
        return kind, value.dim(), value.numel(), value
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except (ValueError, TypeError, OverflowError):  # ragged nesting
            value = np.empty((1, 0), dtype=object)
    return value.dtype.kind, value.ndim, value.size, value


def _flat_numbers(values: list[Any], ndim: int) -> np.ndarray:
    """The values of one column over a chunk (each of ``ndim`` dimensions), flattened into one int64 (integers,
    bools) or float64 array."""
    if all(isinstance(v, torch.Tensor) for v in values):
        with torch.no_grad():  # one operation for the chunk: a reshape per row costs more than the rest of the check
            flat = (
                torch.stack(values)
                if ndim == 0
                else torch.cat(values if ndim == 1 else [v.reshape(-1) for v in values])
            )
        flat = flat.cpu()
        return flat.to(torch.float64 if flat.is_floating_point() or flat.is_complex() else torch.int64).numpy()
    arrays = [v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v for v in values]
    return _numbers(np.concatenate([a.reshape(-1) for a in arrays]))


def _row_columns(dataset: Any, start: int, stop: int, checker: _Checker) -> dict[str, _Column]:
    """Rows ``start:stop`` read by ``dataset[i]``, each value's type checked, gathered column by column."""
    read: dict[str, list[Any]] = {}
    raw: dict[str, list[Any]] = {}
    sizes: dict[str, list[int]] = {}
    dims: dict[str, int] = {}
    keys = None
    for i in range(start, stop):
        row = dataset[i]
        if not isinstance(row, Mapping):
            raise InputTypeError(
                f"{checker.name} row {i} is a {type(row).__name__}; rows must be mappings of column -> value "
                "(dicts, as a datasets.Dataset gives)."
            )
        if keys is None or row.keys() != keys:  # the columns, read again only where they change
            checker.check_columns(i, set(row))
            keys = set(row)
        for name in checker.columns:
            value = row[name]
            if value is None:
                checker.fail(i, name, "a missing value", value, "Fill or drop the row.", InputTypeError)
            kind, ndim, size, values = _read(value)
            checker.check_type(i, name, kind, ndim, size, value)
            if dims.setdefault(name, ndim) != ndim:
                checker.fail(
                    i, name, f"a value of {ndim} dimensions after ones of {dims[name]}", value,
                    "Give every row the same kind of value (a class id, or a vector, not both).", InputTypeError,
                )  # fmt: skip
            read.setdefault(name, []).append(values)
            raw.setdefault(name, []).append(value)
            sizes.setdefault(name, []).append(size)
    out = {}
    for name, values in read.items():
        show = lambda row, shown=raw[name]: shown[row]  # noqa: E731
        lengths = None if dims[name] == 0 else np.array(sizes[name], dtype=np.int64)
        out[name] = _Column(_flat_numbers(values, dims[name]), lengths, show)
    return out


def _numbers(values: np.ndarray) -> np.ndarray:
    """Integers (and bools) as int64, anything else as float64 (empty sequences read as floats)."""
    return values.astype(np.int64 if values.dtype.kind in "iub" else np.float64, copy=False)


def _arrow_readable(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset`` whose rows are its Arrow columns: not one with a transform
    (``with_transform``), whose rows are made when read."""
    arrow = sys.modules.get("datasets")
    return arrow is not None and isinstance(dataset, arrow.Dataset) and dataset.format.get("type") != "custom"


def _arrow_table(dataset: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a ``datasets.Dataset`` as one Arrow table. Through an indices mapping (after
    ``shuffle`` or ``select``) the rows are gathered with one Arrow ``take``: the public row access gathers them one
    by one (about 20 s per million rows)."""
    indices = getattr(dataset, "_indices", None)
    table = getattr(getattr(dataset, "data", None), "table", None)
    if indices is None or table is None:
        return dataset.with_format("arrow")[start:stop]
    return table.take(indices.column(0).slice(start, stop - start))


def _arrow_columns(table: Any, start: int, checker: _Checker) -> dict[str, _Column]:
    """One Arrow table of rows ``start, ...`` as :class:`_Column` values; a column's type, shared by its rows, is
    checked once (on its first non-empty row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    checker.check_columns(start, set(table.column_names))
    out = {}
    for name in sorted(checker.columns):
        array = table.column(name).combine_chunks()
        show = lambda row, array=array: array[row].as_py()  # noqa: E731
        if array.null_count:
            row = int(np.argmax(array.is_null().to_numpy(zero_copy_only=False)))
            checker.fail(start + row, name, "a missing value", None, "Fill or drop the row.", InputTypeError)
        nested = pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
        if nested or pa.types.is_fixed_size_list(array.type):
            lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
            flat = pc.list_flatten(array)
            if flat.null_count:
                index = int(np.argmax(flat.is_null().to_numpy(zero_copy_only=False)))
                row = _Column(np.zeros(0), lengths, show).row_of(index)
                checker.fail(start + row, name, "a missing value in the sequence", show(row), "Fill or drop the row.")
            values, first = flat.to_numpy(zero_copy_only=False), int(np.argmax(lengths > 0))
            kind, ndim, size = (_read(values[:1])[0], 1, int(lengths[first])) if len(values) else ("i", 1, 0)
        else:
            lengths, values, first = None, array.to_numpy(zero_copy_only=False), 0
            kind, ndim, size = _read(values[:1])[0], 0, 1
        if kind == "O":  # strings, nested lists: NumPy reads the first one for the message
            kind, ndim, size, _ = _read(show(first))
            ndim = max(ndim, 1) if lengths is not None else ndim
        if len(array):
            checker.check_type(start + first, name, kind, ndim, size, show(first))
        out[name] = _Column(_numbers(values), lengths, show)
    return out
