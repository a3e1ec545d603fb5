"""SFTTrainer: data formats, completion-only masks, per-example independence, loss types, training, refusals."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_hf import tiny_model
from trl_support import chat_rows, prompt_completion_rows, text_rows, tiny_tokenizer

from opake_core.errors import ConfigurationError, InputTypeError
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers.trl import SFTConfig, SFTTrainer

BASE = {"privacy_noise_multiplier": 0.0, "clipping_norm": math.inf, "use_cpu": True, "disable_tqdm": True,
        "report_to": "none", "save_strategy": "no", "max_steps": 1, "per_device_train_batch_size": 4,
        "privacy_noise_seed": 0}  # fmt: skip


def _trainer(tmp_path, data, family="llama", **kwargs):
    return SFTTrainer(
        tiny_model(family), SFTConfig(str(tmp_path), **{**BASE, **kwargs}), train_dataset=data,
        eval_dataset=data, processing_class=tiny_tokenizer(),
    )  # fmt: skip


def test_formats_and_masks(tmp_path):
    tok = tiny_tokenizer()
    lm = _trainer(tmp_path, text_rows(2)).train_dataset[0]
    assert lm["input_ids"][-1] == tok.eos_token_id and torch.equal(lm["labels"], lm["input_ids"])
    pc = _trainer(tmp_path, prompt_completion_rows(2)).train_dataset[0]
    prompt_len = len(tok(prompt_completion_rows(2)[0]["prompt"])["input_ids"])
    assert (pc["labels"][:prompt_len] == -100).all() and (pc["labels"][prompt_len:] != -100).all()
    full = _trainer(tmp_path, prompt_completion_rows(2), completion_only_loss=False).train_dataset[0]
    assert torch.equal(full["labels"], full["input_ids"])
    chat = _trainer(tmp_path, chat_rows(2)).train_dataset[0]
    assert chat["input_ids"][0] == tok.convert_tokens_to_ids("<user>")
    assistant = _trainer(tmp_path, chat_rows(2), assistant_only_loss=True).train_dataset[0]
    start = int((chat["input_ids"] == tok.convert_tokens_to_ids("<assistant>")).nonzero()[0])
    assert (assistant["labels"][: start + 1] == -100).all() and (assistant["labels"][start + 1 :] != -100).all()
    short = _trainer(tmp_path, text_rows(2), max_length=3).train_dataset[0]
    assert len(short["input_ids"]) == 3
    pretokenized = _trainer(tmp_path, [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}]).train_dataset[0]
    assert pretokenized["labels"].tolist() == [-100, 6, 7]
    formatted = SFTTrainer(
        tiny_model("llama"),
        SFTConfig(str(tmp_path), **BASE),
        train_dataset=[{"a": "red", "b": "cat"}],
        processing_class=tok,
        formatting_func=lambda r: f"{r['a']} {r['b']}",
    ).train_dataset[0]
    assert formatted["input_ids"].tolist() == tok("red cat<eos>")["input_ids"]


def test_no_row_is_dropped_even_without_target_tokens(tmp_path):
    rows = [{"prompt": "red cat sat on the mat", "completion": " dog"}, *prompt_completion_rows(3)]
    trainer = _trainer(tmp_path, rows, max_length=3)
    assert len(trainer.train_dataset) == 4
    assert (trainer.train_dataset[0]["labels"] == -100).all()


@pytest.mark.parametrize("loss_type", ["nll", "dft", "chunked_nll"])
def test_neighbour_changes_only_its_own_contribution(tmp_path, loss_type):
    data = prompt_completion_rows(4)
    changed = [*data[:2], {"prompt": "big dog ran on the mat", "completion": " yes no yes no"}, data[3]]
    losses = []
    for rows in (data, changed):
        trainer = _trainer(tmp_path, rows, loss_type=loss_type, loss_chunk_size=3)
        batch = trainer.fetch_batch(trainer.train_dataset, [0, 1, 2, 3])
        per_example = torch.func.vmap(torch.func.grad_and_value(trainer.compute_per_example_loss), in_dims=(None, 0))
        grads, loss = per_example(trainer._params, batch)
        losses.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = losses
    keep = [0, 1, 3]
    torch.testing.assert_close(loss_a[keep], loss_b[keep], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(loss_a[2], loss_b[2])
    for name in grads_a:
        torch.testing.assert_close(grads_a[name][keep], grads_b[name][keep], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_chunked_nll_equals_nll_on_a_model(tmp_path, family):
    data = prompt_completion_rows(4)
    nll, chunked = (_trainer(tmp_path, data, family, loss_type=t, loss_chunk_size=3) for t in ("nll", "chunked_nll"))
    batch = nll.fetch_batch(nll.train_dataset, [0, 1, 2, 3])
    fn = torch.func.vmap(torch.func.grad_and_value(nll.compute_per_example_loss), in_dims=(None, 0))
    gn, ln = fn(nll._params, batch)
    gc, lc = torch.func.vmap(torch.func.grad_and_value(chunked.compute_per_example_loss), in_dims=(None, 0))(
        chunked._params, batch
    )
    torch.testing.assert_close(lc, ln, atol=1e-5, rtol=1e-5)
    for name in gn:
        torch.testing.assert_close(gc[name], gn[name], atol=1e-5, rtol=1e-5)


def test_private_training_runs_and_evaluates(tmp_path):
    trainer = _trainer(
        tmp_path, chat_rows(8), privacy_noise_multiplier=1.0, clipping_norm=1.0, max_steps=2, microbatch_size=2
    )
    output = trainer.train()
    assert output.global_step == 2 and math.isfinite(output.training_loss)
    assert math.isfinite(trainer.evaluate()["eval_loss"])


def test_lora_policy_trains_adapters_only(tmp_path):
    from peft import LoraConfig

    trainer = SFTTrainer(
        tiny_model("llama"), SFTConfig(str(tmp_path), **BASE), train_dataset=text_rows(4),
        processing_class=tiny_tokenizer(), peft_config=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    assert trainer._params and all("lora_" in name for name in trainer._params)
    trainer.train()


def test_plain_training_arguments_are_upcast(tmp_path):
    args = TrainingArguments(str(tmp_path), **BASE)
    trainer = SFTTrainer(tiny_model("llama"), args, train_dataset=text_rows(2), processing_class=tiny_tokenizer())
    assert isinstance(trainer.args, SFTConfig) and trainer.args.max_length is None


def test_refusals(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ConfigurationError, match="privacy_noise_multiplier"):
        SFTTrainer(tiny_model("llama"), None, train_dataset=text_rows(2), processing_class=tok)
    with pytest.raises(ConfigurationError, match="compute_loss_func"):
        SFTTrainer(tiny_model("llama"), SFTConfig(**BASE, loss_type="dft"), processing_class=tok,
                   compute_loss_func=lambda logits, labels: logits.sum())  # fmt: skip
    with pytest.raises(InputTypeError, match="cannot tell the format"):
        _trainer(tmp_path, [{"body": "red cat"}])
    with pytest.raises(ConfigurationError, match="generation"):
        plain = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        _trainer(tmp_path, chat_rows(2), assistant_only_loss=True, chat_template=plain)
    with pytest.raises(ConfigurationError, match="quantized base weights"):  # a model by name: test_trl_model_by_name
        SFTTrainer("some/model", SFTConfig(**BASE), processing_class=tok, quantization_config={"load_in_4bit": True})


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_layerwise_engine_serves_nll_and_trains_the_same_model(tmp_path, loss_type):
    """With loss_type='nll' the layerwise engine runs and matches vmap; other loss types fall back to vmap."""
    trained = {}
    for engine in ("auto", "vmap"):
        trainer = _trainer(
            tmp_path / engine, prompt_completion_rows(8), privacy_noise_multiplier=1.0, clipping_norm=0.1,
            max_steps=2, per_example_gradients=engine, loss_type=loss_type,
        )  # fmt: skip
        trainer.train()
        if engine == "auto":
            assert trainer.per_example_gradients_engine == ("layerwise" if loss_type == "nll" else "vmap")
        trained[engine] = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    for name, value in trained["vmap"].items():
        torch.testing.assert_close(trained["auto"][name], value, rtol=1e-5, atol=1e-6, msg=name)
