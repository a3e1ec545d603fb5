"""A word-level tokenizer and a one-layer Llama with random weights, built offline: the models of the TRL trainers'
docstring examples, and a start for a user's own unit tests of a private SFT or DPO run (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["WORDS", "tiny_llama", "word_tokenizer"]

WORDS = ("<pad>", "<eos>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran")
"""The vocabulary of :func:`word_tokenizer`'s default: padding, end of sequence, unknown, then eight words."""


def word_tokenizer(words: Sequence[str] = WORDS) -> Any:
    """A ``PreTrainedTokenizerFast`` that splits on whitespace and maps ``words[i]`` to id ``i``; ``words`` starts
    with the padding, end-of-sequence and unknown tokens.

    Example:

        >>> from opake_torch.transformers.trl.examples import word_tokenizer
        >>> word_tokenizer()("the cat sat")["input_ids"]
        [3, 4, 5]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=words[2]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=words[0], eos_token=words[1])


def tiny_llama(vocab_size: int = 16) -> Any:
    """A ``LlamaForCausalLM`` of one layer, width 16, two heads, random weights.

    Example:

        >>> from opake_torch.transformers.trl.examples import tiny_llama
        >>> sum(p.numel() for p in tiny_llama().parameters()) < 5_000
        True
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    return LlamaForCausalLM(config)
