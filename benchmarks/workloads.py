"""Benchmark workloads: models built from configs with random weights, and synthetic token batches.

Every workload is a (model, batch size, sequence length, dtype) that all modes of :mod:`harness` run on the same
batch. Nothing is downloaded: models come from ``transformers`` configs with a fixed seed, inputs from
``torch.randint`` on a seeded CPU generator (so CPU and GPU runs see the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["HOST", "SCALE", "SUITES", "Workload", "build_model", "make_batch", "model_inputs", "per_example_losses"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Workload:
    """One benchmark setting.

    Attributes:
        name: identifier used in the outputs and on the command line.
        family: ``"bert"`` (sequence classification, full fine-tune), ``"llama_lora"`` (causal LM, frozen base with
            LoRA adapters on every linear layer of the blocks), ``"llama"`` (causal LM, full fine-tune), ``"gpt2"``
            (causal LM, full fine-tune) or ``"qwen3_moe"`` (mixture-of-experts causal LM, full fine-tune: routers and
            stacked experts included).
        batch: examples per step (the same fixed batch in every mode).
        seq: tokens per example.
        dtype: dtype of the base weights (``"float32"`` or ``"bfloat16"``); LoRA adapters stay float32 (PEFT's default).
        config: keyword overrides of the ``transformers`` config (the defaults are the full-size models).
        lora_rank: LoRA rank for ``llama_lora``.
        trainer_args: keyword arguments that both trainers' ``TrainingArguments`` get (``gradient_checkpointing``,
            ``bf16``), so that the private and the non-private rows run with the same knobs.
        description: one line for the tables.
    """

    name: str
    family: str
    batch: int
    seq: int
    dtype: str = "float32"
    config: dict[str, Any] = field(default_factory=dict)
    lora_rank: int = 16
    trainer_args: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def task(self) -> str:
        return "sequence_classification" if self.family == "bert" else "causal_lm"

    @property
    def vocab_size(self) -> int:
        default = {"bert": 30522, "gpt2": 50257}.get(self.family, 32000)  # llama families: 32000
        return int(self.config.get("vocab_size", default))


LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
LLAMA3_8B = {  # the shape of Llama-3-8B (random weights)
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 32768,
    "rope_theta": 500000.0,
}
CHECKPOINTING = {"gradient_checkpointing": True}
QWEN3_MOE_SMALL = {  # a Qwen3-MoE-shaped model of about 2B parameters (0.5B active): 32 experts, top-4
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 704,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
TINY_QWEN3_MOE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
TINY_BERT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
TINY_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
TINY_GPT2 = {
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "vocab_size": 128,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

SUITES: dict[str, tuple[Workload, ...]] = {
    "gpu": (
        Workload("bert_base_s128_b32", "bert", 32, 128, description="BERT-base seq-cls, full fine-tune, fp32"),
        Workload(
            "llama1b_lora16_s512_b16",
            "llama_lora",
            16,
            512,
            "bfloat16",
            LLAMA_1B,
            description="Llama-style 1.1B (2048 hidden, 16 layers), bf16 base, LoRA r=16 on all linear layers",
        ),
        Workload(
            "llama1b_lora16_s2048_b8",
            "llama_lora",
            8,
            2048,
            "bfloat16",
            LLAMA_1B,
            description="same model, seq 2048",
        ),
        Workload(
            "gpt2_small_s512_b16", "gpt2", 16, 512, description="GPT-2 small (124M) causal LM, full fine-tune, fp32"
        ),
    ),
    # Tiny float32 stand-ins of the same three families: fast on CPU, and exact enough for a float64 reference.
    "smoke": (
        Workload("tiny_bert_s16_b4", "bert", 4, 16, config=TINY_BERT, description="tiny BERT seq-cls, full"),
        Workload(
            "tiny_llama_lora4_s16_b4",
            "llama_lora",
            4,
            16,
            config=TINY_LLAMA,
            lora_rank=4,
            description="tiny Llama LoRA",
        ),
        Workload("tiny_gpt2_s16_b4", "gpt2", 4, 16, config=TINY_GPT2, description="tiny GPT-2 causal LM, full"),
    ),
}

# Models at scale, with activation checkpointing on both sides. Not in a suite's default run: name them.
SCALE: tuple[Workload, ...] = (
    Workload(
        "llama8b_lora16_s4096_b8_ckpt",
        "llama_lora",
        8,
        4096,
        "bfloat16",
        LLAMA3_8B,
        trainer_args=CHECKPOINTING,
        description="Llama-3-8B shape, bf16 base, LoRA r=16 on all linear layers, gradient checkpointing",
    ),
    Workload(
        "llama1b_full_s512_b16_ckpt",
        "llama",
        16,
        512,
        config=LLAMA_1B,
        trainer_args={**CHECKPOINTING, "bf16": True},
        description="Llama-style 1.1B, full fine-tune, fp32 weights, bf16 autocast, gradient checkpointing",
    ),
    Workload(
        "qwen3moe_full_s512_b8",
        "qwen3_moe",
        8,
        512,
        config=QWEN3_MOE_SMALL,
        trainer_args={"bf16": True},
        description="Qwen3-MoE shape (32 experts, top-4), full fine-tune incl. routers and experts, bf16 autocast",
    ),
    Workload(
        "tiny_qwen3moe_full_s16_b4",
        "qwen3_moe",
        4,
        16,
        config=TINY_QWEN3_MOE,
        description="tiny Qwen3-MoE, full fine-tune incl. routers and experts",
    ),
    # A tiny stand-in of the full fine-tune with checkpointing and bf16: fast on CPU (the harness's smoke test).
    Workload(
        "tiny_llama_full_s16_b4_ckpt",
        "llama",
        4,
        16,
        config=TINY_LLAMA,
        trainer_args={**CHECKPOINTING, "bf16": True},
        description="tiny Llama, full fine-tune, bf16 autocast, gradient checkpointing",
    ),
)


# CPU stand-ins with the layer-shape ratios of the GPU workloads (the ratio T / width sets which weights take ghost
# norms), small enough that a CPU step is bound by the host work a GPU step is bound by. Run when named, on CPU.
HOST_BERT = {
    "hidden_size": 48,
    "intermediate_size": 192,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 64,
}
HOST_GPT2 = {
    "n_embd": 192,
    "n_layer": 4,
    "n_head": 4,
    "vocab_size": 1024,
    "n_positions": 128,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
HOST_QWEN3_MOE = {  # Qwen3-MoE's routing (128 experts, top-8) at a small width: the experts' host work per layer
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 1024,
    "max_position_embeddings": 64,
}
HOST: tuple[Workload, ...] = (
    Workload(
        "host_bert12_w48_s8_b32",
        "bert",
        32,
        8,
        config=HOST_BERT,
        description="BERT-base's depth and T / width (12 layers, width 48, 8 tokens), full fine-tune",
    ),
    Workload(
        "host_gpt2_w192_s128_b8",
        "gpt2",
        8,
        128,
        config=HOST_GPT2,
        description="GPT-2 small's T / width (4 layers, width 192, 128 tokens), full fine-tune",
    ),
    Workload(
        "host_qwen3moe_e128_w64_s32_b8",
        "qwen3_moe",
        8,
        32,
        config=HOST_QWEN3_MOE,
        description="Qwen3-MoE's experts and top-k (128, top-8; 4 layers, width 64, 32 tokens), full fine-tune",
    ),
)


def build_model(workload: Workload, device: torch.device, *, seed: int = 0) -> torch.nn.Module:
    """The workload's model with random weights (identical for a given seed), on ``device``, in train mode."""
    from transformers import (
        AutoModelForCausalLM,
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        Qwen3MoeConfig,
    )

    torch.manual_seed(seed)
    dtype = getattr(torch, workload.dtype)
    with torch.device(device):
        if workload.family == "bert":
            config = BertConfig(num_labels=2, attn_implementation="sdpa", **workload.config)
            config.problem_type = "single_label_classification"
            model = BertForSequenceClassification(config)
        elif workload.family == "gpt2":
            model = GPT2LMHeadModel(GPT2Config(attn_implementation="sdpa", **workload.config))
        elif workload.family in ("llama", "llama_lora"):  # built in its dtype: an 8B model is not built in fp32 first
            config = LlamaConfig(attn_implementation="sdpa", **workload.config)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        elif workload.family == "qwen3_moe":
            config = Qwen3MoeConfig(attn_implementation="sdpa", **workload.config)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            families = "'bert', 'gpt2', 'llama', 'llama_lora' or 'qwen3_moe'"
            raise ValueError(f"unknown workload family {workload.family!r}; use {families}.")
    model = model.to(dtype)
    if workload.family == "llama_lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=workload.lora_rank, lora_alpha=workload.lora_rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
        )
        model = get_peft_model(model, lora)
    return model.train()


def make_batch(workload: Workload, batch: int, device: torch.device, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """A synthetic batch ``{name: [batch, ...]}`` with ``labels``, identical on every device for a given seed.

    BERT gets explicit per-example ``position_ids`` and ``token_type_ids``: the model's broadcast ``[1, T]`` buffers
    break Opacus's per-sample hooks, and explicit inputs keep every mode on the same tensors.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, workload.vocab_size, (batch, workload.seq), generator=gen)
    if workload.task == "causal_lm":
        out = {"input_ids": ids, "labels": ids.clone()}
    else:
        out = {
            "input_ids": ids,
            "token_type_ids": torch.zeros_like(ids),
            "position_ids": torch.arange(workload.seq).expand(batch, -1).contiguous(),
            "labels": torch.randint(0, 2, (batch,), generator=gen),
        }
    return {k: v.to(device) for k, v in out.items()}


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch without its labels (what ``model(**inputs)`` takes)."""
    return {k: v for k, v in batch.items() if k != "labels"}


def per_example_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    """Float32 losses ``[B]``, the same per-example objective as ``opake_torch.transformers.loss``.

    Causal LM: mean next-token cross-entropy over each sequence's own tokens; classification: cross-entropy.
    """
    logits = model(**model_inputs(batch)).logits
    labels = batch["labels"]
    if task == "causal_lm":
        shifted = logits[:, :-1].float()
        nll = F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1), reduction="none")
        return nll.view(labels.shape[0], -1).mean(dim=1)
    return F.cross_entropy(logits.float(), labels, reduction="none")
