"""Parity with TRL: with multiplier 0 and clipping off, our per-example losses and gradients equal TRL's.

Compared against the real ``trl.SFTTrainer`` / ``trl.DPOTrainer``, instantiated offline on the same tiny random model
(same seed) and a locally built tokenizer: TRL prepares and collates the data, and ``trainer.compute_loss(model,
batch)`` gives the loss, differentiated with ``torch.autograd.grad``. Ours is ``compute_per_example_loss`` under
``torch.func.grad`` (what DP-SGD clips). SFT is compared one example per batch, because TRL's SFT loss divides by the
number of tokens in the whole batch, which couples examples (our loss is the per-example mean by design); DPO's TRL
loss is already a mean of per-pair losses, so it is also compared on a batch of several pairs. TRL's log metrics
(``rewards/*``, ``logps/*``, ``mean_token_accuracy``...) are compared with ours, computed per example and reduced.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from tiny_hf import tiny_model
from trl_support import chat_rows, preference_rows, prompt_completion_rows, text_rows, tiny_tokenizer

from opake_torch.transformers.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from opake_torch.transformers.trl.config import DPO_LOSS_TYPES
from opake_torch.transformers.trl.dpo_losses import REFERENCE_FREE_LOSSES
from opake_torch.transformers.trl.metrics import DPO_METRICS, SFT_METRICS, TRLMetrics

trl = pytest.importorskip("trl", reason="TRL parity needs the opake[trl] extra")
datasets = pytest.importorskip("datasets", reason="TRL's trainers need the datasets library")

OURS = {"privacy_noise_multiplier": 0.0, "clipping_norm": math.inf, "use_cpu": True, "disable_tqdm": True,
        "report_to": "none", "save_strategy": "no", "max_steps": 1}  # fmt: skip
THEIRS = {"report_to": "none", "use_cpu": True, "per_device_train_batch_size": 1, "gradient_checkpointing": False,
          "bf16": False, "max_length": 64}  # fmt: skip


def _trl_grads(trainer, batch):
    model = trainer.model
    loss = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return loss.detach(), {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads, strict=True)}


def _our_grads(trainer, batch):
    def mean_loss(params):
        losses = torch.func.vmap(trainer.compute_per_example_loss, in_dims=(None, 0))(params, batch)
        return losses.mean(), losses

    grads, losses = torch.func.grad(mean_loss, has_aux=True)(trainer._params)
    return losses.mean().detach(), grads


def _assert_equal(ours, theirs):
    loss, grads = ours
    trl_loss, trl_grads = theirs
    torch.testing.assert_close(loss, trl_loss, atol=1e-5, rtol=1e-5)
    assert set(grads) == set(trl_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("rows", "kwargs"),
    [(text_rows, {}), (prompt_completion_rows, {}), (chat_rows, {}), (prompt_completion_rows, {"loss_type": "dft"})],
)
def test_sft_loss_and_gradient_equal_trl(tmp_path, rows, kwargs):
    data, tokenizer = rows(3), tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.SFTTrainer(
            tiny_model("llama"),
            args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), **THEIRS, **kwargs),
            train_dataset=datasets.Dataset.from_list(data),
            processing_class=tokenizer,
        )
    ours = SFTTrainer(
        tiny_model("llama"), SFTConfig(str(tmp_path), **OURS, **kwargs), train_dataset=data, processing_class=tokenizer
    )
    for i in range(len(data)):
        trl_batch = theirs.data_collator([theirs.train_dataset[i]])
        our_batch = ours.fetch_batch(ours.train_dataset, [i])
        assert torch.equal(our_batch["input_ids"], trl_batch["input_ids"])
        assert torch.equal(our_batch["labels"], trl_batch["labels"])
        _assert_equal(_our_grads(ours, our_batch), _trl_grads(theirs, trl_batch))


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("conversational", [False, True])
def test_dpo_loss_and_gradient_equal_trl(tmp_path, loss_type, conversational):
    data, tokenizer = preference_rows(3, conversational=conversational), tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.DPOTrainer(
            tiny_model("llama"),
            ref_model=tiny_model("llama"),
            args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), **THEIRS, loss_type=[loss_type], beta=0.5),
            train_dataset=datasets.Dataset.from_list(data),
            processing_class=tokenizer,
        )
    policy = tiny_model("llama")
    with torch.no_grad():  # a reference different from the policy, so that the log-ratios are not zero
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for p, q in zip(theirs.model.parameters(), policy.parameters(), strict=True):
            p.copy_(q)
    ours = DPOTrainer(
        policy,
        tiny_model("llama"),
        DPOConfig(str(tmp_path), **OURS, loss_type=loss_type, beta=0.5),
        train_dataset=data,
        processing_class=tokenizer,
    )
    for rows in ([0], [1], [0, 1, 2]):
        trl_batch = theirs.data_collator([theirs.train_dataset[i] for i in rows])
        our_batch = ours.fetch_batch(ours.train_dataset, rows)
        _assert_equal(_our_grads(ours, our_batch), _trl_grads(theirs, trl_batch))


# -- every per-pair DPO loss, and TRL's log metrics --------------------------------------------------------------------

SMOOTHING = {"exo_pair": 1e-3, "robust": 0.1}


def _trl_logged(trainer):
    """What TRL's compute_loss just appended to its metrics, in either mode."""
    logged = trainer._metrics["train"] or trainer._metrics["eval"]
    return {name: values[-1] for name, values in logged.items()}


def _our_logged(trainer, batch):
    fn = torch.func.vmap(trainer.compute_per_example_loss_and_metrics, in_dims=(None, 0))
    losses, values = fn(trainer._params, batch)
    metrics = TRLMetrics()
    metrics.add(values)
    return losses, metrics.drain()


def _dpo_pair(tmp_path, loss_type, data, tokenizer, **options):
    extra = {"label_smoothing": SMOOTHING.get(loss_type, 0.0), **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.DPOTrainer(
            tiny_model("llama"),
            ref_model=tiny_model("llama"),
            args=trl.DPOConfig(
                output_dir=str(tmp_path / "trl"), **THEIRS, loss_type=_as_list(loss_type), beta=0.5, **extra
            ),
            train_dataset=datasets.Dataset.from_list(data),
            processing_class=tokenizer,
        )
    policy = tiny_model("llama")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for p, q in zip(theirs.model.parameters(), policy.parameters(), strict=True):
            p.copy_(q)
    ours = DPOTrainer(
        policy,
        tiny_model("llama"),
        DPOConfig(str(tmp_path), **OURS, loss_type=loss_type, beta=0.5, **extra),
        train_dataset=data,
        processing_class=tokenizer,
    )
    return theirs, ours


def _as_list(loss_type):
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


# TRL's DPOTrainer has the losses that read a reference; SimPO, CPO and ORPO are its CPO / ORPO trainers' (their
# batch-wide NLL mean differs from the per-pair one here) and are checked against float64 formulas instead
@pytest.mark.parametrize("loss_type", [loss for loss in DPO_LOSS_TYPES if loss not in REFERENCE_FREE_LOSSES])
def test_every_dpo_loss_and_trls_log_metrics_equal_trl(tmp_path, loss_type):
    data, tokenizer = preference_rows(3), tiny_tokenizer()
    theirs, ours = _dpo_pair(tmp_path, loss_type, data, tokenizer)
    rows = [0, 1, 2]
    trl_batch = theirs.data_collator([theirs.train_dataset[i] for i in rows])
    our_batch = ours.fetch_batch(ours.train_dataset, rows)
    _assert_equal(_our_grads(ours, our_batch), _trl_grads(theirs, trl_batch))
    trl_logged = _trl_logged(theirs)
    losses, logged = _our_logged(ours, our_batch)
    torch.testing.assert_close(losses, torch.func.vmap(ours.compute_per_example_loss, in_dims=(None, 0))(
        ours._params, our_batch))  # fmt: skip
    assert set(DPO_METRICS) <= set(logged) and set(DPO_METRICS) <= set(trl_logged)
    for name in DPO_METRICS:
        if name == "num_tokens":
            assert logged[name] == trl_batch["attention_mask"].sum().item()
        else:
            assert logged[name] == pytest.approx(trl_logged[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize(
    ("loss_type", "options"),
    [
        (("sigmoid", "ipo", "hinge"), {"loss_weights": [1.0, 0.5, 2.0]}),  # MPO
        ("sigmoid", {"use_weighting": True}),  # WPO
        ("ipo", {"ld_alpha": 0.3}),  # LD-DPO
        ("sigmoid", {"f_divergence_type": "js_divergence"}),  # f-DPO
        ("hinge", {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}),
        ("robust", {"f_divergence_type": "forward_kl"}),
    ],
    ids=["mpo", "wpo", "ld_dpo", "f_dpo_js", "f_dpo_alpha", "f_dpo_forward"],
)
def test_dpo_options_equal_trl(tmp_path, loss_type, options):
    """TRL's DPOTrainer options that reshape each pair's loss: equal loss and gradients on a batch of three pairs
    with different completion lengths."""
    data, tokenizer = preference_rows(3, seed=5), tiny_tokenizer()
    data[0]["chosen"] = " the big cat sat on the mat"
    theirs, ours = _dpo_pair(tmp_path, loss_type, data, tokenizer, **options)
    rows = [0, 1, 2]
    trl_batch = theirs.data_collator([theirs.train_dataset[i] for i in rows])
    _assert_equal(_our_grads(ours, ours.fetch_batch(ours.train_dataset, rows)), _trl_grads(theirs, trl_batch))


@pytest.mark.parametrize(("rows", "kwargs"), [(chat_rows, {}), (prompt_completion_rows, {"loss_type": "dft"})])
def test_sft_log_metrics_equal_trl(tmp_path, rows, kwargs):
    data, tokenizer = rows(3), tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.SFTTrainer(
            tiny_model("llama"),
            args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), **THEIRS, **kwargs),
            train_dataset=datasets.Dataset.from_list(data),
            processing_class=tokenizer,
        )
    ours = SFTTrainer(
        tiny_model("llama"), SFTConfig(str(tmp_path), **OURS, **kwargs), train_dataset=data, processing_class=tokenizer
    )
    for i in range(len(data)):  # one example per batch: TRL's token ratios are then per example too
        trl_batch = theirs.data_collator([theirs.train_dataset[i]])
        our_batch = ours.fetch_batch(ours.train_dataset, [i])
        _assert_equal(_our_grads(ours, our_batch), _trl_grads(theirs, trl_batch))
        trl_logged = _trl_logged(theirs)
        losses, logged = _our_logged(ours, our_batch)
        torch.testing.assert_close(losses, _our_grads(ours, our_batch)[0][None])
        assert set(SFT_METRICS) <= set(logged)
        for name in ("mean_token_accuracy", "entropy"):
            assert logged[name] == pytest.approx(trl_logged[name], rel=1e-5, abs=1e-6), name
        assert logged["num_tokens"] == trl_batch["attention_mask"].sum().item()
