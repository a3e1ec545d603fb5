"""Packing documents into blocks that protect documents: ``group_texts`` that never crosses a document.

``run_clm.py``'s ``group_texts`` concatenates all documents and cuts blocks of ``block_size`` tokens, so a block may
hold the end of one document and the start of the next, and a document spans several blocks: with record-level
privacy the unit is one block, and a document is protected only as a group. :func:`pack_documents` cuts each
document on its own and keeps its id on every block; trained with ``privacy_unit="user"`` and
``privacy_user_column=<the id column>``, the unit of the guarantee is the document, with all its blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["pack_documents"]

IGNORE_INDEX = -100


def pack_documents(
    *, block_size: int, document_column: str, pad_token_id: int = 0
) -> Callable[[dict[str, Sequence[Any]]], dict[str, list[Any]]]:
    """A function for ``datasets.Dataset.map(..., batched=True)``: each document's token rows (the consecutive rows of
    one ``document_column`` value in a batch) concatenated and cut into blocks of ``block_size`` tokens; the last,
    shorter block of a document is padded to ``block_size`` (``input_ids`` with ``pad_token_id``, ``attention_mask``
    0, ``labels`` -100), so every block has one length and no block holds two documents. ``labels`` are the block's
    ``input_ids``; every block keeps its document's id in ``document_column``.

    Pass ``remove_columns`` for the other columns of the dataset (text), as for ``group_texts``.

    Example: two documents of 5 and 2 tokens in blocks of 4: three blocks, none shared.

        >>> from opake_torch.transformers import pack_documents
        >>> pack = pack_documents(block_size=4, document_column="doc")
        >>> blocks = pack({"input_ids": [[1, 2, 3], [4, 5], [6, 7]], "doc": ["a", "a", "b"]})
        >>> blocks["doc"], blocks["input_ids"], blocks["attention_mask"][1]
        (['a', 'a', 'b'], [[1, 2, 3, 4], [5, 0, 0, 0], [6, 7, 0, 0]], [1, 0, 0, 0])
        >>> blocks["labels"][1]
        [5, -100, -100, -100]
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigurationError(f"block_size must be a positive int, got {block_size!r}.")

    def pack(examples: dict[str, Sequence[Any]]) -> dict[str, list[Any]]:
        if "input_ids" not in examples or document_column not in examples:
            raise InputTypeError(
                f"pack_documents needs the columns 'input_ids' and {document_column!r} (tokenized rows with their "
                f"document id), got {sorted(examples)}."
            )
        ids = list(examples[document_column])
        columns = [name for name in examples if name not in (document_column, "labels")]
        out: dict[str, list[Any]] = {name: [] for name in (*columns, "labels", document_column)}
        start = 0
        while start < len(ids):
            end = start
            while end < len(ids) and ids[end] == ids[start]:
                end += 1
            joined = {name: list(chain.from_iterable(examples[name][start:end])) for name in columns}
            if "attention_mask" not in joined:
                joined["attention_mask"] = [1] * len(joined["input_ids"])
            for first in range(0, len(joined["input_ids"]), block_size):
                fill = block_size - min(block_size, len(joined["input_ids"]) - first)
                for name, tokens in joined.items():
                    pad = pad_token_id if name == "input_ids" else 0
                    out.setdefault(name, []).append(list(tokens[first : first + block_size]) + [pad] * fill)
                block, mask = out["input_ids"][-1], out["attention_mask"][-1]
                out["labels"].append([t if m else IGNORE_INDEX for t, m in zip(block, mask, strict=True)])
                out[document_column].append(ids[start])
            start = end
        return out

    return pack
