"""Tiny random Hugging Face models and generated token data for tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 48


def tiny_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "max_position_embeddings": 32}
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
