"""privacy_unit="user" in DPTrainer: a user's rows are one unit, in the clipped sum, the sampler, the accountant, the
public record and the card.

The reference is a float64 loop over users: each user's gradient is the mean (or sum) of its rows' gradients, each
formed alone by autograd on a float64 copy of the model, clipped to C. Both engines are compared with it, and the
neighbour property is checked on the step's own clipped sum: removing all of one user's rows moves it by at most C.
"""

from __future__ import annotations

import json
import logging

import dp_accounting
import numpy as np
import pytest
import torch
from tiny_hf import tiny_model, token_data

from opake_core import clipped_grad
from opake_core.clipping import Engine
from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.functional import functional_model
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.loss import per_example_loss
from opake_torch.transformers.users import LIVE

C = 0.5
USERS = 7
ROWS = [{**row, "user": f"user-{(3 * i) % USERS}"} for i, row in enumerate(token_data(30, seed=4))]


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 3,
        "max_steps": 3,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 5,
        "clipping_norm": C,
        "privacy_unit": "user",
        "privacy_user_column": "user",
        "privacy_max_rows_per_user": 3,
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def _trainer(tmp_path, rows=ROWS, **kw):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, **kw), train_dataset=rows)
    trainer._check_data(rows, "train_dataset", training=True)  # reads the users, as train() does
    return trainer


def _user_gradients(trainer, batch, reduction):
    """g_u for every user: the mean (or sum) of its row gradients, each formed alone in float64."""
    model = tiny_model("llama").double()
    model.load_state_dict(trainer.model.state_dict())
    apply, params, frozen = functional_model(model)
    live, users = batch[LIVE], []
    for u in range(live.shape[0]):
        n = int(live[u].sum())
        grads = {k: torch.zeros_like(v) for k, v in params.items()}
        for j in np.flatnonzero(live[u].numpy()):
            row = {k: v[u, j] for k, v in batch.items() if k != LIVE}
            p = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
            per_example_loss(apply, p, frozen, row, task="causal_lm").backward()
            for k in grads:
                grads[k] += p[k].grad / (n if reduction == "mean" else 1)
        users.append(grads)
    return users


def _norm(tree):
    return torch.sqrt(sum(v.double().square().sum() for v in tree.values())).item()


def _engine(trainer, mode):
    if mode == "layerwise":
        assert trainer._layerwise is not None and trainer._layerwise.grouped
        return Engine(gradients=trainer._layerwise)
    return None


def _clipped_sum(trainer, mode, batch, clip=C):
    engine = _engine(trainer, mode)
    options = {} if engine is None else {"engine": engine}
    grad_fn, state = clipped_grad(trainer._loss_fn(), clipping_norm=clip, **options)
    trainer.model.eval()  # no dropout: the reference has none
    return grad_fn(trainer.trainable_params, batch, state=state)[0].value


def _slots():
    """Every user, all its rows (at most 3: users have 4 or 5 rows here, so the cap binds)."""
    row_users = np.array([int(r["user"].split("-")[1]) for r in ROWS])
    order = [np.flatnonzero(row_users == u)[:3] for u in range(USERS)]
    slots = np.full((USERS, 3), -1)
    for u, rows in enumerate(order):
        slots[u, : len(rows)] = rows
    slots[2, 1:] = -1  # one user with a single row: its empty slots count for nothing
    return slots


@pytest.mark.parametrize("mode", ["vmap", "layerwise"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_clipped_sum_is_the_float64_sum_of_clipped_user_gradients(tmp_path, mode, reduction):
    trainer = _trainer(tmp_path, per_example_gradients=mode, privacy_user_reduction=reduction)
    batch = trainer.fetch_batch(ROWS, _slots())
    users = _user_gradients(trainer, batch, reduction)
    norms = [_norm(g) for g in users]
    clip = float(np.median(norms))  # the bound binds for half of the users: the reduction and the clip both show
    ours = _clipped_sum(trainer, mode, batch, clip)
    for k in users[0]:
        expected = sum(g[k] * min(1.0, clip / n) for g, n in zip(users, norms, strict=True))
        torch.testing.assert_close(ours[k].double(), expected, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("mode", ["vmap", "layerwise"])
def test_removing_all_rows_of_one_user_moves_the_clipped_sum_by_at_most_c(tmp_path, mode):
    rows = [dict(r) for r in ROWS]
    for r in rows:  # user 4's rows are long and repeated: its gradient is far above the bound
        if r["user"] == "user-4":
            r["input_ids"] = torch.full((9,), 5)
            r["attention_mask"] = torch.ones(9, dtype=torch.long)
    trainer = _trainer(tmp_path, rows=rows, per_example_gradients=mode, privacy_user_reduction="sum")
    slots = _slots()
    full = _clipped_sum(trainer, mode, trainer.fetch_batch(rows, slots))
    moves = []
    for u in range(USERS):
        without = _clipped_sum(trainer, mode, trainer.fetch_batch(rows, np.delete(slots, u, axis=0)))
        moves.append(_norm({k: full[k] - without[k] for k in full}))
    assert max(moves) <= C * (1 + 1e-5)
    assert max(moves) >= 0.99 * C  # a user at the bound moves it by C: the check can fail


def test_epsilon_is_dp_accountings_for_poisson_over_users(tmp_path):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, max_steps=4), train_dataset=ROWS)
    trainer.train()
    record = json.loads((trainer.save_model() / "accountant.json").read_text())
    rate = 3 / USERS
    event = dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(1.0))
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event, 4)
    assert record["privacy_unit"] == "user" and record["users"] == USERS and record["sample_rate"] == rate
    assert record["delta"] == pytest.approx(1 / USERS**1.1)  # the default delta is over users
    assert record["epsilon"] == pytest.approx(direct.get_epsilon(record["delta"]), rel=1e-6)
    card = (trainer.save_model() / "README.md").read_text()
    assert "The privacy unit is **one user**: all the rows sharing one value of `user`" in card
    assert f"| users | {USERS} " in card and "every user joins each batch" in card


def test_each_step_draws_users_and_at_most_k_of_their_rows(tmp_path):
    trainer = _trainer(tmp_path, max_steps=20)
    trainer.train()
    sampler = trainer.privacy_plan.sampler
    assert sampler.num_users == USERS and sampler.expected_batch_size == 3
    key, state = trainer._keys.sampler, sampler.init()
    for _ in range(20):
        slots, state = sampler.sample(key, state)
        for row in slots:
            real = row[row >= 0]
            assert 1 <= len(real) <= 3 and len({ROWS[i]["user"] for i in real}) == 1


def test_a_resume_with_other_users_is_changed_data(tmp_path, caplog):
    args = {"save_strategy": "steps", "save_steps": 2, "max_steps": 2}
    DPTrainer(tiny_model("llama"), _args(tmp_path, **args), train_dataset=ROWS).train()
    moved = [{**r, "user": "user-0"} if i == 1 else r for i, r in enumerate(ROWS)]  # one row changes user
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, **{**args, "max_steps": 3}), train_dataset=moved)
    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        trainer.train(resume_from_checkpoint=True)
    assert "the training data differ from those" in caplog.text


def test_bad_user_columns_are_refused_before_any_step(tmp_path):
    with pytest.raises(ConfigurationError, match="has no column 'user'"):
        DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=token_data(8)).train()
    floats = [{**r, "user": 0.5} for r in token_data(8)]
    with pytest.raises(InputTypeError, match="int or a str in every row"):
        DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=floats).train()
    with pytest.raises(ConfigurationError, match="needs privacy_max_rows_per_user"):
        _args(tmp_path, privacy_max_rows_per_user=None)
    for bad in (0, -1, 2**31, 2.5, True):  # a count in [1, 2**31 - 1] (the fuzz table checks record level only)
        with pytest.raises((ConfigurationError, InputTypeError), match="privacy_max_rows_per_user"):
            _args(tmp_path, privacy_max_rows_per_user=bad)
    with pytest.raises(ConfigurationError, match="apply to privacy_unit='user'"):
        _args(tmp_path, privacy_unit="record")


def test_the_train_dataloader_yields_the_sampled_users_rows(tmp_path):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=ROWS)
    batches = list(trainer.get_train_dataloader())
    assert batches and all(b["input_ids"].dim() == 2 for b in batches)


def test_dp_ftrl_over_users_is_accounted_over_users(tmp_path):
    from opake_core import accounting, mf, sampling

    args = _args(tmp_path, max_steps=4, privacy_noise_mechanism="mf_band",
                 privacy_noise_mechanism_kwargs={"bands": 2}, sampling_mode="cyclic_poisson")  # fmt: skip
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=ROWS)
    trainer.train()
    record = json.loads((trainer.save_model() / "accountant.json").read_text())
    users = sampling.cyclic_poisson(dataset_size=USERS, sample_rate=3 / USERS, bands=2)
    process = accounting.mf_process(mf.band_mf(bands=2), sampler=users, noise_multiplier=1.0, n_steps=4)
    assert record["privacy_unit"] == "user" and record["horizon"]
    assert record["epsilon"] == pytest.approx(accounting.epsilon(process, delta=record["delta"]).value, rel=1e-6)


def test_documents_packed_into_blocks_are_the_unit(tmp_path):
    datasets = pytest.importorskip("datasets")
    from opake_torch.transformers import pack_documents

    gen = torch.Generator().manual_seed(1)
    documents = [torch.randint(1, 40, (int(n),), generator=gen).tolist() for n in (3, 11, 6, 17, 9, 4, 13)]
    rows = datasets.Dataset.from_dict({"input_ids": documents, "doc": [f"doc-{i}" for i in range(len(documents))]})
    blocks = rows.map(pack_documents(block_size=5, document_column="doc"), batched=True, batch_size=3)
    for block in blocks:  # every block is a slice of its own document, padding masked out of the loss
        tokens = [t for t, m in zip(block["input_ids"], block["attention_mask"], strict=True) if m]
        source = documents[int(block["doc"].split("-")[1])]
        assert any(source[i : i + len(tokens)] == tokens for i in range(0, len(source), 5))
        assert block["labels"] == [t if m else -100 for t, m in zip(block["input_ids"], block["attention_mask"],
                                                                     strict=True)]  # fmt: skip
    assert len(blocks) == sum(-(-len(d) // 5) for d in documents)
    args = _args(tmp_path, privacy_user_column="doc", privacy_max_rows_per_user=4, per_device_train_batch_size=2)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=blocks)
    trainer.train()
    record = json.loads((trainer.save_model() / "accountant.json").read_text())
    assert record["users"] == len(documents) and record["user_column"] == "doc"
