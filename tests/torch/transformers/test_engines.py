"""The trainer's engine: how many row counts (shapes) a Poisson draw can meet under each way of running a chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opake_core.clipping.microbatching import chunk_sizes
from opake_torch.transformers import engines


def _args(cuda_graphs: int = 0) -> SimpleNamespace:
    return SimpleNamespace(cuda_graphs=cuda_graphs, device=torch.device("cpu"), per_example_row_multiple=1)


@pytest.mark.parametrize("graphs", [1, 2, 3, 4, 32, 40])
def test_cuda_graphs_bound_the_row_counts_a_draw_meets(graphs):
    """With ``cuda_graphs=k`` every draw of 0..4 x the microbatch runs chunks of at most ``k`` distinct row counts,
    none above the microbatch; ``k=1`` pads every chunk to the microbatch."""
    microbatch = 32
    engine = engines.engine(_args(graphs), None, transform=lambda chunk: chunk, microbatch=microbatch)
    shapes = {
        rows
        for n in range(4 * microbatch + 1)
        for _, rows in chunk_sizes(n, microbatch, row_multiple=engine.row_multiple)
    }
    assert len(shapes) <= graphs and max(shapes) == microbatch
    if graphs == 1:
        assert shapes == {microbatch}


def test_compiled_chunks_are_padded_to_the_microbatch_and_eager_ones_are_not():
    compiled = engines.engine(_args(), None, transform=lambda chunk: chunk, microbatch=16)
    eager = engines.engine(_args(), None, transform=None, microbatch=16)
    assert compiled.row_multiple == 16
    assert eager.row_multiple == 1  # per_example_row_multiple=1: the real rows only
    # the step a failed capture hands over to: no transform, so no dead rows whatever cuda_graphs says
    assert engines.engine(_args(4), None, transform=None, microbatch=16).row_multiple == 1


def test_the_compute_arguments_reach_the_engine():
    """``per_example_row_multiple`` rounds the rows of chunks run without a transform, whichever engine runs them, and
    ``layerwise_ghost_advantage`` is the layerwise engine's weight on the size of the Gram factors; under
    ``privacy_unit="user"`` the layerwise engine takes grouped examples (a user's rows)."""
    args = SimpleNamespace(
        cuda_graphs=0, device=torch.device("cpu"), bf16=False, per_example_gradients="auto",
        per_example_row_multiple=4, layerwise_ghost_advantage=1.5, privacy_unit="record",
    )  # fmt: skip
    model = torch.nn.Linear(3, 2)
    layerwise = engines.layerwise_engine(model, dict(model.named_parameters()), args, lambda p, b: b, reasons=[])
    assert layerwise.ghost_advantage == 1.5 and not layerwise.grouped
    users = SimpleNamespace(**{**vars(args), "privacy_unit": "user"})
    assert engines.layerwise_engine(model, dict(model.named_parameters()), users, lambda p, b: b, reasons=[]).grouped
    assert engines.engine(args, layerwise, None, microbatch=16).row_multiple == 4
    assert engines.engine(args, None, None, microbatch=16).row_multiple == 4


_SEEN: list[int | str] = []  # the rows of each chunk the capture wrapper got, and "|" at each step's end


class _FailingCapture:
    """Stands in for ``CudaGraphChunk`` on CPU: every capture fails, and the chunk runs eagerly on the rows it got."""

    def __init__(self, fn, max_graphs: int) -> None:
        self.fn, self.failure, self.graphs, self.eager_calls = fn, None, {}, 0

    def __call__(self, rule, bounds, live, *args):
        self.failure, self.eager_calls = "RuntimeError: no capture", self.eager_calls + 1
        _SEEN.append(live.shape[0])
        return self.fn(rule, bounds, live, *args)


def _train(folder, monkeypatch, *, cuda_graphs: int = 0):
    """DPTrainer on CPU; ``cuda_graphs`` is set after construction, which refuses it without CUDA."""
    from tiny_hf import tiny_model, token_data
    from transformers import TrainerCallback

    from opake_torch.transformers import DPTrainer, TrainingArguments

    monkeypatch.setattr(engines, "CudaGraphChunk", _FailingCapture)
    args = TrainingArguments(
        str(folder), per_device_train_batch_size=8, max_steps=4, privacy_noise_multiplier=1.0, learning_rate=0.05,
        microbatch_size=3, logging_steps=4, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=True, privacy_noise_seed=0,
    )  # fmt: skip

    class StepEnds(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            _SEEN.append("|")

    trainer = DPTrainer(tiny_model("llama"), args, train_dataset=token_data(40), callbacks=[StepEnds()])
    trainer.args.cuda_graphs = cuda_graphs
    trainer.train()
    return trainer


def test_a_failed_capture_hands_over_to_the_step_without_dead_rows(tmp_path, monkeypatch):
    """After the first step's capture fails, the later steps run without captures and their dead rows: only the
    first step's chunks (rounded up to 2 or 3 rows) reach the capture wrapper, and the model equals the run without
    ``cuda_graphs`` (same keys; dead rows add nothing)."""
    _SEEN.clear()
    graphed = _train(tmp_path / "graphs", monkeypatch, cuda_graphs=2)
    steps = "".join(str(r) for r in _SEEN).split("|")[:-1]  # the rows of each step's chunks
    assert len(steps) == 4 and steps[0] and not any(steps[1:]), steps
    assert set(steps[0]) <= {"2", "3"} and graphed.chunk_graphs.eager_calls == len(steps[0])
    _SEEN.clear()
    plain = _train(tmp_path / "plain", monkeypatch)
    assert _SEEN == ["|"] * 4  # without cuda_graphs no chunk meets the wrapper
    for (name, a), (_, b) in zip(plain.model.named_parameters(), graphed.model.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
