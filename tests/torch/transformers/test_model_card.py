"""The model card (README.md) that save_model writes: the guarantee as accountant.json records it, for full models
and PEFT adapters, what lies outside it, and what an upload holds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from huggingface_hub import ModelCard
from tiny_hf import tiny_lora, tiny_model, token_data

from opake_torch.hub import publishable_files
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers.model_card import OUTSIDE_THE_GUARANTEE, model_card

CLASSES = token_data(40, classes=3)
TEXT = token_data(40)


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 8,
        "max_steps": 3,
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 3,
    }
    if "privacy_target_epsilon" not in kw:
        base.update(privacy_noise_multiplier=1.0, privacy_accounting=True)
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def _saved(trainer):
    trainer.train()
    folder = trainer.save_model()
    card = (folder / "README.md").read_text()
    record = json.loads((folder / "accountant.json").read_text()) if (folder / "accountant.json").is_file() else None
    return folder, card, record


def _rows(card):
    """The two-column table of the guarantee as a dict."""
    rows = [line.strip("|").split("|") for line in card.splitlines() if line.startswith("| ") and line.count("|") == 3]
    return {name.strip(): value.strip() for name, value in rows}


def test_card_states_the_guarantee_of_accountant_json(tmp_path):
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, privacy_target_epsilon=2.0), train_dataset=CLASSES)
    folder, card, record = _saved(trainer)
    rows = _rows(card)
    assert rows["epsilon"].startswith(f"{record['epsilon']:.6g} ")
    assert record["epsilon"] <= 2.0 and f"ε = {record['epsilon']:.4g}" in card
    assert rows["delta"] == f"{record['delta']:.6g}" and f"δ = {record['delta']:.3g}" in card
    assert record["accountant"] == "pld" and "PLDAccountant" in rows["accountant"]
    assert record["adjacency"] == "add_or_remove" and rows["neighbouring relation"].startswith("adding or removing")
    assert rows["privacy unit"] == "one example (one row of the training dataset)"
    assert rows["sampler"].startswith("Poisson sampling") and f"q = {record['sample_rate']:.6g}" in rows["sampler"]
    assert f"expected batch {record['expected_batch_size']:.6g}" in rows["sampler"]
    assert record["mechanism"] == "gaussian" and "DP-SGD" in rows["mechanism"]
    assert rows["clipping"] == "each example's gradient clipped to L2 norm 1"
    assert rows["noise multiplier"] == f"{record['noise_multiplier']:.6g} (calibrated to the target epsilon)"
    assert rows["steps"] == str(record["steps"]) == "3"
    for item in OUTSIDE_THE_GUARANTEE:
        assert item in card
    for topic in ("Logged metrics", "Evaluation", "Hyperparameter tuning", "pretraining data"):
        assert topic in card
    data = ModelCard.load(folder / "README.md").data
    assert data.library_name == "transformers" and {"opake", "differential-privacy"} <= set(data.tags)
    assert "dp_state" not in card and "key" not in card.lower().replace("keys are never saved", "")


def test_peft_adapter_card_replaces_peft_text_and_keeps_its_metadata(tmp_path):
    model = tiny_lora()
    model.peft_config["default"].base_model_name_or_path = "tiny-org/tiny-llama"
    trainer = DPTrainer(model, _args(tmp_path), train_dataset=TEXT)
    folder, card, record = _saved(trainer)
    assert (folder / "adapter_model.safetensors").is_file()
    data = ModelCard.load(folder / "README.md").data
    assert data.library_name == "peft" and data.base_model == "tiny-org/tiny-llama"
    assert {"lora", "transformers", "opake", "differential-privacy"} <= set(data.tags)  # peft's tags and ours
    assert "[More Information Needed]" not in card  # peft's generic template is gone
    assert "tiny-org/tiny-llama" in card.split("## Privacy guarantee")[0]
    rows = _rows(card)
    assert rows["epsilon"].startswith(f"{record['epsilon']:.6g} ")
    assert rows["privacy unit"].startswith("one sequence")  # a causal LM's row is one sequence


def test_a_trainer_names_its_privacy_unit(tmp_path):
    class PairTrainer(DPTrainer):
        privacy_unit = "one preference pair"

    trainer = PairTrainer(tiny_model("llama"), _args(tmp_path), train_dataset=TEXT)
    _, card, _ = _saved(trainer)
    assert _rows(card)["privacy unit"] == "one preference pair (one row of the training dataset)"


def test_non_private_and_unaccounted_runs_say_so(tmp_path):
    open_run = DPTrainer(tiny_model("bert"), _args(tmp_path / "a", privacy_noise_multiplier=0.0), train_dataset=CLASSES)
    _, card, record = _saved(open_run)
    assert record["epsilon"] == "inf" and "**None.**" in card and _rows(card)["epsilon"].startswith("inf")
    quiet = DPTrainer(
        tiny_model("bert"),
        _args(tmp_path / "b", privacy_noise_multiplier=1.0, privacy_accounting=False),
        train_dataset=CLASSES,
    )
    folder, card, record = _saved(quiet)
    assert record is None and not (folder / "accountant.json").exists()
    assert "Epsilon was not computed" in card and _rows(card)["epsilon"] == "not computed"
    assert _rows(card)["noise multiplier"] == "1"


def test_create_model_card_takes_hugging_faces_arguments(tmp_path):
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path), train_dataset=CLASSES)
    trainer.create_model_card()  # before training: no guarantee to state
    card = (tmp_path / "out" / "README.md").read_text()
    assert "No private training run" in card
    trainer.train()
    trainer.create_model_card(
        language="en",
        license="apache-2.0",
        tags=["demo"],
        model_name="tiny-private",
        finetuned_from="tiny-org/tiny-bert",
        tasks="text-classification",
        dataset_tags="tiny-org/tiny-data",
        dataset="tiny data",
        dataset_args="default",
    )
    path = tmp_path / "out" / "README.md"
    data = ModelCard.load(path).data
    assert data.language == "en" and data.license == "apache-2.0" and data.base_model == "tiny-org/tiny-bert"
    assert data.pipeline_tag == "text-classification" and data.datasets == ["tiny-org/tiny-data"]
    assert {"demo", "opake", "differential-privacy"} <= set(data.tags)
    card = path.read_text()
    assert card.count("# tiny-private (differentially private)") == 1 and "ε = " in card
    assert "train_loss" not in card and "Training results" not in card  # no table of private statistics


def test_publishable_files_include_the_card_but_not_the_results(tmp_path):
    trainer = DPTrainer(tiny_model("bert"), _args(tmp_path, logging_steps=1), train_dataset=CLASSES)
    metrics = trainer.train().metrics
    folder = trainer.save_model()
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    files = publishable_files(folder)
    assert {"README.md", "accountant.json", "model.safetensors", "config.json"} <= set(files)
    assert not {"train_results.json", "all_results.json", "trainer_state.json"} & set(files)
    assert not any(name.startswith("runs/") for name in files)


def test_push_to_hub_uploads_the_card_with_hugging_faces_arguments(tmp_path, monkeypatch):
    import huggingface_hub

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private, exist_ok):
            calls["repo"] = (repo_id, private)

        def upload_folder(self, folder_path, repo_id, allow_patterns, commit_message, revision):
            calls["upload"] = (repo_id, sorted(allow_patterns), commit_message, revision)
            return "committed"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    args = _args(tmp_path, hub_model_id="me/tiny-private")
    trainer = DPTrainer(tiny_model("bert"), args, train_dataset=CLASSES)
    trainer.save_metrics("train", trainer.train().metrics)
    result = trainer.push_to_hub(commit_message="done", token="t", finetuned_from="tiny-org/tiny-bert", tasks="x")
    assert result == "committed" and calls["token"] == "t" and calls["repo"] == ("me/tiny-private", True)
    repo, files, message, revision = calls["upload"]
    assert (repo, message, revision) == ("me/tiny-private", "done", None)
    assert "README.md" in files and "accountant.json" in files and "train_results.json" not in files
    card = (tmp_path / "out" / "README.md").read_text()
    assert "# tiny-private (differentially private)" in card and "tiny-org/tiny-bert" in card


def test_model_card_is_a_pure_function_of_the_record():
    args = SimpleNamespace(clipping_norm=0.5, clipping_mode="adaptive", sampling_kwargs={})

    record = {
        "epsilon": 1.25,
        "delta": 1e-6,
        "accountant": "monte_carlo",
        "adjacency": "add_or_remove",
        "steps": 100,
        "noise_multiplier": 2.0,
        "calibration_source": "fixed",
        "sample_rate": 0.01,
        "expected_batch_size": 64.0,
        "sampling_mode": "balls_in_bins",
        "mechanism": "mf_blt",
        "horizon": True,
    }
    card = model_card(record, args, unit="one example", metadata={"license": "mit"}, versions={"opake": "x"})
    assert card == model_card(record, args, unit="one example", metadata={"license": "mit"}, versions={"opake": "x"})
    rows = _rows(card)
    assert "DP-FTRL" in rows["mechanism"] and "mf_blt" in rows["mechanism"]
    assert rows["sampler"].startswith("balls-in-bins") and "Monte Carlo" in rows["accountant"]
    assert rows["clipping"].startswith("adaptive") and rows["noise multiplier"] == "2"
    assert "for its whole declared horizon" in card and card.startswith("---\nlicense: mit\n---\n")
    assert "Framework versions: opake x." in card


@pytest.mark.parametrize("mode", ["auto", "fixed"])
def test_clipping_rows(mode):
    bound = {"lora_A": 0.5, "fallback": 1.0} if mode == "fixed" else 2.0
    args = SimpleNamespace(clipping_norm=bound, clipping_mode=mode, sampling_kwargs={"truncated_batch_size": 12})

    record = {
        "epsilon": 3.0,
        "delta": 1e-5,
        "accountant": "pld",
        "steps": 5,
        "noise_multiplier": 1.0,
        "sample_rate": 0.1,
        "sampling_mode": "poisson",
        "mechanism": "gaussian",
    }
    rows = _rows(model_card(record, args, unit="one example", versions={}))
    assert rows["sampler"].endswith("truncated at 12 rows")
    assert ("AUTO-S" in rows["clipping"]) == (mode == "auto")
    assert ("`lora_A`: 0.5" in rows["clipping"]) == (mode == "fixed")
