"""DPTrainer on FSDP2 under torchrun (2 and 4 Gloo processes) against one process that sees the union of the ranks'
batches: the same parameters (the sharded noise is the one-process noise, coordinate by coordinate), the same
epsilon, and each rank holding about ``1/W`` of the parameters and optimizer state."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import optree
import pytest
import torch
from safetensors.torch import load_file
from tiny_hf import tiny_model, token_data
from transformers import LlamaForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).parent))

from _launch import launch
from fsdp_worker import model_of, nbytes, reduce_leaves, trainer_args

from opake_core import sampling
from opake_core.sampling.state import SamplerState
from opake_torch.transformers import DPTrainer
from opake_torch.transformers.checkpoint_folder import latest_checkpoint
from opake_torch.transformers.run_state import ledger_result

WORKER = Path(__file__).with_name("fsdp_worker.py")
DATA = token_data(40)


def _union_samplers(monkeypatch, world: int) -> None:
    """One process draws, at every step, the union of the ``world`` ranks' draws (the same keys)."""

    def poisson(self, key, state):
        ranks = sampling.poisson(dataset_size=self.dataset_size, sample_rate=self.sample_rate, world_size=world)
        parts = [ranks.sample_rank(key, SamplerState(state.step, ranks.config), r)[0] for r in range(world)]
        return np.sort(np.concatenate(parts)), SamplerState(state.step + 1, state.config)

    own = sampling.CyclicPoisson.sample

    def cyclic(self, key, state):
        parts = []
        for r in range(world):
            rank = sampling.cyclic_poisson(
                dataset_size=self.dataset_size, sample_rate=self.sample_rate, bands=self.bands, world_size=world, rank=r
            )
            parts.append(own(rank, key, SamplerState(state.step, rank.config))[0])
        return np.sort(np.concatenate(parts)), SamplerState(state.step + 1, state.config)

    monkeypatch.setattr(sampling.Poisson, "sample", poisson)
    monkeypatch.setattr(sampling.CyclicPoisson, "sample", cyclic)


def _single_process(tmp_path, monkeypatch, kind, mechanism, optim, world):
    _union_samplers(monkeypatch, world)
    held = {}

    class Measure(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            run = trainer._live
            held.update(params=nbytes(run.params), opt_state=nbytes(run.opt_state), dp_state=nbytes(run.dp_state))

    args = trainer_args(tmp_path / "single", mechanism, optim, world)
    trainer = DPTrainer(model_of(kind), args, train_dataset=DATA, callbacks=[Measure()])
    output = trainer.train()
    params = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    return params, output.metrics["privacy_epsilon"], held


@pytest.mark.parametrize(
    ("kind", "mechanism", "optim", "world", "extra"),
    [
        ("full", "sgd", "adamw", 2, {}),
        ("full", "mf", "sgd", 2, {}),
        ("lora", "sgd", "adamw", 2, {}),
        ("lora", "mf", "adamw", 4, {}),
        ("full", "sgd", "adamw", 4, {}),
        ("full", "sgd", "adamw", 2, {"gradient_checkpointing": True, "microbatch_size": 1}),
    ],
)
def test_fsdp_trainer_equals_one_process_on_the_union_batch(
    tmp_path, monkeypatch, kind, mechanism, optim, world, extra
):
    """The last case recomputes each layer in the backward and runs one example per pass, so the ranks' pass counts
    differ at most steps (the idle passes of the lockstep)."""
    monkeypatch.setenv("FSDP_TEST_ARGS", json.dumps(extra))
    ranks = launch(f"{kind}_{mechanism}_{optim}", tmp_path / "fsdp", 300, worker=WORKER, ranks=world)
    expected, epsilon, whole = _single_process(tmp_path, monkeypatch, kind, mechanism, optim, world)
    for name, value in expected.items():
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=1e-6, msg=name)
    assert all(rank["epsilon"] == epsilon for rank in ranks)
    _check_saved_model(tmp_path / "fsdp" / "run" / "final", kind, ranks[0]["params"], epsilon)
    # each rank holds its rows only: the parameters, the optimizer state (AdamW's moments) and the MF noise buffers
    # are split between the ranks, each holding at most 1/W of them plus the rounding of uneven rows (5% here)
    for part in ("params", "opt_state", "dp_state"):
        if whole[part] < 1024:  # SGD's step counter, the Gaussian noise state: nothing of the model's size
            continue
        assert sum(rank["bytes"][part] for rank in ranks) <= whole[part] + 64 * world, part  # + step counters
        assert max(rank["bytes"][part] for rank in ranks) <= 1.05 * whole[part] / world, part


def _check_saved_model(folder: Path, kind: str, params: dict, epsilon: float) -> None:
    """``save_model`` under FSDP2 wrote, from rank 0, a model that Hugging Face loads in one process with the trained
    weights (a PEFT adapter for LoRA), its card and its accountant record."""
    if kind == "lora":
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(tiny_model("llama"), str(folder))
    else:
        loaded = LlamaForCausalLM.from_pretrained(str(folder))
    for name, value in loaded.state_dict().items():
        name = name.replace(".default.", ".") if kind == "lora" else name
        key = next(k for k in params if k.replace(".default.", ".") == name)
        assert torch.equal(value, params[key]), name
    assert json.loads((folder / "accountant.json").read_text())["epsilon"] == epsilon
    assert "differential privacy" in (folder / "README.md").read_text().lower()


def _whole(ranks: list[dict], key: str) -> dict:
    """The whole tensors of ``started[key]`` from every rank's rows: each parameter's rows (and the optimizer
    moments of it) put together in rank order; other leaves from rank 0."""
    names = set(ranks[0]["ranges"])
    leaves = [optree.tree_flatten_with_path(rank["started"][key]) for rank in ranks]
    out = {}
    for i, (path, value) in enumerate(zip(leaves[0][0], leaves[0][1], strict=True)):
        owner = next((p for p in reversed(path) if p in names), None)
        parts = [rank_leaves[1][i].reshape(-1) for rank_leaves in leaves] if owner is not None else [value]
        out[path] = torch.cat(parts) if owner is not None else value
    return out


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The uninterrupted 2-rank run that saves every 2 steps, launched once for the tests that read it (none writes
    into its folder): the folder and what each rank wrote."""
    out = tmp_path_factory.mktemp("checkpointed")
    return out, launch("checkpointed", out, 300, worker=WORKER)


def test_fsdp_save_kill_resume_is_bit_exact(tmp_path, checkpointed):
    """Rank 1 dies at the start of step 3, after checkpoint-2: torchrun ends the job within seconds, checkpoint-2 is
    complete, and the resumed run ends bit for bit where the uninterrupted one does."""
    whole = checkpointed[1]
    begin = time.monotonic()
    killed = launch("killed", tmp_path / "killed", 300, worker=WORKER, check=False)
    assert killed.returncode != 0 and time.monotonic() - begin < 120
    run = tmp_path / "killed" / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    latest = latest_checkpoint(run)  # named, so that a relaunch after a teardown abort resumes the same one
    resumed = launch(f"resume:{latest}", tmp_path / "resumed", 300, worker=WORKER, FSDP_TEST_RUN=str(run))
    assert resumed[0]["started"]["step"] == 2
    for name, value in whole[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], value), name
    assert resumed[0]["epsilon"] == whole[0]["epsilon"]


def test_fsdp_checkpoint_loads_on_other_world_sizes(tmp_path, checkpointed):
    """A 2-rank checkpoint read by 4 ranks and by one process: the same parameters (those of its model.safetensors,
    gathered by torch) and the same optimizer state as the 2 ranks' own resume, each rank holding its rows."""
    folder = checkpointed[0] / "run" / "checkpoint-2"
    same = launch(f"resume:{folder}", tmp_path / "same", 300, worker=WORKER, FSDP_TEST_RUN=str(tmp_path / "a"))
    four = launch(f"resume:{folder}", tmp_path / "four", 300, worker=WORKER, ranks=4, FSDP_TEST_RUN=str(tmp_path / "b"))
    saved = load_file(folder / "model.safetensors")
    for ranks in (same, four):
        assert ranks[0]["started"]["step"] == 2
        params = _whole(ranks, "params")
        for (name,), value in params.items():
            assert torch.equal(value, saved[name].reshape(-1)), name
    reference = _whole(same, "opt_state")
    resharded = _whole(four, "opt_state")
    assert reference.keys() == resharded.keys()
    for path, value in reference.items():
        assert torch.equal(resharded[path], value), path

    args = trainer_args(tmp_path / "one", "sgd", "adamw", 2, save_strategy="no")
    args.max_steps = 3
    started = {}

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            copy = lambda tree: optree.tree_map(torch.clone, tree)  # noqa: E731  (the run's steps write in place)
            started.update(params=copy(dict(trainer._live.params)), opt_state=copy(trainer._live.opt_state))

    trainer = DPTrainer(model_of("full"), args, train_dataset=DATA, callbacks=[Watch()])
    output = trainer.train(resume_from_checkpoint=str(folder))
    for name, value in started["params"].items():
        assert torch.equal(value, saved[name]), name
    paths, leaves, _ = optree.tree_flatten_with_path(started["opt_state"])
    for path, value in zip(paths, leaves, strict=True):
        assert torch.equal(value.reshape(-1) if value.dim() else value, reference[path]), path
    # a new segment (other ranks, other batches: new keys) whose step is charged after the two saved ones
    assert trainer.state.global_step == 3 and trainer.ledger.releases == 3
    assert output.metrics["privacy_epsilon"] == ledger_result(trainer.ledger, trainer.privacy_plan.delta).value


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_check_before_a_run_compares_on_the_sharded_model(tmp_path, kind):
    """The model is sharded when the trainer is built (it never has to fit one device); the engine is then compared
    with autograd through the FSDP module, each rank its rows: equal within float rounding for the step's loss, and
    refused on every rank for another loss (the reference 1.5 times the engine's gradient)."""
    ranks = launch(f"check_{kind}", tmp_path, 300, worker=WORKER)
    for rank in ranks:
        assert rank["sharded"] == "DTensor"
        assert rank["right"] < 1e-5
        assert rank["wrong"] is not None and "differ from grad of the per-example loss" in rank["wrong"]
    assert ranks[0]["right"] == ranks[1]["right"]  # summed over ranks: one verdict


@pytest.mark.parametrize("world", [3, 4])
def test_the_reduce_scatter_gives_each_rank_the_sum_of_its_rows(tmp_path, world):
    """Uneven rows (5 over 3 or 4 ranks: short and empty ranks), a 0-d leaf and two dtypes: each rank receives
    exactly its rows of the ranks' summed clipped sums, in float64 where the leaf is."""
    ranks = launch("reduce", tmp_path, 120, worker=WORKER, ranks=world)
    total = [sum(parts) for parts in zip(*(reduce_leaves(r) for r in range(world)), strict=True)]
    for rank in ranks:
        for leaf, expected, (start, stop) in zip(rank["value"].values(), total, rank["ranges"], strict=True):
            assert leaf.dtype == expected.dtype
            torch.testing.assert_close(leaf.reshape(-1), expected.reshape(-1)[start:stop], rtol=1e-6, atol=1e-6)
        assert rank["sensitivity"] == 1.0
    assert sum(leaf.numel() for rank in ranks for leaf in rank["value"].values()) == sum(t.numel() for t in total)
