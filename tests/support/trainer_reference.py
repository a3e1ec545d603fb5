"""A trainer run that replays (:func:`replayable_args`) and its private steps composed by hand from the core
(:func:`reference_run`): the independent reference that the trainer's weights are compared with, bit for bit.

The reference uses the core alone (``sampling.poisson``, ``step.dp_sgd``, the optimizer under test) and writes the
trainer's key derivation out, the root key of ``privacy_noise_seed`` folded with each stream's name, instead of
importing the trainer's keys or step helpers: a change in the trainer's keys, sampling, loss, clipping, noise or
optimizer then shows as a difference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from tiny_hf import BATCH, tiny_args, tiny_model

from opake_core import optim, random, sampling
from opake_core.step import dp_sgd
from opake_torch.functional import functional_model
from opake_torch.transformers import TrainingArguments
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import causal_lm_loss

LR, BETAS, EPS, DECAY = 0.01, (0.8, 0.95), 1e-6, 0.01  # the fields a named optimizer reads from the arguments
SEED = 42  # privacy_noise_seed: the reference replays the trainer's noise and batches


def replayable_args(tmp_path, **kw) -> TrainingArguments:
    """:func:`tiny_hf.tiny_args` of a run that :func:`reference_run` replays: noise and batches from
    ``privacy_noise_seed=SEED``, the vmap engine, a constant learning rate ``LR``, weight decay ``DECAY``, Adam's
    betas ``BETAS`` and epsilon ``EPS``; ``kw`` adds or overrides arguments."""
    base = {
        "learning_rate": LR,
        "weight_decay": DECAY,
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "lr_scheduler": "constant",
        "per_example_gradients": "vmap",
        "privacy_noise_seed": SEED,
    }
    return tiny_args(tmp_path, **{**base, **kw})


class ReferenceRun(NamedTuple):
    """``steps``: the parameters after each step; ``published``: the weights to publish after the last step (the
    optimizer's ``eval_params``, the average for Schedule-Free)."""

    steps: list[dict[str, torch.Tensor]]
    published: dict[str, torch.Tensor]


def reference_run(opt: optim.Optimizer, *, data: list[dict], steps: int) -> ReferenceRun:
    """``steps`` steps of ``tiny_model("llama")`` with ``opt`` on ``data``, as the trainer runs them on
    :func:`replayable_args`: Poisson batches of expected size :data:`tiny_hf.BATCH` from the sampler key, a
    per-example causal-LM loss, DP-SGD with clipping norm 1 and noise multiplier 1 (the noise key) over microbatches
    of the expected batch."""
    apply, params, frozen = functional_model(tiny_model("llama"))
    root = random.key(SEED)
    sampler = sampling.poisson(dataset_size=len(data), sample_rate=BATCH / len(data))
    sampler_key, sampler_state = random.fold_in(root, "opake.trainer.sampler"), sampler.init()

    def loss(p, example):
        inputs = {k: v[None] for k, v in example.items() if k != "labels"}
        return causal_lm_loss(apply(p, frozen, **inputs).logits[0], example["labels"])

    step_fn, dp_state = dp_sgd(
        loss,
        optimizer=opt,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=float(BATCH),
        microbatch_size=BATCH,  # the trainer's default chunk: the expected batch
        key=random.fold_in(root, "opake.trainer.noise"),
    )
    opt_state, out = opt.init(params), []
    for _ in range(steps):
        index, sampler_state = sampler.sample(sampler_key, sampler_state)
        batch = language_modeling_labels(collate([data[i] for i in index]))
        params, opt_state, dp_state, _ = step_fn(params, opt_state, dp_state, (batch,))
        out.append({k: v.clone() for k, v in params.items()})
    return ReferenceRun(out, opt.eval_params(opt_state, params))
