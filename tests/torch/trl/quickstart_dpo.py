# TRL's DPO quick start (TRL docs, "Quickstart" > "Direct Preference Optimization"), run by test_quickstart.py.
# Unmodified except for what the comments mark: the trainer import switched to Opake's, DP arguments added, and,
# because tests never touch the network, a tiny random model with a locally built tokenizer instead of
# "Qwen/Qwen2.5-0.5B-Instruct" and a tiny local file in trl-lib/ultrafeedback_binarized's format (conversational
# "chosen" / "rejected" with an implicit prompt, plus the score columns) instead of the hub dataset.
from datasets import load_dataset
from tiny_hf import tiny_model  # test harness: a tiny random causal LM, no download
from trl_support import tiny_tokenizer  # test harness: a word-level tokenizer with a chat template, built locally

from opake_torch.transformers.trl import DPOConfig, DPOTrainer  # was: from trl import DPOTrainer

trainer = DPOTrainer(
    model=tiny_model("llama"),  # was: model="Qwen/Qwen2.5-0.5B-Instruct"
    train_dataset=load_dataset("json", data_files="ultrafeedback.jsonl", split="train"),  # was: the hub dataset
    args=DPOConfig(privacy_target_epsilon=8.0, max_steps=2),  # added: the privacy budget (and a short run)
    processing_class=tiny_tokenizer(),  # added: TRL loads the tokenizer from the model name
)
trainer.train()
