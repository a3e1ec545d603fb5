"""Compiled and graph-captured chunk functions.

A *chunk function* takes tensors (and hashable non-tensor arguments) and returns tensors: in the trainer it is the
per-chunk ``vmap(grad) -> clip -> sum`` kernel. Neither wrapper changes the maths; they change how it is launched.

* :func:`compile_chunk`: ``torch.compile``, shapes specialized at the first call and a dimension that changes later
  (the padded sequence length) compiled once more as a symbol. A compilation failure (an unsupported operation, a
  backend error, more recompilations than Dynamo allows) warns once and the function runs eagerly from then on,
  instead of failing the run.
* :class:`CudaGraphChunk`: one CUDA graph per input *signature* (shapes, strides, dtypes, devices,
  ``requires_grad`` of every tensor, and the non-tensor arguments), at most ``max_graphs`` of them; later calls with
  a captured signature copy their inputs into the graph's static buffers and replay it. Signatures seen after the
  cap run eagerly. Sequence lengths vary per batch, so bound them with ``pad_to_multiple_of`` and ``max_length``
  (docs/memory.md): every distinct padded length is a signature.

Outputs of a replayed graph live in the graph's static buffers and are overwritten by its next replay: the wrapper
returns clones, so callers may keep them.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from opake_core.errors import ConfigurationError

logger = logging.getLogger(__name__)

__all__ = ["CudaGraphChunk", "EagerAfterFailedCapture", "compile_chunk", "signature"]


def compile_chunk(
    fn: Callable[..., Any],
    *,
    backend: str = "inductor",
    mode: str | None = None,
    around: Callable[[tuple[Any, ...]], contextlib.AbstractContextManager[Any]] | None = None,
) -> Callable[..., Any]:
    """``torch.compile(fn, backend=backend, mode=mode)`` with an eager fallback; every call ``fn(*args)``, compiled or
    eager, runs inside ``around(args)`` when given (what the traced code cannot do itself, such as registering
    hooks).

    Shapes: Dynamo's automatic dynamic shapes. The first call compiles for its shapes; a dimension that changes at a
    later call (the sequence length of padded batches; the rows of a chunk are padded to one count) is compiled once
    more as a symbol, and later values reuse that graph unless the traced code specializes on it. Dynamo's settings
    during each call: ``trace_autograd_ops`` (a ``torch.autograd.grad`` in ``fn`` is traced into the graph, as
    :class:`~opake_torch.layerwise.compiled.CompiledLayerwise` needs) and ``fail_on_recompile_limit_hit`` (past
    ``torch._dynamo.config.recompile_limit`` recompilations Dynamo would run ``fn`` eagerly without a word; here that
    is a failure).

    A backend or mode that replays CUDA graphs (:func:`uses_cuda_graphs`) keeps a call's outputs in their memory pool
    and overwrites them at the next call (a new iteration begins at each call of the compiled function): the
    chunks of one step would read freed sums. Each call then marks a new iteration and returns copies of the
    outputs, as :class:`CudaGraphChunk` does.

    The first call logs (``INFO``) that it compiles, and how long it took: a large model's first step waits minutes
    for its compilation. The first call that fails to compile (any exception raised while compiling or running the
    compiled function) emits one ``RuntimeWarning`` naming the error, reruns that call eagerly, and every later call
    is eager. An error that the eager function also raises is the function's own and propagates. The returned
    function has ``is_eager()`` (whether it fell back) and ``compiled_calls()`` (the calls the compiled function
    served).
    """
    compiled = torch.compile(fn, backend=backend, mode=mode)
    graphed = uses_cuda_graphs(backend, mode)
    state = {"eager": False, "compiled_calls": 0}
    context = around if around is not None else lambda args: contextlib.nullcontext()

    def run(*args: Any, **kwargs: Any) -> Any:
        if state["eager"]:
            with context(args):
                return fn(*args, **kwargs)
        first = not state["compiled_calls"]
        if first:
            logger.info("compiling %r with torch.compile(backend=%r, mode=%r): the first call waits for it (minutes "
                        "for a large model)", getattr(fn, "__name__", fn), backend, mode)  # fmt: skip
            start = time.perf_counter()
        try:
            with context(args), torch._dynamo.config.patch(trace_autograd_ops=True, fail_on_recompile_limit_hit=True):
                if graphed:
                    torch.compiler.cudagraph_mark_step_begin()
                result = compiled(*args, **kwargs)
                if graphed:  # the outputs live in the graphs' pool, overwritten by the next call: copies
                    result = _copies(result)
        except Exception as exc:
            with context(args):
                result = fn(*args, **kwargs)  # raises the function's own errors
            state["eager"] = True
            logger.debug("torch.compile failed for %r; the traceback:", fn, exc_info=exc)
            warnings.warn(
                f"torch.compile(backend={backend!r}, mode={mode!r}) failed for {getattr(fn, '__name__', fn)!r}; "
                f"running it eagerly from now on ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). "
                "Set torch_compile=False to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
            return result
        if first:
            logger.info(
                "the first compiled call of %r took %.1f s", getattr(fn, "__name__", fn), time.perf_counter() - start
            )
        state["compiled_calls"] += 1
        return result

    run.is_eager = lambda: state["eager"]  # type: ignore[attr-defined]
    run.compiled_calls = lambda: state["compiled_calls"]  # type: ignore[attr-defined]
    return run


def uses_cuda_graphs(backend: str, mode: str | None) -> bool:
    """Whether ``torch.compile(backend=backend, mode=mode)`` replays CUDA graphs through torch's CUDA-graph trees:
    inductor's ``reduce-overhead`` and ``max-autotune``, and Dynamo's ``cudagraphs`` backend."""
    from torch._inductor import list_mode_options

    return backend == "cudagraphs" or (backend == "inductor" and bool(list_mode_options(mode).get("triton.cudagraphs")))


def _copies(tree: Any) -> Any:
    """``tree`` with each tensor cloned: outputs that a replayed CUDA graph would overwrite, made the caller's."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def signature(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Hashable:
    """The key under which a call is captured: the tree structure, and per leaf either the tensor's
    ``(shape, stride, dtype, device, requires_grad)`` or the value itself (non-tensors must be hashable)."""
    leaves, spec = pytree.tree_flatten((args, kwargs or {}))
    keys: list[Hashable] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            keys.append(("T", tuple(leaf.shape), leaf.stride(), leaf.dtype, str(leaf.device), leaf.requires_grad))
        else:
            try:
                hash(leaf)
            except TypeError as exc:
                raise ConfigurationError(
                    f"a CUDA-graph chunk argument must be a tensor or hashable, got {type(leaf).__name__}; pass it "
                    "through a closure instead."
                ) from exc
            keys.append(("V", type(leaf).__name__, leaf))
    return (str(spec), tuple(keys))


class _Buffers:
    """Static tensors shared by the captures of one :class:`CudaGraphChunk`, keyed by the leaf's position and layout
    (shape, stride, dtype, device, ``requires_grad``). Safe because the graphs replay one after the other on one
    stream: each replay first copies its inputs into the shared input buffers, and its outputs are cloned right after
    it. The trainable parameters and the clipped sums have the same layout in every signature (only the batch
    changes), so ``k`` captures hold one copy of each instead of ``k``."""

    def __init__(self) -> None:
        self.inputs: dict[Hashable, torch.Tensor] = {}
        self.outputs: dict[Hashable, torch.Tensor] = {}

    @staticmethod
    def key(position: int, x: torch.Tensor) -> Hashable:
        return (position, tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)

    def static_input(self, position: int, x: torch.Tensor) -> torch.Tensor:
        """A static buffer holding ``x`` (a copy: the caller's tensor is not captured)."""
        buffer = self.inputs.get(key := self.key(position, x))
        if buffer is None:
            buffer = self.inputs[key] = x.clone()
        else:
            buffer.copy_(x)
        return buffer

    def static_outputs(self, leaves: list[Any]) -> list[Any]:
        """Inside a capture: where each output tensor lives after the replay, an earlier capture's buffer of the same
        layout (the output copied into it, one multi-tensor copy, and freed with the capture's other intermediates),
        or the output itself."""
        shared = [self.outputs.setdefault(self.key(i, x), x) if isinstance(x, torch.Tensor) else x
                  for i, x in enumerate(leaves)]  # fmt: skip
        copies = [(b, x) for b, x in zip(shared, leaves, strict=True) if isinstance(x, torch.Tensor) and b is not x]
        if copies:
            torch._foreach_copy_([b for b, _ in copies], [x for _, x in copies])
        return shared


class _Graph:
    """One capture of ``fn`` on static copies of its inputs (``buffers``, shared with the other captures); ``pool`` is
    a memory pool shared with earlier captures (safe: graphs replay one after the other on one stream, and their
    outputs are cloned at once)."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any, buffers: _Buffers
    ) -> None:
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.static = [buffers.static_input(i, x) if isinstance(x, torch.Tensor) else x for i, x in enumerate(leaves)]
        static_args, static_kwargs = pytree.tree_unflatten(self.static, self.spec)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs recommends
            for _ in range(2):
                fn(*static_args, **static_kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            outputs, spec = pytree.tree_flatten(fn(*static_args, **static_kwargs))
            self.output = pytree.tree_unflatten(buffers.static_outputs(outputs), spec)

    def replay(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves, _ = pytree.tree_flatten((args, kwargs))
        pairs = [(b, x) for b, x in zip(self.static, leaves, strict=True) if isinstance(b, torch.Tensor)]
        if pairs:
            torch._foreach_copy_([b for b, _ in pairs], [x for _, x in pairs])  # one multi-tensor copy
        self.graph.replay()
        return _copies(self.output)


class CudaGraphChunk:
    """Capture ``fn`` as one CUDA graph per input signature (at most ``max_graphs``), replay afterwards.

    Args:
        fn: the chunk function; it must be capturable (no host synchronization such as ``.item()``, no CPU
            tensors, no RNG state reads: see
            :func:`~opake_torch.patches.activation_checkpointing.check_memory_knobs`).
        max_graphs: the number of signatures to capture (``TrainingArguments.cuda_graphs``); later new signatures
            run eagerly.

    A capture that fails (an operation that cannot be captured, such as a copy from pageable host memory inside
    the model) emits one ``RuntimeWarning`` naming the error, and every call runs eagerly from then on; the failure
    is kept in ``failure``. ``graphs`` holds the captures by signature; ``replays`` and ``eager_calls`` count the
    calls served each way. All captures share one memory pool, and one static copy of each input and output of the
    same layout (the parameters, the clipped sums): captures for ``k`` batch shapes hold those once, not ``k`` times.

    Raises:
        ConfigurationError: at construction without CUDA.
    """

    def __init__(self, fn: Callable[..., Any], max_graphs: int) -> None:
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ConfigurationError(f"max_graphs must be an int >= 1, got {max_graphs!r}.")
        if not torch.cuda.is_available():
            raise ConfigurationError(
                f"cuda_graphs={max_graphs} requires a CUDA device and none is available; set cuda_graphs=0."
            )
        self.fn, self.max_graphs = fn, max_graphs
        self.graphs: dict[Hashable, _Graph] = {}
        self._buffers = _Buffers()
        self.eager_calls = 0
        self.replays = 0
        self.failure: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature(args, kwargs)
        graph = self.graphs.get(key)
        if graph is None:
            if self.failure is not None or len(self.graphs) >= self.max_graphs:
                self.eager_calls += 1
                return self.fn(*args, **kwargs)
            if any(isinstance(x, torch.Tensor) and x.device.type != "cuda" for x in pytree.tree_leaves((args, kwargs))):
                raise ConfigurationError("cuda_graphs needs every tensor argument on a CUDA device; move the batch.")
            pool = next(iter(self.graphs.values())).graph.pool() if self.graphs else None
            try:
                graph = _Graph(self.fn, args, kwargs, pool, self._buffers)
            except Exception as exc:
                result = self.fn(*args, **kwargs)  # raises the function's own errors
                self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                self.eager_calls += 1
                warnings.warn(
                    f"capturing {getattr(self.fn, '__name__', self.fn)!r} as a CUDA graph failed; running it eagerly "
                    f"from now on ({self.failure}). Set cuda_graphs=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return result
            self.graphs[key] = graph
        self.replays += 1
        return graph.replay(args, kwargs)


class EagerAfterFailedCapture:
    """A DP step function whose chunks run through a :class:`CudaGraphChunk`, until a capture fails: from the next
    step on, the step built without captures, which runs the real rows of each chunk only.

    After a failed capture the chunks still run, eagerly, but rounded up with the dead rows that the captures needed;
    those cost compute for nothing. ``eager()`` builds the step without captures; ``graphs()`` returns the current
    :class:`CudaGraphChunk` (None before the first chunk). The switch is between steps and changes how the chunks
    run, not what the step releases: dead rows add exactly nothing, and the batch, the noise key and the step state
    are the caller's, as for any step function.
    """

    def __init__(
        self, step_fn: Callable[..., Any], eager: Callable[[], Callable[..., Any]], graphs: Callable[[], Any]
    ) -> None:
        self._step, self._eager, self._graphs = step_fn, eager, graphs

    def __call__(self, *inputs: Any) -> Any:
        outputs = self._step(*inputs)
        graphs = self._graphs()
        if self._eager is not None and graphs is not None and graphs.failure is not None:
            self._step, self._eager = self._eager(), None
        return outputs
