"""DPTrainer: equal to the core step composed by hand, exact resume, atomic checkpoints, rules."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld
from tiny_hf import StopAt, tiny_model, token_data
from transformers import EarlyStoppingCallback, TrainerCallback

from opake_core import optim, random, sampling
from opake_core.errors import CheckpointError, ConfigurationError
from opake_core.step import dp_sgd
from opake_torch.functional import functional_model
from opake_torch.layerwise import ghost
from opake_torch.state_files import load_tree
from opake_torch.transformers import DPTrainer, TrainingArguments
from opake_torch.transformers import checkpoint_folder as ckpt
from opake_torch.transformers.data import collate, language_modeling_labels
from opake_torch.transformers.loss import causal_lm_loss

DATA = token_data(40)


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 8,
        "max_steps": 4,
        "privacy_noise_multiplier": 1.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "learning_rate": 0.05,
        "lr_scheduler": "constant",
        "logging_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 42,  # these tests replay the trainer's noise; tests/torch/transformers/test_lifecycle.py
        # covers the default secret keys
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


@pytest.mark.parametrize(
    ("mode", "sampler"),
    [
        ("poisson", sampling.poisson(dataset_size=len(DATA), sample_rate=8 / len(DATA))),
        ("fixed_size", sampling.fixed_size(dataset_size=len(DATA), batch_size=8)),
    ],
)
def test_one_step_equals_core_composition(tmp_path, mode, sampler):
    """Bitwise, with the same (vmap) engine; tests/torch/layerwise compares the layerwise engine with this one."""
    args = _args(tmp_path, max_steps=1, optim="sgd", per_example_gradients="vmap", sampling_mode=mode)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    trainer.train()

    model = tiny_model("llama")
    apply, params, frozen = functional_model(model)
    root = random.key(args.privacy_noise_seed)
    index, _ = sampler.sample(random.fold_in(root, "opake.trainer.sampler"), sampler.init())
    batch = language_modeling_labels(collate([DATA[i] for i in index]))

    def loss(p, example):
        inputs = {k: v[None] for k, v in example.items() if k != "labels"}
        return causal_lm_loss(apply(p, frozen, **inputs).logits[0], example["labels"])

    opt = optim.sgd(0.05)
    noise_key = random.fold_in(root, "opake.trainer.noise")
    step_fn, dp_state = dp_sgd(
        loss,
        optimizer=opt,
        clipping_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=8.0,
        microbatch_size=8,  # the trainer's default chunk: the expected batch
        key=noise_key,
    )
    expected, *_ = step_fn(params, opt.init(params), dp_state, (batch,))
    for name, value in trainer.model.named_parameters():
        assert torch.equal(value.detach(), expected[name]), name


def _run(tmp_path, steps, resume=None, **kw):
    args = _args(tmp_path, max_steps=6, save_strategy="steps", save_steps=3, privacy_accounting=True, **kw)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    if steps < 6:
        trainer.add_callback(StopAt(steps))
    output = trainer.train(resume_from_checkpoint=resume)
    return trainer, output


def test_resume_is_bitwise_identical(tmp_path):
    full, full_out = _run(tmp_path / "a", 6)
    _run(tmp_path / "b", 3)
    resumed, resumed_out = _run(tmp_path / "b", 6, resume=True)
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert resumed_out.metrics["privacy_epsilon"] == full_out.metrics["privacy_epsilon"]
    a_opt = load_tree(tmp_path / "a/out/checkpoint-6" / ckpt.DP_OPTIMIZER)
    b_opt = load_tree(tmp_path / "b/out/checkpoint-6" / ckpt.DP_OPTIMIZER)
    import optree

    assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a_opt), optree.tree_leaves(b_opt), strict=True))
    accountant = json.loads((tmp_path / "b/out/checkpoint-6" / ckpt.ACCOUNTANT).read_text())
    assert accountant["steps"] == 6 and accountant["epsilon"] == pytest.approx(full_out.metrics["privacy_epsilon"])


def test_killed_checkpoint_write_leaves_previous_usable(tmp_path, monkeypatch):
    _run(tmp_path, 3)
    out = tmp_path / "out"
    assert ckpt.latest_checkpoint(out).name == "checkpoint-3"
    real_save = ckpt.save_tree

    def crash(path, tree):
        if str(path).endswith(ckpt.DP_OPTIMIZER):
            raise KeyboardInterrupt("killed")
        return real_save(path, tree)

    monkeypatch.setattr(ckpt, "save_tree", crash)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, 6, resume=True)
    monkeypatch.setattr(ckpt, "save_tree", real_save)
    assert [p.name for p in ckpt.checkpoints(out)] == ["checkpoint-3"]
    ckpt.require_resumable(out / "checkpoint-3")
    _, output = _run(tmp_path, 6, resume=True)
    assert output.global_step == 6


@pytest.mark.parametrize(("optim_name", "lr"), [("sgd", 0.05), ("adamw", 1e-3)])
def test_non_private_matches_plain_training(tmp_path, optim_name, lr):
    """Multiplier 0 and no clipping is plain training on the sampled batches (loss = sum / expected batch).

    Adam moves every coordinate by about lr whatever the gradient's size, so float summation-order differences in
    heavily cancelling embedding gradients show up at the scale of lr * 1e-4: lr is kept at 1e-3 for AdamW.
    """
    args = _args(
        tmp_path,
        max_steps=3,
        privacy_noise_multiplier=0.0,
        clipping_norm=math.inf,
        weight_decay=0.01,
        optim=optim_name,
        learning_rate=lr,
    )
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    trainer.train()

    model = tiny_model("llama")
    if optim_name == "sgd":
        reference = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=0.01)
    else:
        reference = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sampler = sampling.poisson(dataset_size=len(DATA), sample_rate=8 / len(DATA))
    key, state = random.fold_in(random.key(args.privacy_noise_seed), "opake.trainer.sampler"), sampler.init()
    for _ in range(3):
        index, state = sampler.sample(key, state)
        reference.zero_grad()
        total = 0
        for i in index:  # one example at a time: a per-example mean loss, summed, over the expected batch
            example = language_modeling_labels(collate([DATA[i]]))
            logits = model(input_ids=example["input_ids"], attention_mask=example["attention_mask"]).logits
            total = total + causal_lm_loss(logits[0], example["labels"][0])
        (total / 8).backward()
        reference.step()
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), model.named_parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-6, name


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "bert"])
def test_families_train_and_evaluate(tmp_path, family):
    data = token_data(24, classes=3 if family == "bert" else None)
    args = _args(tmp_path, max_steps=2, privacy_target_epsilon=5.0, privacy_noise_multiplier=None)
    trainer = DPTrainer(tiny_model(family), args, train_dataset=data, eval_dataset=data[:6])
    output = trainer.train()
    assert math.isfinite(output.training_loss)
    assert output.metrics["privacy_epsilon"] <= 5.0
    assert math.isfinite(trainer.evaluate()["eval_loss"])


def test_stop_at_epsilon_stops_at_the_last_step_within_the_budget(tmp_path):
    """A budget is a budget: the run ends at the last step whose epsilon is <= the target (dp-accounting directly)."""
    args = _args(tmp_path, max_steps=50, privacy_noise_multiplier=0.8, privacy_target_epsilon=3.0)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    output = trainer.train()
    assert trainer.state.privacy_target_epsilon_reached
    steps = output.global_step
    assert 1 < steps < 50
    delta = len(DATA) ** -1.1
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    step = dp_accounting.PoissonSampledDpEvent(8 / len(DATA), dp_accounting.GaussianDpEvent(0.8))
    accountant.compose(step, steps)
    assert output.metrics["privacy_epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-6)
    assert accountant.get_epsilon(delta) <= 3.0
    accountant.compose(step)
    assert accountant.get_epsilon(delta) > 3.0


def test_callbacks_and_logs(tmp_path):
    seen = []

    class Spy(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(("log", dict(logs)))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen.append(("evaluate", metrics))

        def on_save(self, args, state, control, **kwargs):
            seen.append(("save", state.global_step))

    args = _args(
        tmp_path,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        privacy_accounting=True,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
    )
    trainer = DPTrainer(
        tiny_model("llama"),
        args,
        train_dataset=DATA,
        eval_dataset=DATA[:8],
        callbacks=[Spy, EarlyStoppingCallback(early_stopping_patience=5)],
    )
    trainer.train()
    kinds = [kind for kind, _ in seen]
    assert kinds.count("evaluate") == 2 and ("save", 4) in seen
    step_logs = [logs for kind, logs in seen if kind == "log" and "loss" in logs]
    assert {
        "learning_rate",
        "privacy_epsilon",
        "privacy_delta",
        "privacy_clip_rate",
        "privacy_noise_multiplier",
    } <= set(step_logs[0])
    rows = [json.loads(line) for line in (tmp_path / "out/runs/log.jsonl").read_text().splitlines()]
    assert any("privacy_epsilon" in row for row in rows)
    assert trainer.state.best_model_checkpoint is not None


def test_a_callback_reads_each_iterate_and_the_plan_of_the_run_in_progress(tmp_path):
    """``trainable_params`` in ``on_step_begin`` is the iterate the step starts from: the first is the model's
    initial weights, and every weight moves between consecutive ones (the noise reaches all of them); after
    ``train()`` it is the trained weights, which the model holds too.
    ``privacy_plan`` is the run's plan during and after ``train()``, None before."""
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, optim="sgd"), train_dataset=DATA)
    initial = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    assert trainer.privacy_plan is None
    seen, plans = [], []

    class Reader(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            plans.append(trainer.privacy_plan)

        def on_step_begin(self, args, state, control, **kwargs):
            seen.append({k: v.detach().clone() for k, v in trainer.trainable_params.items()})

    trainer.add_callback(Reader())
    trainer.train()
    assert len(seen) == 4 and all(torch.equal(seen[0][k], initial[k]) for k in seen[0])
    assert all(not torch.equal(a[k], b[k]) for a, b in itertools.pairwise(seen) for k in a)
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(v, trained[k]) for k, v in trainer.trainable_params.items())
    assert plans == [trainer.privacy_plan] and trainer.privacy_plan.total_steps == 4


def test_rules(tmp_path):
    args = _args(tmp_path)
    model = tiny_model("llama")
    with pytest.raises(ConfigurationError, match="optimizers"):
        DPTrainer(model, args, train_dataset=DATA, optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    with pytest.raises(ConfigurationError, match="DataParallel"):
        DPTrainer(torch.nn.DataParallel(model), args, train_dataset=DATA)
    with pytest.raises(ConfigurationError, match="TrainingArguments"):
        DPTrainer(model, None, train_dataset=DATA)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigurationError, match="attn_implementation"):
        DPTrainer(model, args, train_dataset=DATA)


def test_weights_only_folder_is_refused_for_resume(tmp_path):
    trainer = DPTrainer(tiny_model("llama"), _args(tmp_path, max_steps=1), train_dataset=DATA)
    trainer.train()
    exported = trainer.save_model(str(tmp_path / "export"))
    assert not (exported / ckpt.DP_STATE).exists()
    with pytest.raises(CheckpointError, match="load them as the model"):
        DPTrainer(tiny_model("llama"), _args(tmp_path, max_steps=2), train_dataset=DATA).train(
            resume_from_checkpoint=str(exported)
        )


def test_changed_multiplier_is_detected_on_horizon_resume(tmp_path):
    kw = {
        "sampling_mode": "k_out_of_t",
        "sampling_kwargs": {"k": 1, "allocation": "block"},
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
    }
    first = DPTrainer(tiny_model("llama"), _args(tmp_path, **kw), train_dataset=DATA)
    first.add_callback(StopAt(2))
    first.train()
    second = DPTrainer(tiny_model("llama"), _args(tmp_path, privacy_noise_multiplier=2.0, **kw), train_dataset=DATA)
    with pytest.raises(CheckpointError, match="noise_multiplier"):
        second.train(resume_from_checkpoint=True)


def test_empty_poisson_batch_is_a_step(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=1, max_steps=3)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA[:2])
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 3
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    assert np.isfinite([p.detach().sum().item() for p in trainer.model.parameters()]).all()


@pytest.mark.parametrize(
    ("mechanism", "extra"),
    [
        ("mf_band", {"privacy_noise_mechanism_kwargs": {"bands": 2}}),
        ("mf_blt", {"privacy_noise_mechanism_kwargs": {"max_buffers": 2}}),
        ("mf_identity", {}),
    ],
)
def test_dp_ftrl_mechanisms_train_and_resume_exactly(tmp_path, mechanism, extra):
    """DP-FTRL runs through the trainer; the noise buffers travel in the checkpoint, so resume is bitwise."""
    kw = {"privacy_noise_mechanism": mechanism, "max_steps": 5, "save_strategy": "steps", "save_steps": 2, **extra}
    full = DPTrainer(tiny_model("llama"), _args(tmp_path / "a", **kw), train_dataset=DATA)
    output = full.train()
    assert math.isfinite(output.metrics["privacy_epsilon"])
    first = DPTrainer(tiny_model("llama"), _args(tmp_path / "b", **kw), train_dataset=DATA)
    first.add_callback(StopAt(2))
    first.train()
    resumed = DPTrainer(tiny_model("llama"), _args(tmp_path / "b", **kw), train_dataset=DATA)
    resumed_output = resumed.train(resume_from_checkpoint=True)
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert resumed_output.metrics["privacy_epsilon"] == output.metrics["privacy_epsilon"]


def test_dp_ftrl_epsilon_is_the_full_horizon_value_from_the_first_log(tmp_path):
    args = _args(
        tmp_path,
        privacy_noise_mechanism="mf_band",
        privacy_noise_mechanism_kwargs={"bands": 2},
        max_steps=4,
        logging_steps=1,
    )
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    trainer.train()
    epsilons = [row["privacy_epsilon"] for row in trainer.state.log_history if "loss" in row]
    assert len(epsilons) == 4 and len(set(epsilons)) == 1


@pytest.mark.parametrize("mode", ["auto", "adaptive"])
def test_clipping_modes(tmp_path, mode):
    args = _args(tmp_path, clipping_mode=mode, max_steps=3, logging_steps=1, privacy_accounting=True)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
    output = trainer.train()
    bounds = [row["privacy_clipping_norm"] for row in trainer.state.log_history if "loss" in row]
    if mode == "adaptive":
        assert len(set(bounds)) > 1  # the bound moves
        fixed = DPTrainer(
            tiny_model("llama"), _args(tmp_path / "f", max_steps=3, privacy_accounting=True), train_dataset=DATA
        ).train()
        assert output.metrics["privacy_epsilon"] > fixed.metrics["privacy_epsilon"]  # the count costs privacy
    else:
        assert set(bounds) == {1.0}


def test_oom_retry_halves_the_chunk_and_replays_the_same_step(tmp_path, monkeypatch):
    """An out-of-memory error in a chunk of more than 2 examples: the trainer reruns the same batch and state (keys
    included) with halved chunks; the result equals a run that used chunks of 2 from the start."""
    from opake_core.clipping import rules

    reference = DPTrainer(tiny_model("llama"), _args(tmp_path / "ref", microbatch_size=2), train_dataset=DATA)
    reference.train()
    original = rules.ClipRule.__call__

    def clip(self, grads, *args):
        if grads.squared_norms().shape[1] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(self, grads, *args)

    monkeypatch.setattr(rules.ClipRule, "__call__", clip)
    args = _args(tmp_path / "oom", microbatch_size=8, auto_find_microbatch_size=True)
    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA, eval_dataset=DATA[:6])
    trainer.train()
    assert any(row.get("converged_microbatch_size") == 2.0 for row in trainer.state.log_history)
    for (name, a), (_, b) in zip(reference.model.named_parameters(), trainer.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_eval_oom_retry_keeps_every_example(tmp_path, monkeypatch):
    trainer = DPTrainer(
        tiny_model("llama"),
        _args(tmp_path, auto_find_microbatch_size=True, microbatch_size=8),
        train_dataset=DATA,
        eval_dataset=DATA[:10],
    )
    expected = trainer.evaluate()["eval_loss"]
    forward = type(trainer.model).forward

    def guarded(self, *args, **kwargs):
        if kwargs["input_ids"].shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(trainer.model), "forward", guarded)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    plain = DPTrainer(tiny_model("llama"), _args(tmp_path / "p", max_steps=2), train_dataset=DATA)
    plain.train()
    checkpointed = DPTrainer(
        tiny_model("llama"), _args(tmp_path / "c", max_steps=2, gradient_checkpointing=True), train_dataset=DATA
    )
    checkpointed.train()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), checkpointed.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_cuda_graphs_need_a_cuda_device(tmp_path):
    with pytest.raises(ConfigurationError, match=r"cuda_graphs=2 captures CUDA graphs and needs a CUDA device.*=0"):
        DPTrainer(tiny_model("llama"), _args(tmp_path, cuda_graphs=2), train_dataset=DATA)


@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
def test_torch_compile_gives_the_same_update(tmp_path, engine, monkeypatch):
    """torch_compile (here the aot_eager backend: traced, no code generation) wraps each chunk, padded to the
    microbatch size; the chunk compiles (no eager-fallback warning) and after 3 Poisson steps the weights equal the
    eager run's. The compiled layerwise pass takes the ghost layers' norms from Gram matrices, so the eager run is
    held to that route too (its own choice, the product route with its rounding margin, is checked in
    tests/torch/layerwise/test_norm_route.py): the two runs then do the same arithmetic."""
    monkeypatch.setattr(ghost, "norm_route", lambda *args: "gram")
    runs = []
    for compiled in (False, True):
        args = _args(
            tmp_path / str(compiled),
            max_steps=3,
            microbatch_size=3,
            per_example_gradients=engine,
            torch_compile=compiled,
            torch_compile_backend="aot_eager" if compiled else None,
        )
        trainer = DPTrainer(tiny_model("llama"), args, train_dataset=DATA)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        assert not [w for w in caught if "running it eagerly" in str(w.message)]
        runs.append(dict(trainer.model.named_parameters()))
    for name, value in runs[0].items():
        torch.testing.assert_close(runs[1][name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_save_total_limit_and_save_only_model(tmp_path):
    args = _args(
        tmp_path, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2, privacy_accounting=True
    )
    DPTrainer(tiny_model("llama"), args, train_dataset=DATA).train()
    assert [p.name for p in ckpt.checkpoints(tmp_path / "out")] == ["checkpoint-3", "checkpoint-4"]
    only = _args(
        tmp_path / "m", max_steps=1, save_strategy="steps", save_steps=1, save_only_model=True, privacy_accounting=True
    )
    DPTrainer(tiny_model("llama"), only, train_dataset=DATA).train()
    folder = tmp_path / "m/out/checkpoint-1"
    assert (folder / ckpt.ACCOUNTANT).is_file() and (folder / "model.safetensors").is_file()
    assert not (folder / ckpt.DP_STATE).exists() and not (folder / ckpt.DP_OPTIMIZER).exists()
    with pytest.raises(CheckpointError, match="not a complete DP checkpoint"):
        ckpt.require_resumable(folder)
