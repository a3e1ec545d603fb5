"""A tiny word-level tokenizer with a chat template, and generated SFT / preference rows (no downloads)."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["red", "green", "blue", "cat", "dog", "sat", "ran", "on", "the", "mat", "big", "small", "yes", "no"]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>", "<end>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <end>{% endgeneration %}"
    "{% else %}{{ m['content'] }} <end>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over :data:`WORDS` (vocabulary 21 < tiny_hf.VOCAB)."""
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": _sentence(rng, rng.randint(3, 8))} for _ in range(n)]


def prompt_completion_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _sentence(rng, rng.randint(2, 5)), "completion": " " + _sentence(rng, rng.randint(1, 4))}
            for _ in range(n)]  # fmt: skip


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"messages": [{"role": "user", "content": _sentence(rng, rng.randint(2, 4))},
                      {"role": "assistant", "content": _sentence(rng, rng.randint(1, 4))}]}
        for _ in range(n)
    ]  # fmt: skip


def preference_rows(n: int, seed: int = 0, *, conversational: bool = False) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, chosen, rejected = (_sentence(rng, rng.randint(2, 4)) for _ in range(3))
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
        else:
            rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return rows
