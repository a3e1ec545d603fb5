"""Tiny random Hugging Face models and generated token data for tests (no downloads)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    TrainerCallback,
)

if TYPE_CHECKING:
    from pathlib import Path

    from opake_torch.transformers import TrainingArguments

VOCAB = 48
BATCH = 8  # the per-device batch of tiny_args: the expected batch of its Poisson sampler


class StopAt(TrainerCallback):
    """Stops training at the end of step ``step`` (an interrupted run, to be resumed from its checkpoint)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def tiny_model(family: str, **overrides: Any) -> torch.nn.Module:
    """A one-layer model of ``family`` (``"llama"``, ``"qwen2"``, ``"gpt2"`` or ``"bert"``) with random weights (seed
    0) and eager attention; ``overrides`` go to its config (``tie_word_embeddings=True``, ``pad_token_id=0``)."""
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "max_position_embeddings": 32, **overrides}
    if family == "llama":
        config = LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            **common,
        )
        model = LlamaForCausalLM(config)
    elif family == "qwen2":
        config = Qwen2Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            **common,
        )
        model = Qwen2ForCausalLM(config)
    elif family == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **overrides,
        )
        model = GPT2LMHeadModel(config)
    elif family == "bert":
        config = BertConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        model = BertForSequenceClassification(config)
    else:
        raise ValueError(family)
    model.config._attn_implementation = "eager"
    return model


def tiny_moe(model_type: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny mixture-of-experts causal LM (``"mixtral"``, ``"qwen3_moe"`` or ``"gpt_oss"``; two MoE layers, four
    experts, top-2) in ``dtype``, in training mode; gpt-oss with eager attention (it has no SDPA path)."""
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
        num_experts=4, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, 0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attention = "eager" if model_type == "gpt_oss" else "sdpa"
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    if dtype == torch.float64:  # torch._grouped_mm (the default on CPU) has no float64 kernel
        model.config._experts_implementation = "batched_mm"
    return model.to(dtype).train()


def tiny_gated_deltanet(model_type: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny hybrid causal LM with gated delta-net layers (``"qwen3_next"`` or ``"qwen3_5_moe_text"``): a linear
    attention (gated delta-net: depthwise causal conv of kernel 4 over 32 channels, 4 value heads) and a full
    attention layer, each with a mixture of four experts (top-2) and a shared expert, in ``dtype``, training mode,
    SDPA attention, the config's ``use_cache=True`` left as shipped."""
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, linear_conv_kernel_dim=4, linear_key_head_dim=4, linear_value_head_dim=4,
        linear_num_key_heads=2, linear_num_value_heads=4,
    )  # fmt: skip
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, 0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # off their constant initial values (norm weights, dt_bias): every channel differs
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    if dtype == torch.float64:  # torch._grouped_mm (the default on CPU) has no float64 kernel
        model.config._experts_implementation = "batched_mm"
    return model.to(dtype).train()


def token_data(n: int, seed: int = 0, *, classes: int | None = None) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 10, (1,), generator=gen))
        row = {"input_ids": torch.randint(1, VOCAB, (length,), generator=gen)}
        row["attention_mask"] = torch.ones(length, dtype=torch.long)
        if classes:
            row["labels"] = torch.randint(0, classes, (), generator=gen)
        rows.append(row)
    return rows


def padded_batch() -> dict[str, torch.Tensor]:
    """A collated causal-LM batch of three rows of 9 tokens: the second padded after 6 tokens, the third after 4
    (``attention_mask`` 0 and ``labels`` -100 there)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tiny_args(tmp_path: Path, **kw) -> TrainingArguments:
    """The trainer's arguments for a tiny private run on CPU, written to ``tmp_path / "out"``: batches of
    :data:`BATCH`, noise multiplier 1, no progress bar, no checkpoints, no reports; ``kw`` adds or overrides
    arguments."""
    from opake_torch.transformers import TrainingArguments

    base = {
        "per_device_train_batch_size": BATCH,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
        "report_to": "none",
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


def tiny_lora(family: str = "llama", targets: tuple[str, ...] = ("q_proj", "v_proj"), std: float = 0.1, model=None):
    """``tiny_model(family)`` (or ``model``) with rank-4 LoRA adapters on ``targets``; B is drawn normal(0, std)
    instead of peft's zeros, so that A gets a gradient too."""
    import peft

    lora = peft.get_peft_model(model if model is not None else tiny_model(family),
                               peft.LoraConfig(r=4, target_modules=list(targets)))  # fmt: skip
    torch.manual_seed(1)
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)
    return lora


def functional_losses(model: torch.nn.Module, family: str, dtype: torch.dtype = torch.float64) -> tuple:
    """``model`` in ``dtype`` and eval mode as a pure function: its trainable parameters, the per-example and batched
    losses of its task (sequence classification for BERT, else causal LM) and a collated batch of six examples."""
    from opake_torch.functional import functional_model
    from opake_torch.patches import apply_runtime_patches
    from opake_torch.transformers.data import collate, language_modeling_labels
    from opake_torch.transformers.loss import batch_losses, per_example_loss

    apply_runtime_patches()
    model = model.to(dtype).eval()
    apply, params, frozen = functional_model(model)
    task = "sequence_classification" if family == "bert" else "causal_lm"
    batch = collate(token_data(6, classes=3 if family == "bert" else None), pad_token_id=0)
    if task == "causal_lm":
        batch = language_modeling_labels(batch)

    def loss(p, example):
        return per_example_loss(apply, p, frozen, example, task=task)

    def batch_loss(p, b):
        return batch_losses(apply, p, frozen, b, task=task)

    return params, loss, batch_loss, batch
