"""Compiled and graph-captured chunk functions: signatures, the eager fallback, the capture cap (faked on CPU)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from opake_core.errors import ConfigurationError
from opake_torch.transformers import compile as compile_mod
from opake_torch.transformers.compile import CudaGraphChunk, compile_chunk, signature


def test_signature_distinguishes_every_property() -> None:
    x = torch.zeros(2, 3)
    base = signature((x, 1))
    assert signature((torch.ones(2, 3), 1)) == base  # values do not matter
    assert signature((torch.zeros(3, 2), 1)) != base  # shape
    assert signature((torch.zeros(3, 2).t(), 1)) != base  # strides
    assert signature((x.double(), 1)) != base  # dtype
    assert signature((x.requires_grad_(True), 1)) != base  # requires_grad
    assert signature((torch.zeros(2, 3), 2)) != base  # non-tensor value
    assert signature((torch.zeros(2, 3),), {"k": 1}) != base  # structure
    assert signature((torch.zeros(2, 3, device="meta"), 1)) != base  # device


def test_signature_refuses_unhashable_arguments() -> None:
    with pytest.raises(ConfigurationError, match=r"tensor or hashable.*closure"):
        signature((torch.zeros(1), [object()], {"a": {1: set()}}))


def test_cuda_graphs_need_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigurationError, match=r"cuda_graphs=4 requires a CUDA device.*cuda_graphs=0"):
        CudaGraphChunk(lambda x: x, 4)
    with pytest.raises(ConfigurationError, match="max_graphs"):
        CudaGraphChunk(lambda x: x, 0)


def test_capture_cap_then_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    captured = []

    class FakeGraph:
        def __init__(self, fn, args, kwargs, pool, buffers):
            captured.append((signature(args, kwargs), pool))
            self.fn = fn
            self.graph = SimpleNamespace(pool=lambda: f"pool of capture {len(captured)}")

        def replay(self, args, kwargs):
            return ("replay", self.fn(*args, **kwargs))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compile_mod, "_Graph", FakeGraph)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    chunk = CudaGraphChunk(lambda x: x.sum(), 2)
    assert chunk(torch.ones(2))[0] == "replay"
    assert chunk(torch.ones(2))[0] == "replay"
    assert chunk(torch.ones(3))[0] == "replay"
    assert len(captured) == 2
    assert [pool for _, pool in captured] == [None, "pool of capture 1"]  # one pool for all captures
    assert chunk(torch.ones(4)) == 4  # third signature: eager, not captured
    assert chunk(torch.ones(2))[0] == "replay"
    assert len(captured) == 2 and chunk.eager_calls == 1


def test_compile_failure_falls_back_to_eager_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"compiled": 0}

    def broken_compile(fn, **kwargs):
        assert "dynamic" not in kwargs  # Dynamo's automatic dynamic shapes

        def compiled(*args, **kw):
            calls["compiled"] += 1
            raise RuntimeError("inductor: unsupported operator aten::foo\nmore")

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)

    def chunk(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    run = compile_chunk(chunk, backend="inductor", mode=None)
    with pytest.warns(RuntimeWarning, match="failed for 'chunk'.*aten::foo.*torch_compile=False") as record:
        assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(run(torch.ones(3)), torch.full((3,), 2.0))
    assert calls["compiled"] == 1 and run.is_eager()


def test_compile_propagates_the_functions_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def chunk(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    with pytest.raises(ValueError, match="bad input"):
        compile_chunk(chunk)(torch.ones(1))


@pytest.mark.parametrize(
    ("backend", "mode"),
    [("inductor", "reduce-overhead"), ("inductor", "max-autotune"), ("cudagraphs", None), ("inductor", None),
     ("inductor", "max-autotune-no-cudagraphs"), ("aot_eager", "reduce-overhead")],
)  # fmt: skip
def test_outputs_of_a_mode_with_cuda_graphs_survive_the_next_call(monkeypatch: pytest.MonkeyPatch, backend, mode):
    """A mode that replays CUDA graphs overwrites a call's outputs at the next call (faked: one static output
    buffer); the chunks of a step add up the earlier chunks' sums after the later ones ran, so the wrapper returns
    copies and marks each call a new iteration. Modes without graphs return the compiled outputs themselves."""
    static = torch.zeros(3)
    marks = []

    def graphed_compile(fn, **kwargs):
        def replay(x):
            static.copy_(fn(x))
            return static, {"norms": static[:2]}

        return replay

    monkeypatch.setattr(torch, "compile", graphed_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    run = compile_chunk(lambda x: x * 2, backend=backend, mode=mode)
    first, first_aux = run(torch.ones(3))
    run(torch.full((3,), 5.0))
    graphed = backend == "cudagraphs" or (backend == "inductor" and mode in ("reduce-overhead", "max-autotune"))
    assert compile_mod.uses_cuda_graphs(backend, mode) == graphed
    if graphed:
        assert torch.equal(first, torch.full((3,), 2.0)) and torch.equal(first_aux["norms"], torch.full((2,), 2.0))
        assert marks == [0, 1]
    else:  # the fake's buffer, overwritten: what a mode with graphs would return without the copies
        assert first is static and torch.equal(first, torch.full((3,), 10.0)) and not marks


def test_compile_eager_backend_matches() -> None:
    def chunk(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3

    x = torch.randn(5)
    run = compile_chunk(chunk, backend="eager")
    assert torch.equal(run(x), chunk(x)) and not run.is_eager()


def test_a_failed_capture_warns_once_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    class FailingGraph:
        def __init__(self, fn, args, kwargs, pool, buffers):
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture\nmore")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compile_mod, "_Graph", FailingGraph)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda")))
    chunk = CudaGraphChunk(lambda x: x.sum(), 2)
    with pytest.warns(RuntimeWarning, match=r"failed; running it eagerly from now on \(RuntimeError: Cannot copy"):
        assert chunk(torch.ones(2)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chunk(torch.ones(3)) == 3  # no second warning, no second attempt
    assert chunk.eager_calls == 2 and chunk.replays == 0 and not chunk.graphs
    assert chunk.failure.startswith("RuntimeError: Cannot copy") and "more" not in chunk.failure


def test_captures_share_static_buffers_of_one_layout() -> None:
    """The static inputs and outputs of the captures are shared by position and layout (shape, stride, dtype,
    device): a parameter of every signature has one buffer, refilled with the next call's values; a batch of
    another shape gets its own; an output of a later capture is copied into the earlier capture's buffer."""
    buffers = compile_mod._Buffers()
    params, batch = torch.arange(6.0).reshape(2, 3), torch.ones(4, 2)
    first = [buffers.static_input(0, params), buffers.static_input(1, batch)]
    assert first[0] is not params and torch.equal(first[0], params)  # a copy, not the caller's tensor
    later = [buffers.static_input(0, params + 1), buffers.static_input(1, torch.zeros(8, 2))]
    assert later[0] is first[0] and torch.equal(first[0], params + 1)  # one buffer, refilled
    assert later[1] is not first[1] and first[1].shape == (4, 2)  # another batch shape: its own
    assert buffers.static_input(2, params) is not first[0]  # another position: its own
    assert buffers.static_input(0, params.t()) is not first[0]  # another stride: its own
    sums, norms = torch.zeros(3), torch.zeros(4)
    assert buffers.static_outputs([sums, norms, "aux"]) == [sums, norms, "aux"]
    mine = [torch.full((3,), 7.0), torch.ones(8)]
    shared = buffers.static_outputs(mine)
    assert shared[0] is sums and torch.equal(sums, mine[0])  # copied into the first capture's buffer
    assert shared[1] is mine[1] and torch.equal(norms, torch.zeros(4))  # another shape: its own
