"""Worker launched by the FSDP2 tests: ``python -m torch.distributed.run --standalone --nproc_per_node W
fsdp_worker.py MODE OUT_DIR``, MODE ``<model>_<mechanism>_<optim>`` (``full`` or ``lora``; ``sgd`` or ``mf``).
Every rank writes ``OUT_DIR/rank<r>.pt`` with what the test compares."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import optree
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))

STEPS, PER_DEVICE = int(os.environ.get("FSDP_TEST_STEPS", "4")), 2


def trainer_args(out: Path, mechanism: str, optim: str, world: int = 1, **extra):
    extra = {"save_strategy": "no", **json.loads(os.environ.get("FSDP_TEST_ARGS", "{}")), **extra}
    from opake_torch.transformers import TrainingArguments

    if mechanism == "mf":
        extra.update(
            privacy_noise_mechanism="mf_band",
            privacy_noise_mechanism_kwargs={"bands": 2},
            sampling_mode="cyclic_poisson",
        )
    return TrainingArguments(
        str(out),
        per_device_train_batch_size=PER_DEVICE * world,
        max_steps=STEPS,
        privacy_noise_multiplier=float(os.environ.get("FSDP_TEST_NOISE", "1.0")),
        privacy_accounting=True,
        use_cpu=True,
        disable_tqdm=True,
        learning_rate=0.05,
        lr_scheduler="constant",
        optim=optim,
        logging_strategy="no",
        report_to="none",
        seed=42,
        privacy_noise_seed=42,
        per_example_gradients="layerwise",
        **extra,
    )


def model_of(kind: str) -> torch.nn.Module:
    from tiny_hf import tiny_lora, tiny_model

    return tiny_lora("llama") if kind == "lora" else tiny_model("llama")


def nbytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor))


def train(out: Path, kind: str, mechanism: str, optim: str) -> dict:
    from tiny_hf import token_data
    from transformers import TrainerCallback

    from opake_torch.transformers import DPTrainer

    held = {}

    class Measure(TrainerCallback):  # the bytes this rank holds for the run's parameters and optimizer state
        def on_step_end(self, args, state, control, **kwargs):
            run = trainer._live
            held.update(params=nbytes(run.params), opt_state=nbytes(run.opt_state), dp_state=nbytes(run.dp_state))

    args = trainer_args(out, mechanism, optim, fsdp=os.environ.get("FSDP_TEST_FSDP", "full_shard auto_wrap"))
    trainer = DPTrainer(model_of(kind), args, train_dataset=token_data(40), callbacks=[Measure()])
    output = trainer.train()
    whole = trainer.topology.full_state(trainer.model)
    whole = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()} if whole is None else whole
    trainer.save_model(str(out / "final"))  # the whole model (or adapter) and its card, from rank 0
    return {"params": whole, "epsilon": output.metrics["privacy_epsilon"], "bytes": held}


def checkpointed(out: Path, *, kill_at: int | None = None, resume: str | None = None, steps: int = STEPS) -> dict:
    """A full fine-tune with AdamW saving every 2 steps into ``out``; ``kill_at``: rank 1 dies at the start of that
    step; ``resume``: a checkpoint folder to continue. Returns the whole trained parameters and the
    run's state on this rank just after the resume (before any step)."""
    from tiny_hf import token_data
    from transformers import TrainerCallback

    from opake_torch.transformers import DPTrainer

    started = {}

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            run = trainer._live
            copy = lambda tree: optree.tree_map(torch.clone, tree)  # noqa: E731  (the run's steps write in place)
            started.update(params=copy(dict(run.params)), opt_state=copy(run.opt_state), step=state.global_step)

        def on_step_begin(self, args, state, control, **kwargs):
            if kill_at is not None and state.global_step + 1 == kill_at and dist.get_rank() == 1:
                os._exit(3)  # a rank lost mid-run: no exception, no cleanup

    args = trainer_args(out, "sgd", "adamw", fsdp="full_shard", save_strategy="steps", save_steps=2)
    args.max_steps = steps
    trainer = DPTrainer(model_of("full"), args, train_dataset=token_data(40), callbacks=[Watch()])
    output = trainer.train(resume_from_checkpoint=resume)
    layout = trainer.topology.layout
    return {
        "params": trainer.topology.full_state(trainer.model),
        "epsilon": output.metrics["privacy_epsilon"],
        "started": started,
        "ranges": dict(zip(sorted(started["params"]), layout.ranges, strict=True)),
    }


def sharded_check(out: Path, kind: str) -> dict:
    """The check before a run on the sharded model: the layerwise engine against grad of the step's loss, and
    against a loss that differs from the one the engine runs (1.5 times it), on the first two rows."""
    import numpy as np
    from tiny_hf import token_data

    from opake_core.errors import ConfigurationError
    from opake_torch.transformers import DPTrainer

    rows = token_data(40)
    trainer = DPTrainer(model_of(kind), trainer_args(out, "sgd", "sgd", fsdp="full_shard"), train_dataset=rows)
    batch = trainer.fetch_batch(rows, np.arange(2))
    check = trainer.topology.layerwise_check(trainer.model)
    loss = trainer._loss_fn()
    right = check(trainer._layerwise, None, loss, batch, rtol=1e-4)
    try:
        check(trainer._layerwise, None, lambda p, example: 1.5 * loss(p, example), batch, rtol=1e-4)
        wrong = None
    except ConfigurationError as exc:
        wrong = str(exc)
    return {"right": right, "wrong": wrong, "sharded": type(next(trainer.model.parameters())).__name__}


REDUCE_SHAPES = [(5, 3), (7,), (2, 2, 2), (1, 4), (), (9, 2)]


def reduce_leaves(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s full-size clipped sum for the reduce-scatter test (the last leaf in float64)."""
    gen = torch.Generator().manual_seed(rank)
    dtypes = [torch.float32] * (len(REDUCE_SHAPES) - 1) + [torch.float64]
    return [torch.randn(shape, generator=gen, dtype=dtype) for shape, dtype in zip(REDUCE_SHAPES, dtypes, strict=True)]


def sharded_reduce() -> dict:
    """The sharded step's reduce on leaves whose rows do not split evenly (short and empty ranks, a 0-d leaf)."""
    from opake_core import Shard
    from opake_core.tree import Clipped
    from opake_torch import sharded

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = Shard.rows(REDUCE_SHAPES, rank=rank, world_size=world)
    tree = dict(zip("abcdef", reduce_leaves(rank), strict=True))
    out = sharded.reduce_scatter(shard, world)(Clipped(tree, 1.0))
    return {"value": out.value, "sensitivity": out.sensitivity, "ranges": shard.ranges}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "reduce":
        result = sharded_reduce()
    elif mode.startswith("check_"):
        result = sharded_check(out / "run", mode.removeprefix("check_"))
    elif mode == "checkpointed":
        result = checkpointed(out / "run")
    elif mode == "killed":
        result = checkpointed(out / "run", kill_at=3)
    elif mode.startswith("resume:"):
        result = checkpointed(Path(os.environ["FSDP_TEST_RUN"]), resume=mode.split(":", 1)[1])
    else:
        kind, mechanism, optim = mode.split("_")
        result = train(out / "run", kind, mechanism, optim)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
