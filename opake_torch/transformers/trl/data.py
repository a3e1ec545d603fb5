"""Dataset formatting for private SFT and DPO: one dataset row in, one tokenized example out.

Formatting runs once, at trainer construction, on each row alone: what an example becomes depends on that example
only (and on the public tokenizer and template), so the privacy unit is unchanged. No row is dropped or merged,
not even one that truncation leaves without a target token (it contributes a zero loss and a zero gradient): the
dataset size the accountant sees is the number of rows given.

SFT formats (TRL's names): language modelling (``dataset_text_field``, default ``"text"``); conversational
(``"messages"``, list of ``{"role", "content"}``) through ``tokenizer.apply_chat_template``; prompt-completion
(``"prompt"`` / ``"completion"``, strings or message lists); pre-tokenized (``"input_ids"``, optional ``"labels"`` or
``"completion_mask"``). DPO formats: ``"prompt"`` / ``"chosen"`` / ``"rejected"`` (strings or message lists), or
conversational ``"chosen"`` / ``"rejected"`` with an implicit shared prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from opake_core.errors import ConfigurationError, InputTypeError

__all__ = ["pad_collator", "preference_example", "sft_example"]

IGNORE_INDEX = -100


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and "role" in value[0]


def _ids(tokenizer: Any, value: str | list, *, chat_template: str | None, **chat_kwargs: Any) -> list[int]:
    if tokenizer is None:
        raise ConfigurationError("formatting text or conversations needs processing_class=<a tokenizer>.")
    if isinstance(value, list):
        out = tokenizer.apply_chat_template(
            value, tokenize=True, return_dict=True, chat_template=chat_template, **chat_kwargs
        )
        return list(out["input_ids"])
    return list(tokenizer(value)["input_ids"])


def _with_eos(text: str, eos: str | None) -> str:
    return text if not eos or text.endswith(eos) else text + eos


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _long(values: Sequence[int]) -> torch.Tensor:
    return torch.as_tensor(list(values), dtype=torch.long)


def sft_example(
    row: Mapping[str, Any],
    tokenizer: Any,
    *,
    text_field: str = "text",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    max_length: int | None = None,
    eos_token: str | None = None,
    chat_template: str | None = None,
    formatting_func: Callable[[Mapping[str, Any]], str] | None = None,
) -> dict[str, torch.Tensor]:
    """One SFT row as ``{"input_ids", "attention_mask", "labels"}`` (1-D long tensors, keep-start truncated).

    ``labels`` equal ``input_ids`` except where no loss is taken (-100): prompt tokens when ``completion_only_loss``
    (None: True for prompt-completion rows), non-assistant tokens when ``assistant_only_loss``.
    """
    if not isinstance(row, Mapping):
        raise InputTypeError(f"dataset rows must be mappings of column -> value, got {type(row).__name__}.")
    eos = eos_token if eos_token is not None else getattr(tokenizer, "eos_token", None)
    masks: list[Sequence[int]] = []
    if "input_ids" in row:
        ids = [int(t) for t in row["input_ids"]]
        if "labels" in row:
            labels = [int(t) for t in row["labels"]]
        else:
            if completion_only_loss is not False and "completion_mask" in row:
                masks.append(row["completion_mask"])
            labels = _apply_masks(ids, masks)
        return _finish(ids, labels, max_length)
    if formatting_func is not None:
        row = {text_field: formatting_func(row)}
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if _is_conversation(prompt):
            prompt_ids = _ids(tokenizer, prompt, chat_template=chat_template, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(
                prompt + completion,
                tokenize=True,
                return_dict=True,
                chat_template=chat_template,
                return_assistant_tokens_mask=assistant_only_loss,
            )
            ids = list(full["input_ids"])
            if assistant_only_loss:
                masks.append(_assistant_mask(full))
        else:
            prompt_ids = _ids(tokenizer, prompt, chat_template=chat_template)
            ids = _ids(tokenizer, prompt + _with_eos(completion, eos), chat_template=chat_template)
        start = _common_prefix(prompt_ids, ids)
        if completion_only_loss is not False:
            masks.append([0] * start + [1] * (len(ids) - start))
    elif "messages" in row:
        full = tokenizer.apply_chat_template(
            row["messages"],
            tokenize=True,
            return_dict=True,
            chat_template=chat_template,
            return_assistant_tokens_mask=assistant_only_loss,
        )
        ids = list(full["input_ids"])
        if assistant_only_loss:
            masks.append(_assistant_mask(full))
    elif text_field in row:
        ids = _ids(tokenizer, _with_eos(row[text_field], eos), chat_template=chat_template)
    else:
        raise InputTypeError(
            f"cannot tell the format of a row with columns {sorted(row)}: expected {text_field!r} (language "
            "modelling; see dataset_text_field), 'messages' (conversational), 'prompt' + 'completion', or "
            "'input_ids' (pre-tokenized)."
        )
    return _finish(ids, _apply_masks(ids, masks), max_length)


def _assistant_mask(processed: Mapping[str, Any]) -> list[int]:
    mask = list(processed.get("assistant_masks") or [])
    if 1 not in mask:
        raise ConfigurationError(
            "assistant_only_loss=True but the chat template marks no assistant token: the template needs "
            "'{% generation %}' ... '{% endgeneration %}' around assistant content. Fix the template or set "
            "assistant_only_loss=False."
        )
    return mask


def _apply_masks(ids: Sequence[int], masks: Sequence[Sequence[int]]) -> list[int]:
    return [t if all(int(m[i]) for m in masks) else IGNORE_INDEX for i, t in enumerate(ids)]


def _finish(ids: Sequence[int], labels: Sequence[int], max_length: int | None) -> dict[str, torch.Tensor]:
    ids, labels = list(ids)[:max_length], list(labels)[:max_length]
    return {"input_ids": _long(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long), "labels": _long(labels)}


def _implicit_prompt(row: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    chosen, rejected = row["chosen"], row["rejected"]
    if not (_is_conversation(chosen) and _is_conversation(rejected)):
        raise InputTypeError(
            f"a preference row without 'prompt' must hold conversations in 'chosen' and 'rejected' (the shared leading "
            f"messages become the prompt); got columns {sorted(row)} with string values. Add a 'prompt' column."
        )
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def preference_example(
    row: Mapping[str, Any],
    tokenizer: Any,
    *,
    max_length: int | None = None,
    chat_template: str | None = None,
) -> dict[str, torch.Tensor]:
    """One preference row as ``{chosen,rejected}_{input_ids,attention_mask,completion_mask}`` (1-D long tensors).

    As in TRL: non-conversational completions get the EOS token appended; the completion starts where the tokenized
    prompt and prompt + completion diverge (the shorter of the chosen and rejected prefixes); sequences are keep-start
    truncated to ``max_length``. ``completion_mask`` marks the tokens whose log-probabilities are summed.
    """
    if not isinstance(row, Mapping):
        raise InputTypeError(f"dataset rows must be mappings of column -> value, got {type(row).__name__}.")
    missing = {"chosen", "rejected"} - set(row)
    if missing:
        raise InputTypeError(f"a preference row needs 'chosen' and 'rejected' columns; got columns {sorted(row)}.")
    prompt, chosen, rejected = (
        (row["prompt"], row["chosen"], row["rejected"]) if "prompt" in row else _implicit_prompt(row)
    )
    if _is_conversation(prompt) or _is_conversation(chosen):
        prompt_ids = _ids(tokenizer, prompt, chat_template=chat_template, add_generation_prompt=True)
        chosen_ids = _ids(tokenizer, prompt + chosen, chat_template=chat_template)
        rejected_ids = _ids(tokenizer, prompt + rejected, chat_template=chat_template)
    else:
        eos = getattr(tokenizer, "eos_token", None)
        prompt_ids = _ids(tokenizer, prompt, chat_template=chat_template)
        chosen_ids = _ids(tokenizer, prompt + _with_eos(chosen, eos), chat_template=chat_template)
        rejected_ids = _ids(tokenizer, prompt + _with_eos(rejected, eos), chat_template=chat_template)
    start = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
    out: dict[str, torch.Tensor] = {}
    for name, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        ids = prompt_ids[:start] + ids[start:]
        completion = ([0] * start + [1] * (len(ids) - start))[:max_length]
        ids = ids[:max_length]
        out[f"{name}_input_ids"] = _long(ids)
        out[f"{name}_attention_mask"] = torch.ones(len(ids), dtype=torch.long)
        out[f"{name}_completion_mask"] = _long(completion)
    return out


def pad_collator(
    pad_token_id: int, *, pad_to_multiple_of: int | None = None
) -> Callable[[list[Mapping[str, Any]]], dict[str, torch.Tensor]]:
    """A collator that right-pads every 1-D column and stacks scalar columns.

    Padding values: ``pad_token_id`` for columns named ``*input_ids``, -100 for ``labels``, 0 otherwise (attention
    and completion masks), so that padding never carries weight in a per-example loss.
    """

    def collate(examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ConfigurationError("pad_collator needs at least one example; build empty batches by slicing [:0].")
        batch: dict[str, torch.Tensor] = {}
        for key in examples[0]:
            values = [torch.as_tensor(example[key]) for example in examples]
            if values[0].dim() == 0:
                batch[key] = torch.stack(values)
                continue
            length = max(v.shape[0] for v in values)
            if pad_to_multiple_of:
                length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
            fill = pad_token_id if key.endswith("input_ids") else IGNORE_INDEX if key == "labels" else 0
            padded = torch.full((len(values), length), fill, dtype=values[0].dtype)
            for row, value in enumerate(values):
                padded[row, : value.shape[0]] = value
            batch[key] = padded
        return batch

    return collate


def default_collator(tokenizer: Any, pad_to_multiple_of: int | None) -> Callable[[list[Mapping[str, Any]]], dict]:
    """:func:`pad_collator` with the tokenizer's pad token (0 when it has none)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad_collator(pad if pad is not None else 0, pad_to_multiple_of=pad_to_multiple_of)
