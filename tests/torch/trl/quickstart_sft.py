# TRL's SFT quick start (TRL docs, "Quickstart" > "Supervised Fine-Tuning"), run by test_quickstart.py. Unmodified
# except for what the comments mark: the trainer import switched to Opake's, DP arguments added, and, because tests
# never touch the network, a tiny random model with a locally built tokenizer instead of "Qwen/Qwen2.5-0.5B" and a
# tiny local file in trl-lib/Capybara's format (conversations under "messages") instead of the hub dataset.
from datasets import load_dataset
from tiny_hf import tiny_model  # test harness: a tiny random causal LM, no download
from trl_support import tiny_tokenizer  # test harness: a word-level tokenizer with a chat template, built locally

from opake_torch.transformers.trl import SFTConfig, SFTTrainer  # was: from trl import SFTTrainer

trainer = SFTTrainer(
    model=tiny_model("llama"),  # was: model="Qwen/Qwen2.5-0.5B"
    train_dataset=load_dataset("json", data_files="capybara.jsonl", split="train"),  # was: "trl-lib/Capybara"
    args=SFTConfig(privacy_target_epsilon=8.0, max_steps=2),  # added: the privacy budget (and a short run)
    processing_class=tiny_tokenizer(),  # added: TRL loads the tokenizer from the model name
)
trainer.train()
