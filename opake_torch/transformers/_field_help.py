"""The ``--help`` text of every field of :class:`~opake_torch.transformers.TrainingArguments` and the TRL configs.

``transformers.HfArgumentParser`` shows a field's ``metadata["help"]`` next to its option. The texts are the first
sentence of each field's entry on the 'Training arguments' and 'SFT and DPO' pages of the documentation (Hugging
Face's own wording where the field has Hugging Face's meaning); the pages say the rest. :func:`attach` adds them to
the fields once the classes exist, so that the class bodies keep one line per field.

The two options that also carry the names which are no field (``--local_rank``, ``--padding_free``; see
:mod:`~opake_torch.transformers._command_line`) stay hidden from ``--help``: listing them would list every such name.
"""

from __future__ import annotations

import argparse
import dataclasses
import types

__all__ = ["DPO_HELP", "HELP", "SFT_HELP", "attach"]

HELP: dict[str, str] = {
    # output
    "output_dir": "Where checkpoints, the model, the model card and accountant.json are written.",
    "overwrite_output_dir": "Let a training script write into a non-empty output_dir (read by scripts).",
    # batches
    "per_device_train_batch_size": "The expected size of one rank's Poisson draw for one DP step (the logical batch).",
    "per_device_eval_batch_size": "Evaluation batch per process; None: microbatch_size when set, else the train batch.",
    "microbatch_size": "The most examples per physical chunk (memory only; never changes the batch or epsilon).",
    "auto_find_microbatch_size": "On CUDA out-of-memory, halve the microbatch and retry the step.",
    "per_example_gradients": "How per-example gradients are formed: 'layerwise', 'vmap' or 'auto'.",
    "per_example_row_multiple": "Round each chunk's rows up to a multiple of this with dead rows (speed only).",
    "layerwise_ghost_advantage": "Weight of the ghost-norm cost against instantiating a per-example gradient.",
    # optimizer and schedule
    "learning_rate": "The peak learning rate of the schedule.",
    "weight_decay": "Decoupled weight decay (every optimizer but adam).",
    "adam_beta1": "beta1 of the Adam-family optimizers.",
    "adam_beta2": "beta2 of the Adam-family optimizers.",
    "adam_epsilon": "epsilon of the Adam-family optimizers.",
    "optim": "The optimizer: sgd, momentum, adam, adamw, adam-bc, adamw-bc, adafactor, lion, ... (docs: Optimizers).",
    "optim_args": "Keyword arguments of the optimizer (a dict, JSON or 'a=1,b=2'); they override the fields; "
    "with optim='schedule_free', 'base' names the optimizer it wraps.",
    "lr_scheduler": "The learning-rate schedule, by Hugging Face's name (--lr_scheduler_type too): linear, cosine, ...",
    "lr_scheduler_kwargs": "Keyword arguments of the schedule, Hugging Face's names (num_cycles, min_lr_rate, ...).",
    "warmup_steps": "Linear warm-up: a count of steps, or a float in (0, 1) for a fraction of the run.",
    "num_train_epochs": "Passes over the data in expectation (the horizon the budget is planned over).",
    "max_steps": "A positive count of DP steps overrides num_train_epochs.",
    # clipping
    "clipping_norm": "The L2 bound of each example's gradient (--max_grad_norm too); a dict for per-group bounds.",
    "clipping_mode": "'fixed', 'adaptive' (private quantile tracking) or 'auto' (AUTO-S normalization).",
    "clipping_kwargs": "Keys of the clipping mode (adaptive: target_quantile, clipping_norm_max; auto: gamma).",
    # privacy
    "privacy_target_epsilon": "The epsilon to reach: the noise multiplier is calibrated to it over the run.",
    "privacy_target_delta": "The delta of the guarantee; None: 1 / N**1.1 for N training examples.",
    "privacy_noise_multiplier": "A fixed noise multiplier instead of a target epsilon; 0.0 for a non-private run.",
    "privacy_accounting": "Compute and report epsilon (logs, metrics, accountant.json).",
    "privacy_allow_large_delta": "Accept privacy_target_delta >= 1/N (with a warning).",
    "privacy_noise_seed": "Replay the noise and the sampling from this seed (then whoever knows it knows the noise).",
    "privacy_noise_generator": "'philox' or 'chacha20' (the hardened generator).",
    "privacy_noise_mechanism": "'gaussian' (DP-SGD) or a DP-FTRL matrix factorization (mf_band, mf_blt, ...).",
    "privacy_noise_mechanism_kwargs": "Keys of the mechanism, merged over its defaults.",
    "noise_calibration_kwargs": "Search range and tolerance of the noise calibration (min, max, tolerance).",
    "sampling_mode": "The batch sampler the accountant is told about; 'auto': the mechanism's first sampler.",
    "sampling_kwargs": "Keys of the sampler (poisson: truncated_batch_size; k_out_of_t: k, allocation).",
    "privacy_unit": "What the guarantee protects: 'record' (one row) or 'user' (all rows of one user or document).",
    "privacy_user_column": "With privacy_unit='user': the dataset column naming each row's user (or document).",
    "privacy_max_rows_per_user": "With privacy_unit='user': the most rows a sampled user contributes to one step.",
    "privacy_user_reduction": "With privacy_unit='user': clip the 'mean' (default) or the 'sum' of a user's row "
    "gradients.",
    "ddp_shard": "Under DDP: 'per_rank' (disjoint shards at the cluster rate) or 'global' (each rank draws the whole "
    "dataset; accounted as a group of world_size records).",
    "router_aux_loss_coef": "Weight of the private router load-balancing loss of an MoE model (a privacy release).",
    "router_aux_kwargs": "Keys of the router release (max_tokens, ratio, mean_tokens, filter_beta).",
    "router_fp32": "Compute the MoE routers' logits, softmax and top-k in float32 (no bf16 ties between experts).",
    # precision, compile, kernels
    "bf16": "bf16 autocast of the per-example loss.",
    "bf16_full_eval": "Evaluate in bf16.",
    "tf32": "Switch TF32 matmuls and convolutions on or off for the process; None leaves them alone.",
    "gradient_checkpointing": "Recompute activations in the backward (a vmap-safe recompute) to save memory.",
    "gradient_checkpointing_kwargs": "Hugging Face's keys the recompute honours (use_reentrant, ...).",
    "activation_offloading": "Keep the activations saved for the backward in pinned host memory (vmap: with "
    "gradient_checkpointing).",
    "torch_compile": "Compile the per-microbatch function; falls back to eager with a warning.",
    "torch_compile_backend": "The torch.compile backend (None: inductor).",
    "torch_compile_mode": "The torch.compile mode: default, reduce-overhead, max-autotune, ...",
    "cuda_graphs": "How many graph signatures of the clip-and-reduce function to capture and replay (0: off).",
    "use_compat_patches": "Apply the vmap-safety patches to the model.",
    "use_performance_kernels": "Use the fused CUDA/Triton kernels (--use_liger_kernel too).",
    "performance_kernels_config": "Per-kernel switches of the performance kernels.",
    "use_cpu": "Run on the CPU even when a GPU is available.",
    # reproducibility
    "seed": "Seed of Python, NumPy and torch (initialization, dropout); never of the DP noise or sampling.",
    "data_seed": "Seed of the evaluation and script-side data order; None: seed.",
    "full_determinism": "Deterministic torch kernels (transformers' enable_full_determinism(seed)), for debugging; "
    "slower. A run replays bitwise only with privacy_noise_seed too.",
    # logging
    "logging_dir": "Where TensorBoard logs go; None: output_dir/runs.",
    "logging_strategy": "When to log: 'no', 'steps' or 'epoch'.",
    "logging_first_step": "Log the first step too.",
    "logging_steps": "Log every this many steps (a count, or a fraction of the run).",
    "disable_tqdm": "Hide the progress bar; None: hidden below log level warning.",
    "report_to": "Integrations to report to ('none', 'tensorboard', 'wandb', 'all', ...).",
    "run_name": "A name of the run for the integrations.",
    "include_num_input_tokens_seen": "Log the number of input tokens seen ('no', 'all' or 'non_padding').",
    "include_tokens_per_second": "Log the tokens per second of training.",
    "step_perf": "Log each step's phase times (perf/<phase>_sec) and peak memory; synchronizes the device.",
    "log_level": "Log level of the main process: debug, info, warning, error, critical or passive.",
    "log_level_replica": "Log level of the other processes.",
    "log_on_each_node": "Log from the main process of every node, not only of the first.",
    "project": "The project name of the trackio integration.",
    "trackio_space_id": "The Hugging Face Space of the trackio dashboard.",
    "trackio_bucket_id": "The bucket of the trackio logs.",
    "trackio_static_space_id": "The static Space of the trackio dashboard.",
    # saving
    "save_strategy": "When to save a checkpoint: 'no', 'steps', 'epoch' or 'best'.",
    "save_steps": "Save every this many steps (a count, or a fraction of the run).",
    "save_total_limit": "Keep at most this many checkpoints (the best one is protected).",
    "save_safetensors": "Save the weights as safetensors.",
    "save_on_each_node": "Save on the main process of every node.",
    "save_only_model": "Save the weights and the accountant only (such a checkpoint cannot be resumed).",
    "load_best_model_at_end": "Load the best checkpoint (by metric_for_best_model) when training ends.",
    "metric_for_best_model": "The eval metric that picks the best checkpoint ('loss': eval_loss).",
    "greater_is_better": "Whether a larger metric_for_best_model is better; None: not for a loss.",
    "restore_callback_states_from_checkpoint": "Restore the callbacks' state on resume.",
    "resume_from_checkpoint": "A DP checkpoint folder to resume from (read by scripts and by train()).",
    "enable_jit_checkpoint": "On SIGTERM or SIGUSR1, save a checkpoint after the current step and exit (128 + signal).",
    "ignore_data_skip": "No effect: a DP resume continues the checkpoint's batches from the sampler key.",
    # evaluation
    "eval_strategy": "When to evaluate: 'no', 'steps' or 'epoch'.",
    "eval_steps": "Evaluate every this many steps (a count, or a fraction of the run); None: logging_steps.",
    "eval_on_start": "Evaluate once before training.",
    "eval_delay": "Steps or epochs to wait before the first evaluation.",
    "prediction_loss_only": "Return only the loss from evaluation and prediction.",
    "include_for_metrics": "What compute_metrics also receives: a subset of ['inputs', 'loss'].",
    # data
    "label_names": "The label columns of the batches; None: the model's own.",
    "label_smoothing_factor": "Label smoothing of the cross-entropy, within each example.",
    "remove_unused_columns": "Drop the dataset columns the model's forward does not take.",
    "dataloader_num_workers": "Worker processes that fetch and collate rows (0: this process).",
    "dataloader_pin_memory": "Pinned host memory for the copy to the GPU.",
    "max_length": "Tokens kept per example (keep-start truncation); None keeps all.",
    "pad_to_multiple_of": "Pad each batch to a multiple of this length.",
    # distributed
    "ddp_backend": "The torch.distributed backend: nccl, gloo, mpi or ucc.",
    "ddp_timeout": "Timeout of the collective operations, in seconds.",
    "fsdp": "Hugging Face's FSDP options under torchrun: 'full_shard', 'shard_grad_op', 'auto_wrap'.",
    "fsdp_config": "The FSDP settings: a dict or a JSON file (transformer_layer_cls_to_wrap, ...).",
    "average_tokens_across_devices": "Hugging Face's token averaging; a private loss is a mean within each example.",
    # hub
    "push_to_hub": "Push the model and its card to the Hub when training ends.",
    "hub_model_id": "The Hub repository to push to ('user/name').",
    "hub_token": "The token to push with (never logged or saved).",
    "hub_private_repo": "Create the Hub repository as private.",
    # script flags
    "do_train": "Whether to run training (read by scripts).",
    "do_eval": "Whether to run evaluation (read by scripts).",
    "do_predict": "Whether to run prediction (read by scripts).",
}

_TRL_LOADING = {
    "model_init_kwargs": "Keyword arguments of from_pretrained (dtype, revision, ...) for a model given by name.",
    "trust_remote_code": "Run the model's own code from its repository when loading it by name.",
    "chat_template": "A Jinja chat template (its text or a file) set on a copy of the tokenizer.",
}

SFT_HELP: dict[str, str] = {
    **_TRL_LOADING,
    "learning_rate": HELP["learning_rate"] + " TRL's SFT default.",
    "logging_steps": HELP["logging_steps"],
    "max_length": "Tokens kept per example (keep-start truncation); None keeps all.",
    "dataset_text_field": "The text column of a language-modelling dataset.",
    "completion_only_loss": "Train on completion tokens only; None: True for prompt-completion data.",
    "assistant_only_loss": "Train on assistant turns only (the template must mark them with generation tags).",
    "eos_token": "The token appended to non-conversational text; None: the tokenizer's.",
    "loss_type": "The per-example loss: 'nll', 'dft' or 'chunked_nll'.",
    "loss_chunk_size": "Positions per chunk for loss_type='chunked_nll'.",
    "packing": "Refused when True: one row must be one example (the privacy unit).",
}

DPO_HELP: dict[str, str] = {
    **_TRL_LOADING,
    "learning_rate": HELP["learning_rate"] + " TRL's DPO default.",
    "logging_steps": HELP["logging_steps"],
    "max_length": "Tokens kept per prompt + completion sequence (keep-start truncation).",
    "beta": "The DPO temperature (the weight of the KL term; IPO's tau).",
    "loss_type": "Per-pair DPO loss(es): sigmoid, hinge, ipo, robust, simpo, cpo, orpo, chosen_nll, ... (a,b: MPO).",
    "loss_weights": "One weight per loss of loss_type (MPO); None: all 1.",
    "label_smoothing": "The flip probability of 'robust', the epsilon of 'exo_pair', the smoothing of simpo/cpo.",
    "discopop_tau": "The temperature of loss_type='discopop'.",
    "simpo_gamma": "SimPO's target reward margin.",
    "cpo_alpha": "The weight of CPO's NLL term.",
    "orpo_lambda": "The weight of ORPO's odds-ratio term.",
    "ld_alpha": "LD-DPO: weight in [0, 1] of the tokens past the shorter completion; None: plain sums.",
    "f_divergence_type": "f-DPO's divergence: reverse_kl (DPO), forward_kl, js_divergence, alpha_divergence.",
    "f_alpha_divergence_coef": "The alpha of f_divergence_type='alpha_divergence'.",
    "use_weighting": "WPO: weigh each pair by its completions' probabilities under the policy.",
    "precompute_ref_log_probs": "Score every example with the reference once, when the trainer is built.",
    "precompute_ref_batch_size": "Batch size of that pass; None: per_device_eval_batch_size.",
    "sync_ref_model": "TR-DPO: move the reference towards the released policy every ref_model_sync_steps steps.",
    "ref_model_mixup_alpha": "TR-DPO: the policy's weight in a sync, in (0, 1]: ref = a * policy + (1 - a) * ref.",
    "ref_model_sync_steps": "TR-DPO: the steps between two syncs of the reference.",
    "disable_dropout": "Set every dropout probability of the policy and the reference to 0.",
}


def attach(cls: type, texts: dict[str, str]) -> None:
    """Give each field of ``cls`` named in ``texts`` that text as its ``--help`` (a hidden option stays hidden)."""
    for f in dataclasses.fields(cls):
        if f.name in texts and f.metadata.get("help") is not argparse.SUPPRESS:
            f.metadata = types.MappingProxyType({**f.metadata, "help": texts[f.name]})
