"""``collate`` against a padding loop written out element by element."""

from __future__ import annotations

import pytest
import torch

from opake_torch.transformers.data import collate

PADS = {"input_ids": 7, "attention_mask": 0, "labels": -100, "token_type_ids": 0}


def _reference(examples, *, pad_token_id, max_length, pad_to_multiple_of):
    """Each column padded position by position: sequences cut to ``max_length``, right-padded to the longest (at least
    one position, rounded up to the multiple); a generated mask where the examples have none."""
    out = {}
    for key in examples[0]:
        name = "labels" if key == "label" else key
        values = [torch.as_tensor(e[key]) for e in examples]
        if values[0].dim() == 0:
            out[name] = torch.tensor([int(v) for v in values])
            continue
        values = [v if max_length is None else v[:max_length] for v in values]
        length = max(1, max(len(v) for v in values))  # empty records: one padding position
        if pad_to_multiple_of:
            length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        pad = pad_token_id if name == "input_ids" else PADS.get(name, pad_token_id)
        padded = torch.full((len(values), length, *values[0].shape[1:]), pad, dtype=values[0].dtype)
        for i, v in enumerate(values):
            for t in range(len(v)):
                padded[i, t] = v[t]
        out[name] = padded
        if name == "input_ids" and "attention_mask" not in examples[0]:
            mask_rows = [[int(t < len(v)) for t in range(length)] for v in values]
            out["attention_mask"] = torch.tensor(mask_rows, dtype=torch.int64).reshape(len(values), length)
    return out


def _examples(lengths, *, mask: bool, width: int | None = None):
    g = torch.Generator().manual_seed(sum(lengths))
    examples = []
    for i, n in enumerate(lengths):
        example = {"input_ids": torch.randint(1, 50, (n,), generator=g), "label": i % 3}
        if mask:
            example["attention_mask"] = torch.ones(n, dtype=torch.int64)
        if width is not None:  # a per-position vector column (features of each token)
            example["features"] = torch.randn(n, width, generator=g)
        examples.append(example)
    return examples


@pytest.mark.parametrize("lengths", [(5, 5, 5), (3, 8, 1, 6), (0, 4), (0, 0)])
@pytest.mark.parametrize(("max_length", "multiple"), [(None, None), (4, None), (None, 8), (6, 4)])
@pytest.mark.parametrize("mask", [True, False])
def test_collate_equals_the_padding_loop(lengths, max_length, multiple, mask):
    examples = _examples(lengths, mask=mask, width=3)
    got = collate(examples, pad_token_id=7, max_length=max_length, pad_to_multiple_of=multiple)
    want = _reference(examples, pad_token_id=7, max_length=max_length, pad_to_multiple_of=multiple)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_collate_pads_labels_with_the_ignored_index():
    examples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}]
    got = collate(examples, pad_token_id=0)
    assert got["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert got["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
