"""A private step that compiles: the traced layerwise pass against a float64 loop over examples, the compile wrapper,
and DPTrainer(torch_compile=True) with inductor on BERT, GPT-2 and a Llama LoRA model against the eager run."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_hf import functional_losses, tiny_lora, tiny_model, tiny_moe, token_data
from torch._dynamo.utils import counters

from opake_core.clipping import Engine, clipped_grad
from opake_core.errors import ConfigurationError
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.layerwise.compiled import CompiledLayerwise
from opake_torch.transformers import DPTrainer, TrainingArguments, engines
from opake_torch.transformers.compile import compile_chunk

FAMILIES = {
    "bert": lambda: tiny_model("bert"),
    "gpt2": lambda: tiny_model("gpt2"),
    "llama_lora": lambda: tiny_lora("llama"),
}


def _case(family: str) -> tuple:
    """A float64 model in eval mode, its parameters, per-example and batched losses, and a batch of six."""
    model = FAMILIES[family]()
    return (model, *functional_losses(model, "bert" if family == "bert" else "causal_lm"))


def _loop_reference(loss, params, batch, bound):
    """sum_i g_i min(1, C/||g_i||) and the norms, one example at a time in float64."""
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    norms = []
    for i in range(next(iter(batch.values())).shape[0]):
        g = torch.func.grad(loss)(params, {k: v[i] for k, v in batch.items()})
        norm = math.sqrt(sum(float(v.square().sum()) for v in g.values()))
        norms.append(norm)
        for k in total:
            total[k] += g[k] * min(1.0, bound / norm)
    return total, torch.tensor(norms, dtype=torch.float64)


def _entered(compiled: CompiledLayerwise):
    """The chunk transform that runs the traced pass as it is (no compilation), inside its context."""

    def transform(chunk):
        def run(*args):
            with compiled.around(args):
                return chunk(*args)

        return run

    return transform


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("advantage", [0.01, 100.0], ids=["ghost", "instantiated"])
def test_traced_pass_equals_a_float64_loop(family, advantage):
    """The traced pass (run eagerly: the arithmetic the compiled graph computes) releases the float64 loop's clipped
    sum and norms, with every large weight taking ghost norms or every one instantiated, in chunks of at most 4 rows
    (a batch of 6: two chunks of 3)."""
    model, params, loss, batch_loss, batch = _case(family)
    compiled = CompiledLayerwise(LayerwiseGradients(model, batch_loss, ghost_advantage=advantage))
    bound = 0.05
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=bound,
        microbatch_size=4,
        return_diagnostics=True,
        engine=Engine(gradients=compiled, transform=_entered(compiled), row_multiple=1),
    )
    (clipped, diagnostics), _ = grad_fn(params, batch, state=state)
    expected, norms = _loop_reference(loss, params, batch, bound)
    torch.testing.assert_close(diagnostics.norms.double(), norms.float().double(), rtol=1e-6, atol=0)
    flat = torch.cat([clipped.value[k].reshape(-1) for k in sorted(params)])
    ref = torch.cat([expected[k].reshape(-1) for k in sorted(params)])
    assert ((flat - ref).norm() / ref.norm()).item() < 1e-9


class InPlace(torch.nn.Module):
    """A linear layer whose output the model scales in place before the next layer reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        hidden.mul_(3.0)
        return self.second(torch.tanh(hidden))


def test_an_output_changed_in_place_keeps_the_layers_gradient():
    """The gradient taken is that of the layer's output as it returned it, not of the value the model changed it to
    (without the copy, the first layer's per-example gradients are off by the factor 3)."""
    torch.manual_seed(0)
    model = InPlace().double()
    apply, params, frozen = functional_model(model)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(p, example):
        return torch.nn.functional.cross_entropy(apply(p, frozen, example["x"][None]), example["y"][None])

    def batch_loss(p, b):
        return torch.nn.functional.cross_entropy(apply(p, frozen, b["x"]), b["y"], reduction="none")

    compiled = CompiledLayerwise(LayerwiseGradients(model, batch_loss))
    engine = Engine(gradients=compiled, transform=_entered(compiled))
    grad_fn, state = clipped_grad(loss, clipping_norm=0.5, return_diagnostics=True, engine=engine)
    (clipped, diagnostics), _ = grad_fn(params, {"x": x, "y": y}, state=state)
    expected, norms = _loop_reference(loss, params, {"x": x, "y": y}, 0.5)
    torch.testing.assert_close(diagnostics.norms.double(), norms.float().double(), rtol=1e-6, atol=0)
    for name, value in expected.items():
        torch.testing.assert_close(clipped.value[name].double(), value, rtol=1e-9, atol=1e-12, msg=name)


def test_traced_pass_runs_inside_its_context_only():
    model, params, loss, batch_loss, batch = _case("llama_lora")
    compiled = CompiledLayerwise(LayerwiseGradients(model, batch_loss))
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, engine=Engine(gradients=compiled))
    with pytest.raises(ConfigurationError, match=r"runs inside its around\(\) context"):
        grad_fn(params, batch, state=state)
    assert not any(module._forward_hooks for module in model.modules())  # the context's hooks are gone after a call
    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, engine=Engine(gradients=compiled, transform=_entered(compiled))
    )
    grad_fn(params, batch, state=state)
    assert not any(module._forward_hooks for module in model.modules())


def test_the_parameters_enter_the_traced_pass_as_leaves_and_are_put_back():
    """Inside its context the parameters reach the loss as the given tensors, requiring gradients, so the traced code
    calls no requires_grad_ (which Dynamo before torch 2.13 cannot trace: a graph break, then a failed compilation);
    after the call, and after a call that raised, each has its requires_grad as before."""
    model, params, loss, batch_loss, batch = _case("llama_lora")
    seen = []

    def spy(p, b):
        seen.append(all(p[k] is params[k] and p[k].requires_grad for k in params))
        if len(seen) == 2:
            raise RuntimeError("the second call fails")
        return batch_loss(p, b)

    compiled = CompiledLayerwise(LayerwiseGradients(model, spy))
    keep = sorted(params)[0]
    params[keep].requires_grad_(True)  # one that already requires gradients keeps them
    engine = Engine(gradients=compiled, transform=_entered(compiled))
    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, engine=engine)
    grad_fn(params, batch, state=state)
    assert seen == [True]
    assert [k for k, v in params.items() if v.requires_grad] == [keep]
    with pytest.raises(RuntimeError, match="second call"):
        grad_fn(params, batch, state=state)
    assert seen == [True, True]
    assert [k for k, v in params.items() if v.requires_grad] == [keep]


def test_a_model_with_layers_the_traced_pass_does_not_serve_runs_eagerly():
    """Experts (a mixture-of-experts model) are not traced: torch_compile warns and the step keeps the hook engine,
    uncompiled, with the real rows only."""
    model = tiny_moe("qwen3_moe")
    engine_of = LayerwiseGradients(model, lambda p, b: None)
    args = SimpleNamespace(torch_compile=True, torch_compile_backend="inductor", torch_compile_mode=None,
                           cuda_graphs=0, device=torch.device("cpu"), per_example_row_multiple=1)  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"this model has \['experts'.*runs eagerly"):
        engine = engines.engine(args, engine_of, engines.chunk_transform(args, keep=print), microbatch=4)
    assert engine.gradients is engine_of and engine.transform is None and engine.row_multiple == 1


def test_a_torch_release_older_than_the_verified_one_runs_the_hook_engine_eagerly(monkeypatch):
    """torch 2.10's Dynamo cannot trace torch.autograd.grad (no trace_autograd_ops): a release older than MIN_TORCH
    keeps the hook engine, uncompiled, with a warning, and the traced pass itself refuses to be built."""
    model = tiny_model("gpt2")
    engine_of = LayerwiseGradients(model, lambda p, b: None)
    args = SimpleNamespace(torch_compile=True, torch_compile_backend="inductor", torch_compile_mode=None,
                           cuda_graphs=0, device=torch.device("cpu"), per_example_row_multiple=1)  # fmt: skip
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.10.0+cu128"))
    with pytest.warns(RuntimeWarning, match=r"torch 2\.11 or newer; this is 2\.10\.0\+cu128.*runs eagerly"):
        engine = engines.engine(args, engine_of, engines.chunk_transform(args, keep=print), microbatch=4)
    assert engine.gradients is engine_of and engine.transform is None
    with pytest.raises(ConfigurationError, match=r"needs torch 2\.11 or newer"):
        CompiledLayerwise(engine_of)


def test_a_chunk_of_one_row_meets_the_graph_of_larger_chunks():
    """The trainer's compiled engine runs a chunk of one row with a dead row: Dynamo specializes a size of 1, which
    would compile a second graph (minutes for a 12-layer model). Chunks of 1, 3 and 2 rows meet one graph, and each
    call releases the eager hook engine's clipped sum and norms of its real rows."""
    model, params, loss, batch_loss, batch = _case("gpt2")
    layerwise = LayerwiseGradients(model, batch_loss)
    args = SimpleNamespace(torch_compile=True, torch_compile_backend="aot_eager", torch_compile_mode=None,
                           cuda_graphs=0, device=torch.device("cpu"), per_example_row_multiple=1)  # fmt: skip
    compiled = engines.engine(args, layerwise, engines.chunk_transform(args, keep=print), microbatch=4)
    assert compiled.min_rows == 2
    torch._dynamo.reset()
    counters.clear()
    for rows in (1, 3, 2):
        part = {k: v[:rows] for k, v in batch.items()}
        results = []
        for engine in (compiled, Engine(gradients=layerwise)):
            grad_fn, state = clipped_grad(loss, clipping_norm=0.05, microbatch_size=4, return_diagnostics=True,
                                          engine=engine)  # fmt: skip
            (clipped, diagnostics), _ = grad_fn(params, part, state=state)
            results.append((clipped.value, diagnostics.norms))
        (sums, norms), (eager_sums, eager_norms) = results
        assert norms.shape == (rows,)
        torch.testing.assert_close(norms, eager_norms, rtol=1e-9, atol=0)
        for name, value in eager_sums.items():
            torch.testing.assert_close(sums[name], value, rtol=1e-9, atol=1e-12, msg=name)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_each_clipped_sum_is_a_tensor_of_its_own_in_the_compiled_graph():
    """Sums kept as views of one buffer of all the parameters are traced as copies of that whole buffer (each
    layer's in-place addition rewrites every parameter's sum, and the compiled step holds several such copies): the
    functionalized graph of the trainer's compiled chunk has no tensor of that size, and the step still releases the
    eager hook engine's sums."""
    from torch._dynamo.backends.common import aot_autograd

    model, params, loss, batch_loss, batch = _case("bert")
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    layerwise = LayerwiseGradients(model, batch_loss)
    args = SimpleNamespace(torch_compile=True, torch_compile_backend=backend, torch_compile_mode=None,
                           cuda_graphs=0, device=torch.device("cpu"), per_example_row_multiple=1)  # fmt: skip
    compiled = engines.engine(args, layerwise, engines.chunk_transform(args, keep=print), microbatch=6)
    torch._dynamo.reset()
    results = []
    for engine in (compiled, Engine(gradients=layerwise)):
        grad_fn, state = clipped_grad(loss, clipping_norm=0.05, microbatch_size=6, engine=engine)
        clipped, _ = grad_fn(params, batch, state=state)
        results.append(clipped.value)
    assert len(graphs) == 1
    flat = sum(v.numel() for v in params.values())
    sizes = [node.meta["val"].numel() for node in graphs[0].graph.nodes
             if isinstance(node.meta.get("val"), torch.Tensor)]  # fmt: skip
    assert flat not in [n for n in sizes if isinstance(n, int)]  # (symbolic sizes hold the batch's dimensions)
    for name, value in results[1].items():
        torch.testing.assert_close(results[0][name], value, rtol=1e-9, atol=1e-12, msg=name)


_GRAPH_CODE = """
import hashlib, sys, torch
from types import SimpleNamespace
sys.path[:0] = sys.argv[1:]
from test_compile import _case
from opake_core.clipping import clipped_grad
from opake_torch.layerwise import LayerwiseGradients
from opake_torch.transformers import engines
codes = []
def keep(graph, example_inputs):
    codes.append(graph.code)
    return graph.forward
model, params, loss, batch_loss, batch = _case("bert")
args = SimpleNamespace(torch_compile=True, torch_compile_backend=keep, torch_compile_mode=None, cuda_graphs=0,
                       device=torch.device("cpu"), per_example_row_multiple=1)
transform = engines.chunk_transform(args, keep=print)
compiled = engines.engine(args, LayerwiseGradients(model, batch_loss), transform, microbatch=6)
grad_fn, state = clipped_grad(loss, clipping_norm=0.05, microbatch_size=6, engine=compiled)
grad_fn(params, batch, state=state)
(code,) = codes
print(hashlib.sha256(code.encode()).hexdigest())
"""


def test_the_compiled_chunk_traces_the_same_graph_in_every_process():
    """The compilers' caches (inductor's FX graphs, AOTAutograd's) serve a later run, a resume say, only if it traces
    the same graph: the traced pass visits the layers' parameters in the model's order, not in the order of a set of
    names, which string hashing changes from one process to the next. Two processes with different hash seeds trace
    one graph."""
    here = Path(__file__).parent
    paths = [str(here), str(here.parents[1] / "support")]
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _GRAPH_CODE, *paths], capture_output=True, text=True, env=env,
                              timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        digests.add(done.stdout.split()[-1])
    assert len(digests) == 1


def test_compile_wrapper_enters_its_context_and_counts_compiled_calls():
    entered = []

    def around(args):
        entered.append(tuple(a.shape for a in args))
        return warnings.catch_warnings()

    run = compile_chunk(lambda x: torch.tanh(x) * 2, backend="eager", around=around)
    for n in (3, 3, 4):
        torch.testing.assert_close(run(torch.ones(n)), torch.full((n,), 2 * math.tanh(1.0)))
    assert entered == [((3,),), ((3,),), ((4,),)] and run.compiled_calls() == 3 and not run.is_eager()


def test_compile_wrapper_says_once_that_it_compiles_and_how_long_it_took(caplog):
    """A large model's first step waits minutes for its compilation: the log says why, once."""
    run = compile_chunk(lambda x: x + 1, backend="eager")
    with caplog.at_level(logging.INFO, logger="opake_torch.transformers.compile"):
        for n in (3, 3, 4):
            run(torch.ones(n))
    messages = [r.getMessage() for r in caplog.records if r.name == "opake_torch.transformers.compile"]
    assert len(messages) == 2, messages
    assert messages[0].startswith("compiling") and "backend='eager'" in messages[0]
    assert re.fullmatch(r"the first compiled call of .* took \d+\.\d s", messages[1]), messages[1]


def test_compile_wrapper_fails_loudly_past_the_recompile_limit():
    """Past Dynamo's recompile limit the frame would run eagerly without a word: the wrapper warns and says so."""
    torch._dynamo.reset()

    def chunk(x: torch.Tensor, k: int) -> torch.Tensor:
        return x * k

    run = compile_chunk(chunk, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=1):
        run(torch.ones(2), 2)
        with pytest.warns(RuntimeWarning, match="running it eagerly"):  # another int value: a recompilation
            torch.testing.assert_close(run(torch.ones(2), 3), torch.full((2,), 3.0))
    assert run.is_eager() and run.compiled_calls() == 1


# -- DPTrainer(torch_compile=True) with inductor -------------------------------------------------------------------

DATA = token_data(40)
CLASSES = token_data(40, classes=3)


def _args(tmp_path, **kw):
    base = {
        "per_device_train_batch_size": 8,
        "microbatch_size": 8,
        "max_steps": 3,
        "privacy_noise_multiplier": 1.0,
        "clipping_norm": 0.1,  # some examples clipped, some not
        "use_cpu": True,
        "disable_tqdm": True,
        "learning_rate": 0.05,
        "lr_scheduler": "constant",
        "logging_steps": 3,
        "save_strategy": "no",
        "report_to": "none",
        "privacy_noise_seed": 0,  # both runs draw the same batches and noise
    }
    return TrainingArguments(str(tmp_path / "out"), **{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_step_equals_the_eager_step(tmp_path, family, monkeypatch):
    """Three Poisson steps (batches of different sizes and padded lengths) with the layerwise engine, eager and
    compiled by inductor: the weights agree to float32 rounding (rtol 1e-5, atol 1e-6: the compiled graph sums in
    other orders, about 1e-7 here, while a wrong norm or sum moves them by the learning rate times the noise-free
    update, above 1e-3). The compilation must not fall back: no warning, every chunk served by the compiled function,
    one graph (rows and positions symbolic), no graph break."""
    wrappers = []

    def spy(chunk, **kwargs):
        wrappers.append(compile_chunk(chunk, **kwargs))
        return wrappers[-1]

    monkeypatch.setattr(engines, "compile_chunk", spy)
    data = CLASSES if family == "bert" else DATA
    trained, shapes = {}, []
    for compiled in (False, True):
        trainer = DPTrainer(FAMILIES[family](), _args(tmp_path / str(compiled), torch_compile=compiled),
                            train_dataset=data)  # fmt: skip
        assert trainer.per_example_gradients_engine == "layerwise"
        fetch = trainer.fetch_batch
        trainer.fetch_batch = lambda dataset, rows, fetch=fetch: shapes.append(len(rows)) or fetch(dataset, rows)
        torch._dynamo.reset()
        counters.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        assert not [str(w.message) for w in caught if "eagerly" in str(w.message)]
        trained[compiled] = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    (run,) = wrappers
    assert not run.is_eager() and run.compiled_calls() >= 3  # one chunk per step at least
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert len(set(shapes[-3:])) > 1  # the compiled steps met batches of different sizes
    for name, value in trained[False].items():
        torch.testing.assert_close(trained[True][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(value, FAMILIES[family]().get_parameter(name).detach()), name  # training moved it
