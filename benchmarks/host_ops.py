"""CPU diagnostic: the operators one ``clipped_grad`` call of the layerwise engine dispatches, by Opake function.

A GPU step that is bound by its host work pays per operator; this counts them on a CPU for a small Llama-style model
(2 layers, width 256, 4 x 32 tokens: every linear layer takes ghost norms) or BERT (``--model bert``: 2 layers, width
256, sequence classification, the same tokens), one call after a warm-up, under a
``TorchDispatchMode``: each ATen operator is charged to the innermost ``opake_core`` or ``opake_torch`` frame on the
Python stack ("other": the model's own forward and backward outside them). Triton launches count one each, the
interpreter's work inside them none.

    python benchmarks/host_ops.py [--model llama|bert] [--layers N] [--bf16] [--route gram|product] [--tf32]

``--bf16``: bf16 autocast (with ``TRITON_INTERPRET=1`` and Triton importable, the norm and one-pass sum kernels run as
on a GPU); ``--route``: the norm route forced for every ghost call (default: the engine's choice, which on a CPU is
not a GPU's); ``--tf32``: the engine told that float32 matmuls run in TF32 (its norms then carry the rounding margin
of the sums' products; the CPU's products stay IEEE). Prints the total, then the count per function and per
(function, operator).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from opake_core.clipping import Engine, clipped_grad
from opake_torch.functional import functional_model
from opake_torch.layerwise import LayerwiseGradients, engine, ghost
from opake_torch.patches.kernels import product_norms, product_sums
from opake_torch.transformers.loss import batch_losses, per_example_loss


def _owner() -> str:
    """The innermost Opake frame of the Python stack, as ``module path:function``."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if ("opake_torch/" in path or "opake_core/" in path) and not path.endswith("host_ops.py"):
            return path.split("opake_", 1)[-1] + ":" + frame.name
    return "other"


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            self.ops[(_owner(), str(func))] += 1
        return func(*args, **(kwargs or {}))


class _Launch:
    """A Triton kernel whose launches count as one operator each."""

    def __init__(self, kernel: Any, name: str, counter: _Count) -> None:
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.counter.ops[(_owner(), self.name)] += 1
            self.counter.paused = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.counter.paused = False

        return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama", "bert"), default="llama")
    parser.add_argument("--layers", type=int, default=2, help="decoder or encoder layers (per-layer counts: run two)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--route", choices=("gram", "product"))
    parser.add_argument("--tf32", action="store_true")
    opts = parser.parse_args()
    if opts.route:
        ghost.norm_route = lambda *args, **kwargs: opts.route
    if opts.tf32:
        engine.matmul_precision = lambda device: "tf32"
    torch.manual_seed(0)
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": opts.layers, "num_attention_heads": 4,
             "vocab_size": 128, "max_position_embeddings": 128, "attn_implementation": "sdpa"}  # fmt: skip
    if opts.model == "bert":
        model, task = BertForSequenceClassification(BertConfig(num_labels=2, **shape)), "sequence_classification"
    else:
        model, task = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **shape)), "causal_lm"
    model.train()
    apply, params, frozen = functional_model(model)
    ids = torch.randint(1, shape["vocab_size"], (4, 32))
    labels = torch.randint(0, 2, (4,)) if opts.model == "bert" else ids.clone()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if opts.bf16 else contextlib.nullcontext()

    def loss(p: dict, example: dict) -> torch.Tensor:
        with precision:
            return per_example_loss(apply, p, frozen, example, task=task)

    def batch_loss(p: dict, examples: dict) -> torch.Tensor:
        with precision:
            return batch_losses(apply, p, frozen, examples, task=task)

    grad_fn, state = clipped_grad(
        loss, clipping_norm=1.0, batch_argnums=1, engine=Engine(gradients=LayerwiseGradients(model, batch_loss))
    )
    grad_fn(params, batch, state=state)  # warm-up
    counter = _Count()
    product_norms._tile_squares_kernel = _Launch(product_norms._tile_squares_kernel, "norm kernel", counter)
    product_sums._clipped_sum_kernel = _Launch(product_sums._clipped_sum_kernel, "one-pass sum kernel", counter)
    with counter:
        grad_fn(params, batch, state=state)
    by_owner: collections.Counter[str] = collections.Counter()
    for (owner, _), count in counter.ops.items():
        by_owner[owner] += count
    print("total", sum(counter.ops.values()))
    for owner, count in by_owner.most_common():
        print(f"{count:6d}  {owner}")
    print()
    for (owner, op), count in counter.ops.most_common():
        print(f"{count:6d}  {owner}  {op}")


if __name__ == "__main__":
    main()
