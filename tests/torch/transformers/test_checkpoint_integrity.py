"""A resume on changed data draws fresh noise, and a tampered checkpoint is refused.

Changed data: a resume that kept the checkpoint's keys on another dataset would add the same noise and draw the same
batches on two neighbouring datasets, and the two released models would then differ by the un-noised difference of
their clipped gradients (at most ``2C/B`` per step times the learning rate). The tests check that the keys change
and that the two models differ by the noise's scale instead, that the same data resumes bit-exactly, and that the
ledger and delta of the run stay those of what ran.

Tampering: every edit below resumed silently before the checkpoint was sealed and cross-checked; each must raise
CheckpointError naming the file, including when the editor recomputes the plain checksums it can see.
"""

from __future__ import annotations

import json
import logging
import math
import shutil

import datasets
import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld
from safetensors.torch import load_file, save_file
from tiny_hf import tiny_model, token_data

from opake_core.errors import CheckpointError, ConfigurationError, InputTypeError, PrivacyBudgetError
from opake_torch.state_files import sha256
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers.fingerprint import dataset_fingerprint
from opake_torch.transformers.keys import RunKeys

DATA = token_data(40)
DELTA = len(DATA) ** -1.1
SIGMA, LR, BATCH, BOUND = 4.0, 0.05, 8, 1.0


def _args(path, **kw):
    base = {
        "per_device_train_batch_size": BATCH,
        "max_steps": 4,
        "privacy_noise_multiplier": SIGMA,
        "clipping_norm": BOUND,
        "use_cpu": True,
        "disable_tqdm": True,
        "optim": "sgd",
        "learning_rate": LR,
        "lr_scheduler": "constant",
        "logging_steps": 4,
        "save_strategy": "steps",
        "save_steps": 3,
        "report_to": "none",
    }
    return TrainingArguments(str(path), **{**base, **kw})


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def _fresh_epsilon(history, delta):
    """A fresh dp-accounting PLD accountant fed the per-step history [(noise multiplier, rate, steps), ...]."""
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    for z, q, n in history:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
    return accountant.get_epsilon(delta)


def _replaced(data, index=0):
    """``data`` with row ``index`` replaced by a row that differs in its tokens (the deletion-and-resume case with
    a substitute record, which keeps the dataset size)."""
    row = token_data(1, seed=99)[0]
    assert not torch.equal(row["input_ids"], data[index]["input_ids"])
    return [row if i == index else r for i, r in enumerate(data)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 4-step run on DATA with its checkpoint-3, and its final weights and keys."""
    root = tmp_path_factory.mktemp("run")
    trainer = DPTrainer(tiny_model("llama"), _args(root / "out"), train_dataset=DATA)
    trainer.train()
    return root / "out" / "checkpoint-3", _params(trainer), trainer._keys


def _copy(checkpoint, tmp_path):
    folder = tmp_path / "checkpoint-3"
    shutil.copytree(checkpoint, folder)
    return folder


# -- fresh noise for a new trajectory --------------------------------------------------------------------------------


def test_a_resume_on_changed_data_draws_independent_noise(run, tmp_path, caplog):
    """One checkpoint resumed on D and on D with one record replaced. On D: the saved keys, bit-exact with the
    uninterrupted run. On the changed data: new noise and sampler keys, a warning, and a last step whose weights
    differ from D's by the scale of the noise, not by the clipped-gradient difference of one record.

    With shared keys both resumed runs draw the same batch and the same noise, so their weights after the one step
    differ by lr * (clipped sum difference) / B, at most lr * 2C / B (one record differs). With independent noise
    the difference holds lr * (n_A - n_B), n_A, n_B ~ N(0, (sigma C / B)^2 I_d), of norm lr sigma C / B *
    sqrt(2 chi^2_d), while the clipped sums move it by at most lr * (|b_A| + |b_B|) C / B <= lr * 2N C / B. So the
    threshold lr sigma C / B * sqrt(d) holds unless 2 chi^2_d < (sqrt(d) + 2N / sigma)^2, that is chi^2_d / d < 0.873
    for the d = 3,888 parameters here: probability 2e-9 (scipy's chi-square cdf).
    """
    checkpoint, full, _ = run
    saved = RunKeys.from_json(json.loads((checkpoint / ckpt.DP_STATE).read_text()), "test")

    same = DPTrainer(tiny_model("llama"), _args(tmp_path / "same"), train_dataset=DATA)
    same.train(resume_from_checkpoint=str(checkpoint))
    assert same._keys == saved
    assert all(torch.equal(full[k], v) for k, v in _params(same).items())

    changed = DPTrainer(tiny_model("llama"), _args(tmp_path / "changed"), train_dataset=_replaced(DATA))
    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        output = changed.train(resume_from_checkpoint=str(checkpoint))
    assert "training data differ" in caplog.text and "new noise and sampler keys" in caplog.text
    assert changed._keys.noise != saved.noise and changed._keys.sampler != saved.sampler

    a, b = _params(same), _params(changed)
    d = sum(v.numel() for v in a.values())
    distance = math.sqrt(sum(((a[k] - b[k]).double() ** 2).sum().item() for k in a))
    assert distance > LR * SIGMA * BOUND / BATCH * math.sqrt(d)
    assert distance > 100 * LR * 2 * BOUND / BATCH  # far above what shared keys would allow
    # the ledger continues: 3 steps at the checkpoint, 1 more on the changed data (same size, same rate)
    expected = _fresh_epsilon([(SIGMA, BATCH / len(DATA), 4)], DELTA)
    assert output.metrics["privacy_epsilon"] == pytest.approx(expected, rel=1e-6)


def test_a_resume_after_deleting_a_record_keeps_delta_and_composes_the_ledger(run, tmp_path, caplog):
    """Delete one record and resume: new keys, the checkpoint's delta (not 1/39**1.1), and the epsilon of 3 steps
    at rate 8/40 then 3 at 8/39, from dp-accounting directly."""
    checkpoint, _, saved = run
    resumed = DPTrainer(tiny_model("llama"), _args(tmp_path / "out", max_steps=6), train_dataset=DATA[1:])
    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        output = resumed.train(resume_from_checkpoint=str(checkpoint))
    assert "40 rows then, 39 now" in caplog.text and "keeps the delta" in caplog.text
    assert resumed._keys.noise != saved.noise
    assert resumed.privacy_plan.delta == DELTA and output.metrics["privacy_delta"] == DELTA
    expected = _fresh_epsilon([(SIGMA, BATCH / 40, 3), (SIGMA, BATCH / 39, 3)], DELTA)
    assert output.metrics["privacy_epsilon"] == pytest.approx(expected, rel=1e-6)
    record = json.loads((tmp_path / "out" / "checkpoint-6" / ckpt.ACCOUNTANT).read_text())
    assert record["delta"] == DELTA and record["epsilon"] == pytest.approx(expected, rel=1e-6)


def test_a_kept_delta_at_or_above_one_over_n_is_refused_and_an_explicit_one_is_used(run, tmp_path):
    """Twice the data: the checkpoint's delta 40**-1.1 = 0.0173 is above 1/80, so the resume is refused until a
    delta is set, which then states the epsilon of the whole history."""
    checkpoint, _, _ = run
    more = [*DATA, *token_data(40, seed=5)]
    with pytest.raises(PrivacyBudgetError, match="privacy_target_delta"):
        DPTrainer(tiny_model("llama"), _args(tmp_path / "a", max_steps=6), train_dataset=more).train(
            resume_from_checkpoint=str(checkpoint)
        )
    explicit = _args(tmp_path / "b", max_steps=6, privacy_target_delta=1e-3)
    output = DPTrainer(tiny_model("llama"), explicit, train_dataset=more).train(resume_from_checkpoint=str(checkpoint))
    expected = _fresh_epsilon([(SIGMA, BATCH / 40, 3), (SIGMA, BATCH / 80, 3)], 1e-3)
    assert output.metrics["privacy_epsilon"] == pytest.approx(expected, rel=1e-6)


def test_a_horizon_run_refuses_changed_data(tmp_path):
    horizon = {
        "max_steps": 4,
        "save_steps": 2,
        "privacy_noise_mechanism": "mf_band",
        "privacy_noise_mechanism_kwargs": {"bands": 2},
        "sampling_mode": "cyclic_poisson",
    }
    DPTrainer(tiny_model("llama"), _args(tmp_path / "out", **horizon), train_dataset=DATA).train()
    resumed = DPTrainer(tiny_model("llama"), _args(tmp_path / "b", **horizon), train_dataset=_replaced(DATA))
    with pytest.raises(CheckpointError, match="horizon cannot continue on other data"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


def test_ignore_data_skip_is_warned_and_changes_nothing(run, tmp_path, caplog):
    checkpoint, full, saved = run
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path / "out", ignore_data_skip=True), train_dataset=DATA)
    with caplog.at_level(logging.WARNING, logger="opake_torch"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "ignore_data_skip=True has no effect" in caplog.text
    assert trainer._keys == saved and all(torch.equal(full[k], v) for k, v in _params(trainer).items())


# -- the fingerprint -------------------------------------------------------------------------------------------------


def test_the_fingerprint_sees_every_kept_value_and_nothing_else():
    rows = token_data(30, classes=3)
    columns = {"input_ids", "attention_mask", "labels"}
    base = dataset_fingerprint(rows, columns)
    assert base.size == 30
    as_lists = [{k: v.tolist() for k, v in r.items()} for r in rows]
    assert dataset_fingerprint(as_lists, columns) == base  # the values, not their container
    assert dataset_fingerprint(datasets.Dataset.from_list(as_lists), columns) == base
    assert dataset_fingerprint([{**r, "text": "unused"} for r in rows], columns) == base  # a column not kept
    one_token = [dict(r) for r in rows]
    one_token[17] = {**rows[17], "input_ids": rows[17]["input_ids"].clone()}
    one_token[17]["input_ids"][2] += 1
    changes = [
        one_token,
        [rows[1], rows[0], *rows[2:]],  # order
        rows[:-1],  # a deleted row
        [{**r, "labels": r["labels"].double()} if i == 3 else r for i, r in enumerate(rows)],  # dtype
        [{**r, "input_ids": r["input_ids"][None]} if i == 5 else r for i, r in enumerate(rows)],  # shape
    ]
    for changed in changes:
        assert dataset_fingerprint(changed, columns) != base
    with_text = [{**r, "text": "kept"} for r in rows]
    assert dataset_fingerprint(with_text, None) != dataset_fingerprint(rows, None)  # a column kept
    assert dataset_fingerprint([{"a": ["x", [1, 2]]}], None) != dataset_fingerprint([{"a": ["x", [1, 3]]}], None)
    assert dataset_fingerprint([{"a": "ab", "b": "c"}], None) != dataset_fingerprint([{"a": "a", "b": "bc"}], None)
    assert dataset_fingerprint([{"a": np.int32(7)}], None) == dataset_fingerprint([{"a": 7}], None)
    bf16 = dataset_fingerprint([{"a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}], None)
    assert bf16 == dataset_fingerprint([{"a": [1.5, -2.0]}], None)
    assert "sha256" not in repr(base) and base.sha256 not in repr(base)
    with pytest.raises(InputTypeError, match=r"train_dataset\[1\].*object"):
        dataset_fingerprint([{"a": 1}, {"a": object()}], None)


def test_the_fingerprint_is_private(run):
    """It confirms a guessed record given the others, so only dp_state.json holds it."""
    checkpoint, _, _ = run
    manifest = json.loads((checkpoint / ckpt.DP_STATE).read_text())
    assert manifest["dataset"] == dataset_fingerprint(DATA, None).to_json()  # the llama keeps both columns
    for path in checkpoint.iterdir():
        if path.name != ckpt.DP_STATE:
            assert manifest["dataset"]["sha256"] not in path.read_bytes().decode("latin-1"), path


# -- tamper evidence -------------------------------------------------------------------------------------------------


def _resume(folder, tmp_path, **kw):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path / "resumed", **kw), train_dataset=DATA)
    with pytest.raises(CheckpointError) as caught:
        trainer.train(resume_from_checkpoint=str(folder))
    return str(caught.value)


def _manifest(folder):
    return json.loads((folder / ckpt.DP_STATE).read_text())


def _write_manifest(folder, manifest, *, reseal):
    """Write ``manifest``; ``reseal``: recompute its plain checksum, as someone who edits the file would."""
    (folder / ckpt.DP_STATE).write_text(json.dumps(ckpt.seal(manifest) if reseal else manifest))


def _raise_multiplier(ledger):
    """The ledger with every Gaussian's multiplier tripled: a smaller epsilon for the same steps."""
    text = json.dumps(ledger).replace(f'"noise_multiplier": {SIGMA}', f'"noise_multiplier": {3 * SIGMA}')
    assert text != json.dumps(ledger)
    return json.loads(text)


def test_an_edited_ledger_is_refused(run, tmp_path):
    checkpoint, _, _ = run
    cases = [
        ("dp_state.json", lambda m: m.update(ledger=_raise_multiplier(m["ledger"])), False, "own checksum"),
        ("dp_state.json", lambda m: m["ledger"]["entries"][0].update(count=2), False, "own checksum"),
        ("accountant.json", lambda m: m.update(ledger=_raise_multiplier(m["ledger"])), True, "disagrees"),
    ]
    for i, (where, edit, reseal, needle) in enumerate(cases):
        folder = _copy(checkpoint, tmp_path / str(i))
        manifest = _manifest(folder)
        edit(manifest)
        _write_manifest(folder, manifest, reseal=reseal)
        message = _resume(folder, tmp_path)
        assert where in message and needle in message, message

    # one flipped digit in the file as written: the multiplier 4.0 becomes 9.0
    folder = _copy(checkpoint, tmp_path / "flip")
    text = (folder / ckpt.DP_STATE).read_text()
    assert text.count('"noise_multiplier": 4.0') == 2  # in the ledger and in the configuration
    (folder / ckpt.DP_STATE).write_text(text.replace('"noise_multiplier": 4.0', '"noise_multiplier": 9.0', 1))
    assert f"{ckpt.DP_STATE} does not match its own checksum" in _resume(folder, tmp_path)


def test_an_edited_ledger_agreeing_with_an_edited_accountant_is_refused(run, tmp_path):
    """Both records raised alike, every plain checksum recomputed: the resume recomputes what its own arguments
    and data release, and the ledger's last release is not that."""
    checkpoint, _, _ = run
    folder = _copy(checkpoint, tmp_path)
    record = json.loads((folder / ckpt.ACCOUNTANT).read_text())
    record["ledger"] = _raise_multiplier(record["ledger"])
    (folder / ckpt.ACCOUNTANT).write_text(json.dumps(record))
    manifest = _manifest(folder)
    manifest["ledger"] = record["ledger"]
    manifest["files"][ckpt.ACCOUNTANT] = sha256(folder / ckpt.ACCOUNTANT)
    _write_manifest(folder, manifest, reseal=True)
    message = _resume(folder, tmp_path)
    assert f"{ckpt.DP_STATE} does not hold what its own arguments and data release" in message


def test_an_edited_manifest_field_is_refused(run, tmp_path):
    checkpoint, _, _ = run
    for field, value, reseal, where, needle in [
        ("delta", 0.5, False, ckpt.DP_STATE, "own checksum"),
        ("total_steps", 400, False, ckpt.DP_STATE, "own checksum"),
        ("expected_batch_size", 16.0, True, ckpt.ACCOUNTANT, "disagrees"),
        ("delta", 1e-9, True, ckpt.ACCOUNTANT, "disagrees"),
        ("total_steps", 400, True, ckpt.DP_STATE, "does not hold what its own arguments"),
    ]:
        folder = _copy(checkpoint, tmp_path / f"{field}-{reseal}")
        manifest = _manifest(folder)
        manifest[field] = value
        _write_manifest(folder, manifest, reseal=reseal)
        message = _resume(folder, tmp_path)
        assert where in message and needle in message, message


def test_a_removed_weights_entry_is_refused(run, tmp_path):
    """The weights zeroed and their entry removed from the list of files: refused, with or without a recomputed
    checksum of the manifest; the weights deleted as well: the manifest lists no weights."""
    checkpoint, _, _ = run
    for reseal, delete in [(False, False), (True, False), (True, True)]:
        folder = _copy(checkpoint, tmp_path / f"{reseal}-{delete}")
        weights = folder / "model.safetensors"
        save_file({k: torch.zeros_like(v) for k, v in load_file(weights).items()}, weights)
        if delete:
            weights.unlink()
        manifest = _manifest(folder)
        del manifest["files"]["model.safetensors"]
        _write_manifest(folder, manifest, reseal=reseal)
        message = _resume(folder, tmp_path)
        if not reseal:
            assert f"{ckpt.DP_STATE} does not match its own checksum" in message
        elif delete:
            assert "lists no weights file" in message
        else:
            assert "model.safetensors is not covered by the checksums" in message


def test_an_accountant_whose_ledger_differs_is_refused(run, tmp_path):
    """accountant.json with a shorter ledger and its checksum updated in a resealed manifest."""
    checkpoint, _, _ = run
    folder = _copy(checkpoint, tmp_path)
    record = json.loads((folder / ckpt.ACCOUNTANT).read_text())
    record["ledger"]["entries"][0]["count"] = 2
    (folder / ckpt.ACCOUNTANT).write_text(json.dumps(record))
    manifest = _manifest(folder)
    manifest["files"][ckpt.ACCOUNTANT] = sha256(folder / ckpt.ACCOUNTANT)
    _write_manifest(folder, manifest, reseal=True)
    message = _resume(folder, tmp_path)
    assert f"{ckpt.ACCOUNTANT} disagrees with" in message and "'ledger'" in message


def test_a_keyed_seal_refuses_edits_without_the_key(tmp_path, monkeypatch):
    key = "0123456789abcdef0123456789abcdef"
    monkeypatch.setenv(ckpt.KEY_ENV, key)
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path / "out"), train_dataset=DATA)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert _manifest(checkpoint)["checksum"]["algorithm"] == "hmac-sha256"
    resumed = DPTrainer(tiny_model("llama"), _args(tmp_path / "ok"), train_dataset=DATA)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed._keys == trainer._keys  # sealed under the key, resumed under the key: the same trajectory

    edited = _manifest(checkpoint)
    edited["ledger"] = _raise_multiplier(edited["ledger"])
    folder = _copy(checkpoint, tmp_path / "plain")
    monkeypatch.delenv(ckpt.KEY_ENV)
    _write_manifest(folder, edited, reseal=True)  # resealed without the key: a plain SHA-256
    monkeypatch.setenv(ckpt.KEY_ENV, key)
    assert "carries a plain SHA-256" in _resume(folder, tmp_path)
    folder = _copy(checkpoint, tmp_path / "wrong")
    monkeypatch.setenv(ckpt.KEY_ENV, "another key of 32 characters....")
    _write_manifest(folder, edited, reseal=True)
    monkeypatch.setenv(ckpt.KEY_ENV, key)
    assert "does not match its own checksum" in _resume(folder, tmp_path)
    monkeypatch.delenv(ckpt.KEY_ENV)
    assert f"set {ckpt.KEY_ENV}" in _resume(checkpoint, tmp_path)
    monkeypatch.setenv(ckpt.KEY_ENV, "short")
    short = DPTrainer(tiny_model("llama"), _args(tmp_path / "short"), train_dataset=DATA)
    with pytest.raises(ConfigurationError, match="at least 16 characters"):
        short.train()
    assert short.state.global_step == 0 and not (tmp_path / "short").exists()  # refused before any step
