"""Records are independent, whatever they hold: an empty or all-padding record adds nothing, and the neighbour test
refuses a model whose records couple before any step is taken."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_hf import VOCAB, tiny_model, token_data
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from opake_core.clipping import VMAP, Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.patches import apply_runtime_patches
from opake_torch.transformers import DPTrainer, TrainingArguments, coupling
from opake_torch.transformers import loss as loss_module
from opake_torch.transformers.data import collate

C = 0.01  # below every gradient norm here: each record's clipped gradient has norm C


def _bert() -> nn.Module:
    """A two-layer BERT classifier whose weights are large enough (initializer_range 0.5) that an all-padding
    record's output moves visibly with the padded length; positions up to 64, eager attention."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
        initializer_range=0.5, attn_implementation="eager",
    )  # fmt: skip
    return BertForSequenceClassification(config)


def _args(folder, engine: str, **kwargs) -> TrainingArguments:
    common = {"per_device_train_batch_size": 4, "max_steps": 2, "privacy_noise_multiplier": 1.0, "use_cpu": True,
              "save_strategy": "steps", "save_steps": 1, "report_to": "none", "disable_tqdm": True,
              "per_example_gradients": engine}  # fmt: skip
    return TrainingArguments(str(folder), **{**common, **kwargs})


def _record(length: int, seed: int, *, label: int | None = None, mask: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    row = {"input_ids": torch.randint(1, VOCAB, (length,), generator=g), "attention_mask": torch.full((length,), mask)}
    if label is not None:
        row["labels"] = torch.tensor(label)
    return row


def _engine(trainer: DPTrainer, name: str) -> Engine:
    if name == "vmap":
        return VMAP
    return Engine(gradients=LayerwiseGradients(trainer.model, trainer.compute_batch_losses))


def _clipped_sum(trainer: DPTrainer, engine: Engine, rows: list[dict]) -> dict[str, torch.Tensor]:
    """The engine's clipped sum (bound C, not normalized) of ``rows`` collated into one batch, as a step forms it
    (outside ``train()``: with the vmap patches that ``train()`` applies)."""
    fn, state = clipped_grad(trainer.compute_per_example_loss, clipping_norm=C, engine=engine)
    with apply_runtime_patches():
        out, _ = fn(trainer.trainable_params, collate(rows), state=state)
    return out.value


def _reference(model64: nn.Module, rows: list[dict]) -> dict[str, torch.Tensor]:
    """float64 loop over the records, each alone and unpadded: cross-entropy gradient clipped to C, summed. A record
    whose mask keeps no position contributes nothing (the documented rule)."""
    total = {name: torch.zeros_like(p) for name, p in model64.named_parameters()}
    for row in rows:
        keep = row["attention_mask"].bool()
        if not keep.any():
            continue
        logits = model64(
            input_ids=row["input_ids"][keep][None], attention_mask=row["attention_mask"][keep][None]
        ).logits
        loss = nn.functional.cross_entropy(logits, row["labels"][None])
        grads = torch.autograd.grad(loss, list(model64.parameters()))
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        for (name, _), g in zip(model64.named_parameters(), grads, strict=True):
            total[name] += g * min(1.0, C / norm.item())
    return total


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return torch.sqrt(sum((a[k].double() - b[k].double()).square().sum() for k in a)).item()


@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
@pytest.mark.parametrize("kind", ["empty", "all_padding"])
def test_a_long_record_moves_the_clipped_sum_by_its_own_contribution_only(tmp_path, engine, kind):
    """Acceptance: next to an empty or all-padding record, adding one 60-token record changes the clipped sum by that
    record's own clipped gradient (norm C), against a float64 loop over the records each alone and unpadded. Before
    the zero weight, the all-padding record (attending uniformly over the padded length) moved by up to 2 C."""
    model = _bert()
    model64 = copy.deepcopy(model).double().eval()
    odd = {"input_ids": torch.zeros(0, dtype=torch.long), "attention_mask": torch.zeros(0, dtype=torch.long)}
    if kind == "all_padding":
        odd = _record(7, seed=9, mask=0)
    rows = [{**odd, "labels": torch.tensor(1)}] + [_record(n, seed=n, label=n % 3) for n in (4, 6, 9)]
    long = _record(60, seed=60, label=2)
    trainer = DPTrainer(model, _args(tmp_path, engine), train_dataset=rows)
    run = _engine(trainer, engine)

    without, with_long = _clipped_sum(trainer, run, rows), _clipped_sum(trainer, run, [*rows, long])

    assert _distance(with_long, without) <= C * (1 + 1e-5)
    reference = _reference(model64, rows)
    assert _distance(without, reference) <= 1e-4 * C
    assert _distance(with_long, _reference(model64, [*rows, long])) <= 1e-4 * C


@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_records_without_an_attended_position_have_zero_loss_and_gradient(tmp_path, engine, family):
    """An empty record, an all-padding one and (causal LM) an all-padding one whose labels count every position:
    loss 0 and gradient norm 0 exactly, beside ordinary records whose loss and gradient are not; a batch of empty
    records runs (collated to one padding position)."""
    empty = {"input_ids": torch.zeros(0, dtype=torch.long), "attention_mask": torch.zeros(0, dtype=torch.long)}
    odd = [empty, _record(5, seed=1, mask=0)]
    if family == "llama":
        odd.append(_record(5, seed=2, mask=0))
    normal = [_record(n, seed=n) for n in (3, 8)]
    for i, row in enumerate(odd + normal):  # bert: a class; llama: the next tokens, all of them counted
        row["labels"] = torch.tensor(i % 3) if family == "bert" else row["input_ids"].clone()
    data = token_data(8, classes=3 if family == "bert" else None)
    trainer = DPTrainer(tiny_model(family), _args(tmp_path, engine), train_dataset=data)
    fn, state = clipped_grad(
        trainer.compute_per_example_loss, clipping_norm=C, engine=_engine(trainer, engine), return_diagnostics=True
    )
    for rows, zeros in (([*odd, *normal], len(odd)), ([empty] * 3, 3)):
        with apply_runtime_patches():  # outside train(): the vmap patches that train() applies
            (_, diagnostics), _ = fn(trainer.trainable_params, collate(rows), state=state)
        assert diagnostics.losses[:zeros].eq(0).all() and diagnostics.norms[:zeros].eq(0).all()
        assert diagnostics.losses[zeros:].gt(0).all() and diagnostics.norms[zeros:].gt(0).all()


class BatchCentered(nn.Module):
    """Subtracts the batch mean once the batch holds more than two rows: a branch on a whole-batch statistic that
    the two-example check cannot see (two rows, or one under vmap, pass through unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True) if x.shape[0] > 2 else x


class MeanPooler(nn.Module):
    """BERT's pooler reading the mean over every position, padding included: each record's output depends on the
    batch's padded length, under either engine."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states.mean(dim=1)))


def _nothing_spent(trainer: DPTrainer, folder) -> None:
    assert trainer.state.global_step == 0 and trainer.privacy_plan is None
    assert not list(folder.glob("checkpoint-*"))


def test_layerwise_refuses_a_batch_level_branch_before_any_step(tmp_path):
    """'layerwise' refuses the model at start (the engine's own coupling check, on the checks' first chunk), naming
    the leaf whose gradient moved most, with nothing trained or written."""
    model = tiny_model("bert")
    model.bert.embeddings.dropout = BatchCentered()
    trainer = DPTrainer(model, _args(tmp_path, "layerwise"), train_dataset=token_data(24, classes=3))
    with pytest.raises(ConfigurationError, match=r"the examples of a batch interact in the model") as info:
        trainer.train()
    assert "most in the gradient of 'bert." in str(info.value)  # a leaf under the coupled embeddings
    _nothing_spent(trainer, tmp_path)


def test_auto_falls_back_to_vmap_where_the_batched_forward_couples(tmp_path, caplog):
    """Under vmap each record runs alone, so the batch-level branch never fires: 'auto' warns and trains on vmap."""
    model = tiny_model("bert")
    model.bert.embeddings.dropout = BatchCentered()
    trainer = DPTrainer(model, _args(tmp_path, "auto"), train_dataset=token_data(24, classes=3))
    assert trainer.per_example_gradients_engine == "layerwise"
    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        trainer.train()
    assert trainer.per_example_gradients_engine == "vmap" and trainer.state.global_step == 2
    assert any("examples of a batch interact" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("engine", ["vmap", "layerwise", "auto"])
def test_the_neighbour_test_refuses_a_dependence_on_the_padded_length(tmp_path, engine):
    """A pooler averaging over padding couples under both engines: refused whatever the engine, before any step."""
    model = tiny_model("bert")
    model.bert.pooler = MeanPooler(model.config.hidden_size)
    trainer = DPTrainer(model, _args(tmp_path, engine), train_dataset=token_data(24, classes=3))
    refused = "layerwise" if engine == "layerwise" else "vmap"  # 'auto' tries layerwise, then vmap
    with pytest.raises(ConfigurationError, match=f"not independent under per_example_gradients='{refused}'") as info:
        trainer.train()
    assert "'bert.pooler.dense' (Linear)" in str(info.value)  # where the mean over padding first shows
    _nothing_spent(trainer, tmp_path)


@pytest.mark.parametrize("engine", ["vmap", "layerwise"])
def test_the_neighbour_test_sees_an_all_padding_record_without_its_zero_weight(tmp_path, monkeypatch, engine):
    """With the zero weight of records without an attended position removed, the empty record the test adds to its
    sample attends uniformly over the padded length: refused, naming BERT's self-attention."""
    monkeypatch.setattr(loss_module, "attended", lambda losses, inputs: losses)
    data = [_record(n, seed=n, label=n % 3) for n in (3, 5, 8, 12, 20, 30)]
    trainer = DPTrainer(_bert(), _args(tmp_path, engine), train_dataset=data)
    with pytest.raises(ConfigurationError, match="not independent") as info:
        trainer.train()
    assert "attention.self' (BertSelfAttention)" in str(info.value)
    _nothing_spent(trainer, tmp_path)


def test_neighbour_rows_take_the_shortest_the_longest_and_an_empty_record():
    lengths = [7, 3, 12, 5, 9, 40, 6]
    data = [{"input_ids": list(range(1, n + 1)), "labels": i} for i, n in enumerate(lengths)]
    read = lambda indices: [dict(data[i]) for i in indices]  # noqa: E731
    rows, extra = coupling.neighbour_rows(data, read, empty=True, positions=20)
    assert len(extra["input_ids"]) == 20 and extra["labels"] == 5  # the longest, cut to its first 20 positions
    assert [len(r["input_ids"]) for r in rows] == [3, 7, 10, 0]  # the shortest, the next in order (cut to 10), empty
    assert rows[-1]["input_ids"].dtype == torch.int64 and rows[-1]["labels"] == 5
    assert coupling.neighbour_rows(data[:1], read, empty=False) is None


@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
def test_the_neighbour_test_runs_in_the_steps_chunks(tmp_path, engine):
    """With ``microbatch_size=1`` a batched forward never holds two records: the batch-level branch cannot fire in
    a step, and the test, run in the same chunks, lets the model train."""
    model = tiny_model("bert")
    model.bert.embeddings.dropout = BatchCentered()
    trainer = DPTrainer(model, _args(tmp_path, engine, microbatch_size=1), train_dataset=token_data(24, classes=3))
    trainer.train()
    assert trainer.per_example_gradients_engine == engine and trainer.state.global_step == 2
