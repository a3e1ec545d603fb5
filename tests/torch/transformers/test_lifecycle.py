"""The guarantee over a run's whole lifecycle: secret keys, accounting of what ran across resumes and repeated
``train()`` calls, a budget that is never exceeded, and records that are independent of their batch."""

from __future__ import annotations

import json
import logging
import math
import pickle
import shutil
from pathlib import Path

import dp_accounting
import pytest
import torch
from dp_accounting import pld
from tiny_hf import tiny_model, token_data
from transformers import TrainerCallback

from opake_core import accounting, random
from opake_core.clipping import clipped_grad
from opake_core.errors import CheckpointError, ConfigurationError, PrivacyBudgetError
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers.keys import NOISE_STREAM

DATA = token_data(40)
DELTA = len(DATA) ** -1.1
RATE = 8 / len(DATA)


def _args(path, **kw):
    base = {
        "per_device_train_batch_size": 8,
        "max_steps": 6,
        "privacy_noise_multiplier": 1.0,
        "privacy_accounting": True,
        "use_cpu": True,
        "disable_tqdm": True,
        "optim": "sgd",
        "learning_rate": 0.05,
        "lr_scheduler": "constant",
        "logging_steps": 3,
        "save_strategy": "steps",
        "save_steps": 3,
        "report_to": "none",
    }
    return TrainingArguments(str(path), **{**base, **kw})


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def _fresh_epsilon(history):
    """A fresh dp-accounting PLD accountant fed the per-step history [(noise multiplier, rate, steps), ...]."""
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    for z, q, n in history:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
    return accountant.get_epsilon(DELTA)


# -- secret noise ----------------------------------------------------------------------------------------------------


def test_default_noise_is_secret_and_the_seed_opt_in_replays(tmp_path):
    """Same ``seed``, default arguments: different noise and batches. With ``privacy_noise_seed``: identical runs."""
    a = DPTrainer(tiny_model("llama"), _args(tmp_path / "a", max_steps=1), train_dataset=DATA)
    b = DPTrainer(tiny_model("llama"), _args(tmp_path / "b", max_steps=1), train_dataset=DATA)
    assert a.args.seed == b.args.seed
    a.train(), b.train()
    assert a._keys.noise != b._keys.noise and a._keys.sampler != b._keys.sampler
    assert any(not torch.equal(x, y) for x, y in zip(_params(a).values(), _params(b).values(), strict=True))

    seeded = [
        DPTrainer(tiny_model("llama"), _args(tmp_path / f"s{i}", max_steps=1, privacy_noise_seed=7), train_dataset=DATA)
        for i in range(2)
    ]
    for trainer in seeded:
        trainer.train()
    assert all(torch.equal(x, y) for x, y in zip(*(_params(t).values() for t in seeded), strict=True))


def test_the_public_seed_does_not_predict_the_noise(tmp_path):
    """The attack of the issue: regenerate the step-0 noise from the public ``seed`` and correlate it with the
    observed update. Under the opt-in seed it explains the update (correlation near 1); by default it is unrelated:
    with d coordinates the correlation of independent draws is about N(0, 1/d), so |corr| < 6 / sqrt(d) fails
    with probability below 2e-9."""

    def correlation(**kw):
        model = tiny_model("llama")
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        trainer = DPTrainer(model, _args(tmp_path / str(kw), max_steps=1, save_strategy="no", **kw), train_dataset=DATA)
        trainer.train()
        after = dict(trainer.model.named_parameters())
        names = sorted(before)  # the noise is cut into the leaves in the pytree (sorted key) order
        update = torch.cat([(after[k].detach() - before[k]).flatten() for k in names])
        seed = random.key(kw.get("privacy_noise_seed", 42))
        guess = random.fold_in(random.fold_in(seed, NOISE_STREAM), "opake.noise.gaussian", 0)
        draws = random.normal_tree(guess, [before[k] for k in names], dtype=torch.float32)
        noise = torch.cat([d.flatten() for d in draws])
        return torch.corrcoef(torch.stack([update, noise]))[0, 1].item(), update.numel()

    known, _ = correlation(privacy_noise_seed=42)
    assert known < -0.9  # the update is -lr * (clipped sum / B + noise): the known noise explains it
    secret, d = correlation()
    assert abs(secret) < 6 / math.sqrt(d)


def test_keys_never_reach_logs_records_or_the_saved_model(tmp_path):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path / "out", hub_token="hf_secret"), train_dataset=DATA)
    trainer.train()
    trainer.save_model(str(tmp_path / "export"))
    secrets = [trainer._keys.noise.hex, trainer._keys.sampler.hex]
    assert "hf_secret" not in repr(trainer.args) and "hf_secret" not in str(trainer.args)
    assert "privacy_noise_seed" not in repr(_args(tmp_path, privacy_noise_seed=1234567))
    assert all(s not in repr(trainer._keys) for s in secrets)
    checkpoint = tmp_path / "out" / "checkpoint-6"
    public = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ckpt.DP_STATE]
    assert public and (checkpoint / ckpt.DP_STATE).is_file()
    for path in public:
        text = path.read_bytes().decode("latin-1")
        assert all(s not in text for s in secrets), path
        assert "hf_secret" not in text, path
    manifest = json.loads((checkpoint / ckpt.DP_STATE).read_text())
    assert manifest["noise_key"] == random.key_to_json(trainer._keys.noise)  # the private state holds it, for resume


def test_a_non_private_run_records_an_infinite_epsilon(tmp_path):
    args = _args(tmp_path / "out", max_steps=2, privacy_noise_multiplier=0.0, clipping_norm=math.inf)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    assert math.isinf(trainer.train().metrics["privacy_epsilon"])
    record = json.loads((trainer.save_model(str(tmp_path / "export")) / ckpt.ACCOUNTANT).read_text())
    assert record["epsilon"] == "inf" and record["steps"] == 2


def test_resume_is_bit_exact_with_secret_keys(tmp_path):
    full = DPTrainer(tiny_model("llama"), _args(tmp_path / "a"), train_dataset=DATA)
    full.train()
    resumed = DPTrainer(tiny_model("llama"), _args(tmp_path / "a"), train_dataset=DATA)
    output = resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert resumed._keys == full._keys
    assert all(torch.equal(x, y) for x, y in zip(_params(full).values(), _params(resumed).values(), strict=True))
    assert output.metrics["privacy_epsilon"] == pytest.approx(_fresh_epsilon([(1.0, RATE, 6)]), rel=1e-6)


# -- accounting of what ran ------------------------------------------------------------------------------------------


def test_resume_with_another_multiplier_composes_the_history(tmp_path):
    first = DPTrainer(tiny_model("llama"), _args(tmp_path / "out"), train_dataset=DATA)
    first.train()
    second = DPTrainer(
        tiny_model("llama"), _args(tmp_path / "out", max_steps=12, privacy_noise_multiplier=3.0), train_dataset=DATA
    )
    output = second.train(resume_from_checkpoint=True)
    assert output.global_step == 12
    expected = _fresh_epsilon([(1.0, RATE, 6), (3.0, RATE, 6)])
    assert output.metrics["privacy_epsilon"] == pytest.approx(expected, rel=1e-6)
    assert second._keys != first._keys  # another configuration never reuses the noise of the first
    record = json.loads((tmp_path / "out" / "checkpoint-12" / ckpt.ACCOUNTANT).read_text())
    assert record["steps"] == 12 and record["epsilon"] == pytest.approx(expected, rel=1e-6)


def test_resume_with_another_batch_composes_the_history(tmp_path):
    DPTrainer(tiny_model("llama"), _args(tmp_path / "out"), train_dataset=DATA).train()
    resumed = DPTrainer(
        tiny_model("llama"), _args(tmp_path / "out", max_steps=9, per_device_train_batch_size=4), train_dataset=DATA
    )
    output = resumed.train(resume_from_checkpoint=True)
    expected = _fresh_epsilon([(1.0, RATE, 6), (1.0, 4 / len(DATA), 3)])
    assert output.metrics["privacy_epsilon"] == pytest.approx(expected, rel=1e-6)


def test_a_second_train_call_continues_the_history_with_new_noise(tmp_path):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path / "out", save_strategy="no"), train_dataset=DATA)
    trainer.train()
    keys = trainer._keys
    output = trainer.train()
    assert trainer._keys.noise != keys.noise and trainer._keys.sampler != keys.sampler
    assert output.metrics["privacy_epsilon"] == pytest.approx(_fresh_epsilon([(1.0, RATE, 12)]), rel=1e-6)


class _FailAtStep(TrainerCallback):
    """Raises at the end of step ``step``: an error (a callback, memory, an interrupt) that ends a run midway."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("interrupted")


def test_a_run_that_fails_midway_stays_charged_and_the_next_call_is_a_new_segment(tmp_path):
    """The steps a failed run took were released: they stay in the ledger (and its epsilon), and the next train()
    call draws new keys instead of replaying the noise of the failed one on another trajectory."""
    trainer = DPTrainer(
        tiny_model("llama"), _args(tmp_path / "out", save_strategy="no"), train_dataset=DATA, callbacks=[_FailAtStep(4)]
    )
    keys = trainer._keys
    with pytest.raises(RuntimeError, match="interrupted"):
        trainer.train()
    assert trainer.ledger.releases == 4 and trainer.privacy_plan is not None
    trainer.pop_callback(_FailAtStep)
    output = trainer.train()
    assert trainer._keys.noise != keys.noise and trainer._keys.sampler != keys.sampler
    assert trainer.ledger.releases == 10
    assert output.metrics["privacy_epsilon"] == pytest.approx(_fresh_epsilon([(1.0, RATE, 10)]), rel=1e-6)


def test_a_target_is_the_total_across_resumes(tmp_path):
    """Target 3 over 6 steps, then resumed to 12 steps: the budget is spent, the resume is refused. With a larger
    total the remaining steps are calibrated against what is left, and the run reports the history's epsilon."""
    target = {"privacy_noise_multiplier": None, "privacy_target_epsilon": 3.0}
    first = DPTrainer(tiny_model("llama"), _args(tmp_path / "out", **target), train_dataset=DATA)
    output = first.train()
    z1 = first.privacy_plan.noise_multiplier
    assert output.metrics["privacy_epsilon"] <= 3.0
    with pytest.raises(PrivacyBudgetError, match="budget is spent"):
        DPTrainer(tiny_model("llama"), _args(tmp_path / "out", max_steps=12, **target), train_dataset=DATA).train(
            resume_from_checkpoint=True
        )
    more = {**target, "privacy_target_epsilon": 4.0}
    resumed = DPTrainer(tiny_model("llama"), _args(tmp_path / "out", max_steps=12, **more), train_dataset=DATA)
    output = resumed.train(resume_from_checkpoint=True)
    z2 = resumed.privacy_plan.noise_multiplier
    expected = _fresh_epsilon([(z1, RATE, 6), (z2, RATE, 6)])
    assert output.metrics["privacy_epsilon"] == pytest.approx(expected, rel=1e-6)
    assert 4.0 * (1 - 2e-3) <= expected <= 4.0


def test_horizon_mechanisms_refuse_a_second_horizon(tmp_path):
    args = _args(
        tmp_path / "out",
        save_strategy="no",
        max_steps=4,
        privacy_noise_mechanism="mf_band",
        privacy_noise_mechanism_kwargs={"bands": 2},
        sampling_mode="cyclic_poisson",
    )
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    trainer.train()
    with pytest.raises(ConfigurationError, match="accounted once"):
        trainer.train()


# -- guards ----------------------------------------------------------------------------------------------------------


def test_delta_at_or_above_one_over_n_is_refused_unless_allowed(tmp_path):
    with pytest.raises(PrivacyBudgetError, match="1/N"):
        DPTrainer(tiny_model("llama"), _args(tmp_path, privacy_target_delta=0.5), train_dataset=DATA).train()
    with pytest.warns(UserWarning, match=r"1/\(10 N\)"):
        DPTrainer(
            tiny_model("llama"), _args(tmp_path / "w", max_steps=1, privacy_target_delta=1 / 80), train_dataset=DATA
        ).train()
    allowed = _args(tmp_path / "a", max_steps=1, privacy_target_delta=0.5, privacy_allow_large_delta=True)
    with pytest.warns(UserWarning):
        output = DPTrainer(tiny_model("llama"), allowed, train_dataset=DATA).train()
    assert output.metrics["privacy_delta"] == 0.5


def test_a_target_that_one_step_exceeds_is_refused_before_training(tmp_path):
    args = _args(tmp_path, privacy_noise_multiplier=0.01, privacy_target_epsilon=1.0)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    with pytest.raises(PrivacyBudgetError, match="one more step"):
        trainer.train()
    assert not list(tmp_path.glob("checkpoint-*"))


def test_non_finite_losses_are_warned_and_counted(tmp_path, caplog):
    def loss(logits, labels):  # NaN (loss and gradient) for examples whose first label token is even
        base = torch.nn.functional.cross_entropy(logits[:-1], labels[1:])
        # a factor, not torch.where(odd, base, base * nan), whose backward is NaN for every example (0 * nan)
        return base * torch.where(labels[0] % 2 == 0, math.nan, 1.0)

    args = _args(tmp_path, save_strategy="no", logging_steps=1)
    data = [{**row, "labels": row["input_ids"]} for row in DATA]
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=data, compute_loss_func=loss)
    with caplog.at_level(logging.WARNING):
        output = trainer.train()
    assert output.metrics["nonfinite_loss_steps"] > 0 and output.metrics["nonfinite_examples"] > 0
    assert "non-finite loss" in caplog.text
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_resume_does_not_repeat_log_rows(tmp_path):
    DPTrainer(tiny_model("llama"), _args(tmp_path / "out", logging_steps=1), train_dataset=DATA).train()
    DPTrainer(tiny_model("llama"), _args(tmp_path / "out", logging_steps=1), train_dataset=DATA).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3")
    )
    rows = [json.loads(line) for line in (tmp_path / "out" / "runs" / "log.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == [1, 2, 3, 4, 5, 6]


# -- records are independent -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_record_without_attention_mask_moves_the_others_by_at_most_the_bound(tmp_path, family):
    """Five short records and one of 30 tokens, no attention_mask column: the clipped sum of the six differs from
    that of the five by exactly the long record's own clipped gradient (computed alone), norm <= the bound."""
    gen = torch.Generator().manual_seed(1)
    short = [{"input_ids": torch.randint(1, 40, (n,), generator=gen)} for n in (3, 4, 5, 6, 4)]
    data = [*short, {"input_ids": torch.randint(1, 40, (30,), generator=gen)}]
    args = _args(tmp_path, per_device_train_batch_size=2, per_example_gradients="vmap", save_strategy="no")
    trainer = DPTrainer(tiny_model(family), args, train_dataset=data)
    bound = 0.01  # small enough that every record is clipped

    def clipped_sum(indices):
        grad_fn, state = clipped_grad(trainer._loss_fn(), clipping_norm=bound)
        return grad_fn(trainer._params, trainer.fetch_batch(data, torch.tensor(indices).numpy()), state=state)[0].value

    five, six, alone = clipped_sum([0, 1, 2, 3, 4]), clipped_sum([0, 1, 2, 3, 4, 5]), clipped_sum([5])
    moved = torch.sqrt(sum(((six[k] - five[k]).double() ** 2).sum() for k in five))
    assert moved <= bound * (1 + 1e-5)
    for name in five:
        torch.testing.assert_close(six[name] - five[name], alone[name], rtol=0, atol=1e-7)


# -- safe loading ----------------------------------------------------------------------------------------------------

STATE_FILES = [
    ckpt.DP_STATE,
    ckpt.DP_TENSORS,
    ckpt.DP_OPTIMIZER,
    ckpt.TRAINER_STATE,
    ckpt.ACCOUNTANT,
    "model.safetensors",
]


class _Payload:
    """Unpickling this creates the marker file: the proof that a loader ran code from a checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A finished 3-step run with its checkpoint-3, copied fresh for every case."""
    root = tmp_path_factory.mktemp("run")
    DPTrainer(tiny_model("llama"), _args(root / "out", max_steps=3), train_dataset=DATA).train()
    return root / "out" / "checkpoint-3"


def _resume(folder, tmp_path):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path / "resumed"), train_dataset=DATA)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=str(folder))
    assert type(caught.value) is CheckpointError
    return str(caught.value)


def _copy(checkpoint, tmp_path):
    folder = tmp_path / "checkpoint-3"
    shutil.copytree(checkpoint, folder)
    return folder


@pytest.mark.parametrize("name", STATE_FILES)
def test_a_pickle_payload_in_a_state_file_is_refused_without_running(checkpoint, tmp_path, name):
    folder = _copy(checkpoint, tmp_path)
    marker = tmp_path / "ran"
    (folder / name).write_bytes(pickle.dumps(_Payload(marker)))
    assert name in _resume(folder, tmp_path)
    assert not marker.exists()


def _truncate(path):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_json(path, **changes):
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("name", STATE_FILES)
@pytest.mark.parametrize("damage", [_truncate, _flip, Path.unlink, lambda p: p.write_bytes(b"")])
def test_a_damaged_state_file_raises_checkpoint_error(checkpoint, tmp_path, name, damage):
    folder = _copy(checkpoint, tmp_path)
    damage(folder / name)
    message = _resume(folder, tmp_path)
    assert name in message or "missing" in message or "not a complete" in message


@pytest.mark.parametrize(
    ("name", "changes", "needle"),
    [
        (ckpt.TRAINER_STATE, {"global_step": 2}, "checksum"),
        (ckpt.DP_STATE, {"global_step": 2}, "counters disagree"),
        (ckpt.DP_STATE, {"global_step": "3"}, "global_step"),
        (ckpt.DP_STATE, {"ledger": {"format": "x"}}, "ledger"),
        (ckpt.DP_STATE, {"noise_key": {"opake_key": "zz"}}, "keys"),
        (ckpt.DP_STATE, {"extra": 1}, "unknown fields"),
        (ckpt.DP_STATE, {"format": "opake.dp_state/1"}, "format"),
    ],
)
def test_an_edited_checkpoint_raises_checkpoint_error(checkpoint, tmp_path, name, changes, needle):
    """An edit of dp_state.json breaks its own checksum; resealed (as by someone who recomputes the plain checksum),
    it meets the check behind it. The format is read first."""
    folder = _copy(checkpoint, tmp_path)
    _edit_json(folder / name, **changes)
    if name == ckpt.DP_STATE and "format" not in changes:
        assert f"{ckpt.DP_STATE} does not match its own checksum" in _resume(folder, tmp_path)
        (folder / name).write_text(json.dumps(ckpt.seal(json.loads((folder / name).read_text()))))
    assert needle in _resume(folder, tmp_path)


def test_a_pickled_checkpoint_of_an_earlier_version_is_refused(checkpoint, tmp_path):
    folder = _copy(checkpoint, tmp_path)
    (folder / ckpt.DP_STATE).unlink()
    marker = tmp_path / "ran"
    (folder / "dp_state.pt").write_bytes(pickle.dumps(_Payload(marker)))
    assert "pickle" in _resume(folder, tmp_path)
    assert not marker.exists()


def test_epsilon_of_a_history_past_the_pld_limit_is_rdp_s_upper_bound():
    """A fixed-noise run of more than MAX_PLD_STEPS steps still reports epsilon at once, through the one epsilon
    function behind the logs, accountant.json and the model card: dp-accounting's RDP bound, computed here directly,
    named as such, never the refusal of a PLD query that would take hours."""
    import dp_accounting

    from opake_core.accounting.queries import MAX_PLD_STEPS
    from opake_torch.transformers.run_state import ledger_result

    steps, q, sigma, delta = MAX_PLD_STEPS + 7, 1e-3, 1.0, 1e-6
    ledger = accounting.Ledger().record(accounting.poisson(accounting.gaussian(sigma), q), steps)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    result = ledger_result(ledger, delta)
    assert result.accountant == "rdp" and result.value == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)
    within = accounting.Ledger().record(accounting.poisson(accounting.gaussian(sigma), q), 1000)
    assert ledger_result(within, delta) == within.epsilon(delta=delta)  # the PLD answer below the limit
