"""DPTrainer with cuda_graphs on CUDA: the captured chunks replay the same private update as the eager run.

Poisson batches of varying size are chunked by ``microbatch_size`` (3) and each chunk rounded up with dead rows to a
multiple of ``ceil(3 / cuda_graphs)`` rows (2 or 3 rows with ``cuda_graphs=2``), and sequences padded to a fixed
multiple, so that the chunks meet at most ``cuda_graphs`` signatures: one capture each, every later chunk a replay.
Run: ``pytest -m cuda``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_hf import tiny_model, token_data

from opake_torch.transformers import DPTrainer, TrainingArguments, engines
from opake_torch.transformers.compile import compile_chunk

pytestmark = pytest.mark.cuda
DATA = token_data(40)


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _train(folder, attention: str = "sdpa", **kw) -> DPTrainer:
    args = TrainingArguments(
        str(folder),
        per_device_train_batch_size=8,
        max_steps=5,
        privacy_noise_multiplier=1.0,
        learning_rate=0.05,
        lr_scheduler="constant",
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        microbatch_size=3,
        pad_to_multiple_of=16,
        privacy_noise_seed=0,  # the same keys in every run: the runs compared differ only in how chunks launch
        **kw,
    )
    model = tiny_model("llama")
    model.config._attn_implementation = attention
    trainer = DPTrainer(model, args, train_dataset=DATA)
    trainer.train()
    return trainer


@pytest.mark.parametrize("clipping_mode", ["fixed", "adaptive"])
@pytest.mark.parametrize("engine", ["layerwise", "vmap"])
def test_cuda_graphs_replay_the_eager_update(tmp_path, engine, clipping_mode):
    eager = _train(tmp_path / "eager", per_example_gradients=engine, clipping_mode=clipping_mode)
    graphed = _train(tmp_path / "graphs", per_example_gradients=engine, clipping_mode=clipping_mode, cuda_graphs=2)
    graphs = graphed.chunk_graphs
    assert graphs.failure is None, graphs.failure
    assert 1 <= len(graphs.graphs) <= 2 and graphs.eager_calls == 0  # every chunk replays one of <= 2 captures
    assert graphs.replays >= 5  # >= one chunk per step
    bounds = [[row["privacy_clipping_norm"] for row in t.state.log_history if "loss" in row] for t in (eager, graphed)]
    assert bounds[0] == pytest.approx(bounds[1], rel=1e-6)
    for (name, a), (_, b) in zip(eager.model.named_parameters(), graphed.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_an_uncapturable_model_falls_back_to_the_eager_update(tmp_path):
    """Eager attention on padded batches: older transformers (5.17 among them) build the float mask from a host
    tensor, which a capture cannot copy. Either the capture works (newer transformers) or the trainer warns, runs
    that step's chunks eagerly and the later steps without captures; the update is the eager one either way."""
    eager = _train(tmp_path / "eager", attention="eager")
    graphed = _train(tmp_path / "graphs", attention="eager", cuda_graphs=2)
    graphs = graphed.chunk_graphs
    captured = graphs.failure is None and graphs.replays >= 5
    assert captured or (graphs.failure is not None and graphs.eager_calls >= 1 and not graphs.graphs)
    for (name, a), (_, b) in zip(eager.model.named_parameters(), graphed.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_a_compile_mode_with_cuda_graphs_replays_the_eager_update(tmp_path, monkeypatch):
    """``torch_compile_mode="reduce-overhead"``: inductor replays CUDA graphs whose outputs the next call overwrites,
    while a step of several chunks (a microbatch of 3) adds the earlier chunks' sums after the later ones ran. The
    update equals the eager one, and no chunk fell back to eager."""
    wrappers = []

    def spy(chunk, **kwargs):
        wrappers.append(compile_chunk(chunk, **kwargs))
        return wrappers[-1]

    monkeypatch.setattr(engines, "compile_chunk", spy)
    eager = _train(tmp_path / "eager")
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = _train(tmp_path / "compiled", torch_compile_mode="reduce-overhead")
    assert not [str(w.message) for w in caught if "eagerly" in str(w.message)]
    (run,) = wrappers
    assert not run.is_eager() and run.compiled_calls() >= 10  # five steps of several chunks each
    for (name, a), (_, b) in zip(eager.model.named_parameters(), graphed.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
