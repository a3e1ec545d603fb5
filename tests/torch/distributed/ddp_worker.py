"""Worker launched by the DDP tests: ``python -m torch.distributed.run --standalone --nproc_per_node 2 ddp_worker.py
MODE OUT_DIR``. Every rank writes ``OUT_DIR/rank<r>.pt`` with what the test compares."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))

from opake_core import mf, optim, random, sampling
from opake_core.errors import ConfigurationError
from opake_core.step import dp_ftrl, dp_sgd
from opake_torch import distributed

N, DIM, OUT, STEPS, RATE = 20, 4, 3, 5, 0.3


def core_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(N, DIM, generator=gen), torch.randn(N, OUT, generator=gen)


def core_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return {"w": torch.randn(DIM, OUT, generator=gen), "b": torch.zeros(OUT)}


def core_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x @ params["w"] + params["b"] - y) ** 2).sum()


def core_sampler(kind: str, world: int, rank: int):
    if kind == "mf":
        return sampling.cyclic_poisson(dataset_size=N, sample_rate=RATE, bands=2, world_size=world, rank=rank)
    return sampling.poisson(dataset_size=N, sample_rate=RATE, world_size=world, rank=rank)


def core_step(kind: str, params: dict[str, torch.Tensor], reduce):
    opt = optim.sgd(0.1)
    common = {
        "optimizer": opt,
        "clipping_norm": 1.0,
        "noise_multiplier": 1.0,
        "expected_batch_size": N * RATE,
        "key": random.key(8),
        "reduce": reduce,
    }
    if kind == "mf":
        step_fn, dp_state = dp_ftrl(core_loss, params=params, strategy=mf.band_mf(bands=2), n_steps=STEPS, **common)
    else:
        step_fn, dp_state = dp_sgd(core_loss, **common)
    return step_fn, dp_state, opt.init(params)


def run_core(kind: str, empty_rank: int | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = core_data()
    params = core_params()
    step_fn, dp_state, opt_state = core_step(kind, params, distributed.sum_gradients)
    sampler = core_sampler(kind, world, rank)
    state, key = sampler.init(), random.key(7)
    sizes = []
    for _ in range(STEPS):
        idx, state = sampler.sample(key, state)
        if rank == empty_rank:
            idx = idx[:0]
        sizes.append(len(idx))
        params, opt_state, dp_state, _ = step_fn(params, opt_state, dp_state, (x[idx], y[idx]))
    distributed.check_params_synchronized(params)
    return {"params": params, "sizes": sizes}


def run_mismatch() -> dict:
    rank = dist.get_rank()
    key = random.key(rank)
    try:
        distributed.check_synchronized(noise_key=key, step=3)
    except ConfigurationError as error:
        return {"error": str(error), "key_hex": key.hex}
    return {"error": None, "key_hex": key.hex}


def _trainer_args(out: Path, kind: str, save_steps: int):
    from opake_torch.transformers import TrainingArguments

    extra = {"clipping_mode": "adaptive"} if kind == "adaptive" else {}
    if kind == "moe":
        extra = {"router_aux_loss_coef": 0.1, "router_aux_kwargs": {"max_tokens": 6, "mean_tokens": 5.0}}
    if kind == "fixed":
        extra = {"sampling_mode": "fixed_size"}
    if kind == "global":
        extra = {"ddp_shard": "global"}
    if kind == "mf":
        extra = {
            "privacy_noise_mechanism": "mf_band",
            "privacy_noise_mechanism_kwargs": {"bands": 2},
            "sampling_mode": "cyclic_poisson",
        }
    return TrainingArguments(
        str(out),
        per_device_train_batch_size=int(os.environ.get("DDP_TEST_BATCH", "2")),
        max_steps=STEPS,
        privacy_noise_multiplier=1.0,
        privacy_accounting=True,
        use_cpu=True,
        disable_tqdm=True,
        learning_rate=0.05,
        lr_scheduler="constant",
        optim="sgd",
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        report_to="none",
        seed=int(os.environ.get("DDP_TEST_SEED", "42")),
        privacy_noise_seed=int(os.environ.get("DDP_TEST_SEED", "42")),
        **extra,
    )


def _train(out: Path, kind: str, save_steps: int = STEPS, stop: int | None = None, resume: bool = False) -> dict:
    from tiny_hf import tiny_model, tiny_moe, token_data
    from transformers import TrainerCallback

    from opake_torch.transformers import DPTrainer

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= stop:
                control.should_training_stop = True

    model = tiny_moe("qwen3_moe") if kind == "moe" else tiny_model("llama")
    trainer = DPTrainer(model, _trainer_args(out, kind, save_steps), train_dataset=token_data(40))
    if stop is not None:
        trainer.add_callback(StopAt())
    output = trainer.train(resume_from_checkpoint=resume or None)
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    router = trainer._router_state  # the released (noised, public) router load estimate, or None
    load = None if router is None else (router.filtered.clone(), router.step, router.noise_var)
    return {"params": params, "epsilon": output.metrics["privacy_epsilon"], "router": load}


def run_trainer(kind: str, out: Path) -> dict:
    from opake_torch.transformers import checkpoint_folder as ckpt

    writes = []
    original = ckpt.write_atomically

    def traced(folder, write):
        writes.append(str(folder))
        return original(folder, write)

    ckpt.write_atomically = traced
    return {**_train(out / "run", kind), "writes": writes}


def run_resume(out: Path) -> dict:
    full = _train(out / "full", "sgd")
    _train(out / "resumed", "sgd", save_steps=3, stop=3)
    resumed = _train(out / "resumed", "sgd", save_steps=3, resume=True)
    return {"full": full["params"], "resumed": resumed["params"], "epsilons": (full["epsilon"], resumed["epsilon"])}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "resume":
        result = run_resume(out)
    elif mode.startswith("trainer"):
        result = run_trainer(mode.split("_")[1], out)  # DPTrainer initializes the process group itself
    else:
        dist.init_process_group("gloo")
        if mode == "mismatch":
            result = run_mismatch()
        else:
            kind, empty, _ = mode.partition("_empty")
            result = run_core(kind, 1 if empty else None)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
