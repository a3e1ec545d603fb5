"""``DPTrainer`` with ``sampling_mode="fixed_size"``: batches of exactly the batch size, the epsilon of
dp-accounting's RDP accountant under replace-one adjacency (queried directly), the guarantee as the model card and
accountant.json state it, and the refusals."""

from __future__ import annotations

import json

import dp_accounting
import pytest
from dp_accounting import rdp
from tiny_hf import StopAt, tiny_model, token_data

from opake_core.errors import ConfigurationError
from opake_torch.transformers import DPTrainer, TrainingArguments

DATA = token_data(40, classes=3)


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 8,
        "max_steps": 3,
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "sampling_mode": "fixed_size",
        "privacy_noise_multiplier": 1.0,
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def _replace_one_epsilon(n: int, b: int, z: float, steps: int, delta: float) -> float:
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(n, b, dp_accounting.GaussianDpEvent(z / 2))
    accountant.compose(event, steps)
    return accountant.get_epsilon(delta)


def test_every_step_trains_on_exactly_the_batch_size(tmp_path, monkeypatch):
    rows = []
    losses = DPTrainer.compute_batch_losses

    def counting(self, params, batch):
        rows.append(int(batch["input_ids"].shape[0]))
        return losses(self, params, batch)

    monkeypatch.setattr(DPTrainer, "compute_batch_losses", counting)
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, max_steps=5), train_dataset=DATA)
    trainer.train()
    assert trainer.per_example_gradients_engine == "layerwise"
    assert rows[-5:] == [8] * 5  # one chunk of 8 rows per step (earlier calls: the engine's check)


def test_epsilon_is_rdp_under_replace_one_and_the_card_says_so(tmp_path):
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, privacy_accounting=True), train_dataset=DATA)
    trainer.train()
    delta = trainer.privacy_plan.delta
    want = _replace_one_epsilon(len(DATA), 8, 1.0, 3, delta)
    logged = [row["privacy_epsilon"] for row in trainer.state.log_history if "privacy_epsilon" in row]
    assert logged[-1] == pytest.approx(want, rel=1e-9)
    folder = trainer.save_model()
    record = json.loads((folder / "accountant.json").read_text())
    assert record["adjacency"] == "replace_one" and record["accountant"] == "rdp"
    assert record["epsilon"] == pytest.approx(want, rel=1e-9) and record["sampling_mode"] == "fixed_size"
    card = (folder / "README.md").read_text()
    assert "with respect to replacing one privacy unit" in card and "fixed-size batches" in card


def test_a_target_epsilon_is_met_under_replace_one(tmp_path):
    args = _args(tmp_path, privacy_noise_multiplier=None, privacy_target_epsilon=8.0, max_steps=4)
    trainer = DPTrainer(tiny_model("bert"), args, train_dataset=DATA)
    trainer.train()
    plan = trainer.privacy_plan
    reached = _replace_one_epsilon(len(DATA), 8, plan.noise_multiplier, 4, plan.delta)
    assert 8.0 * (1 - 1e-3) <= reached <= 8.0


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"clipping_mode": "adaptive"}, "adaptive clipping is accounted for DP-SGD with plain Poisson"),
        ({"privacy_noise_mechanism": "mf_band"}, "no matching accountant"),
    ],
)
def test_what_it_has_no_accountant_for_is_refused(tmp_path, kw, needle):
    with pytest.raises(ConfigurationError, match=needle):
        DPTrainer(tiny_model("bert"), _args(tmp_path, **kw), train_dataset=DATA).train()


def test_a_resume_continues_the_same_batches_and_accounting(tmp_path):
    def run(folder, stop=None, resume=None):
        args = _args(folder, max_steps=4, privacy_noise_seed=5, save_strategy="steps", save_steps=2)
        trainer = DPTrainer(tiny_model("bert"), args, train_dataset=DATA, callbacks=[] if stop is None else [stop])
        return trainer, trainer.train(resume_from_checkpoint=resume)

    whole, whole_out = run(tmp_path / "a")
    run(tmp_path / "b", stop=StopAt(2))
    resumed, resumed_out = run(tmp_path / "b", resume=True)
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert a.detach().equal(b.detach()), name
    assert resumed_out.metrics["privacy_epsilon"] == whole_out.metrics["privacy_epsilon"]
