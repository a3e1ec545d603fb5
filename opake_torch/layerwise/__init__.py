"""Per-example gradients from layer inputs and output gradients: one batched forward and backward, no vmap.

For a layer ``y = W a (+ b)`` applied to the ``T`` positions of example ``i``, the example's weight gradient is
``G_i = sum_t g_it a_it^T`` where ``g_it = dL_i / dy_it``. Both factors come out of one ordinary batched pass: the
inputs ``a`` from a forward hook, the output gradients ``g`` from a tensor hook on the output (or, for the first
layers, whose outputs need no gradient yet, a tap that links them to a scalar anchor: the backward runs to the anchor
and forms no parameter gradient). From them, per layer:

* **instantiate**: ``G_i`` itself (``[m, out, in]``), cheap when ``out * in`` is small (LoRA adapters, biases,
  norm weights), written into one buffer per (dtype, shape) group so that norms and scaled sums take one launch per
  group;
* **ghost norm**, where ``T (in + out) < in * out`` (weighted by the engine's ``ghost_advantage``): the norm by the
  cheaper of two routes (the engine's ``norm_route``, :func:`~opake_torch.layerwise.ghost.norm_route`), float64
  ``T x T`` Gram matrices (Li et al. 2022, arXiv 2110.05679, section 4.2:
  ``||G_i||^2 = sum_{t,s} (a_it . a_is)(g_it . g_is)``) or the example's gradient formed at the matmul rate for its
  norm only, with a proven rounding margin (:func:`~opake_torch.layerwise.ghost.product_norms`); the clipped sum is
  then ``sum_i c_i G_i = g^T (c * a)``, one matmul, the same as a non-private weight gradient ("book-keeping", Bu et
  al. 2023, arXiv 2210.00038); the scaled input ``c * a`` is formed once for the layers that read the same input (q,
  k and v).

A linear layer that ran in bfloat16 (bf16 weights or bf16 autocast: its output gradient is bf16) has the weight
gradient ``g^T bf16(a)``, a product of bf16 factors, so its norms are taken from the bf16-rounded input and its
clipped sum runs on bf16 tensor cores with float32 accumulation: the clip factor rounded down to a bf16 number
``c'_i <= c_i`` makes ``c'_i g_it`` exactly two bf16 parts, so every example contributes ``c'_i G_i``, within the
bound, by two bf16 tensor-core products (see :func:`~opake_torch.layerwise.precision.add_bf16_product`). Where the
Triton kernel runs (CUDA), the sum takes one pass instead: each example's tile of ``G_i`` accumulated in registers,
times ``c_i``, with the norms carrying that accumulation's rounding margin
(:func:`~opake_torch.patches.kernels.product_sums.clipped_product_sum`,
:func:`~opake_torch.layerwise.ghost.one_pass_sum`).

:class:`LayerwiseGradients` is the ``gradients`` part of an :class:`opake_core.clipping.Engine`. Clipping itself
stays in :mod:`opake_core.clipping.rules`, which takes the squared norms, forms the scales with the same rule and
margin as for materialized gradients and asks for the scaled sum: the two engines release the same clipped sum up to
float rounding.

Under activation checkpointing (:func:`opake_torch.patches.activation_checkpointing.checkpoint_layer`) a checkpointed
layer's forward runs without gradients and keeps nothing: the hooks note only which layers ran. Its recompute in the
backward takes the pass's anchor as an input (the engine hands it to the model's checkpointed layers for the
duration of the pass: :func:`~opake_torch.patches.activation_checkpointing.recompute_linked_to`) and runs in plain
autograd, so the recomputed layers are tapped like the others and their gradients are formed there, inside the
backward, while the layer's recomputed activations exist: small gradients (adapters) are instantiated at once; a
large weight keeps its recomputed input and output gradient for the book-keeping sum, ``T (in + out)`` numbers per
example instead of the ``in * out`` of its per-example gradient (so a full fine-tune under checkpointing keeps, per
layer, the inputs and output gradients of its linear layers, not the layer's whole activations).

Supported layers: ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``, Hugging Face's ``Conv1D`` and
Llama- and gpt-oss-style ``*RMSNorm`` layers, with their stock ``forward``; every layer must see the batch in dimension
0 (Hugging Face models are batch-first). Attention sinks (gpt-oss) through Hugging Face's eager attention, which
expands them over the batch. Hugging Face's mixture-of-experts layers too, which see the tokens flattened to
``[m T, d]``: top-k routers (a linear layer on those rows; a tensor hook on the logits they return sees the gradient
through the routing weights) and stacked ``[E, ...]`` experts, which run
:func:`~opake_torch.layerwise.experts.tapped_experts_forward` during the pass (one row per token and chosen expert;
ghost norms per expert from the rows of each example routed to it, the clipped sum one matmul per expert). A layer
other than an embedding whose input is two-dimensional with a multiple of ``m`` rows takes them as tokens flattened
example-major (``[m T, d]``: MoE shared experts, the gated norm's heads). The gated delta-net of Qwen3-Next and
Qwen3.5-MoE: its zero-centred and gated RMSNorms are norm layers; its ``A_log``, ``dt_bias`` and depthwise causal
``nn.Conv1d``, used in the layer's own code, are followed during its call and tapped where they meet the batch
(:mod:`opake_torch.layerwise.uses`).

Grouped examples (``LayerwiseGradients(..., grouped=True)``, user-level privacy): an example is a group of ``k`` rows
(one user's), every batched tensor is ``[m, k, ...]`` and the model runs on the ``R = m k`` rows flattened
example-major. The example's gradient is the sum of its rows', ``G_i = sum_{r, t} g_rt a_rt^T``: its rows read as one
example of ``k T`` positions (``[R, T, d]`` as ``[m, k T, d]``), so ghost norms take the Gram matrices over the
concatenated positions, instantiated gradients sum the rows, and no per-row gradient is formed; the layers compare
their leading size with ``R``, and the norms, the clipping and the coupling check (which replaces whole examples)
are over the ``m`` examples. Every layer kind above is served grouped; the traced pass of
:mod:`~opake_torch.layerwise.compiled` is not (the hook engine runs).

A weight tied between an embedding and a linear head takes ghost norms with the cross term of its two parts
(:func:`~opake_torch.layerwise.ghost.tied_norms`); any other parameter used by several layers or calls is
instantiated per call and summed before its norm is taken. The batched pass assumes that examples do not interact:
modules that mix examples (batch normalization) are refused, the engine's first chunk (per set of trainable names and
training mode) runs once more with half its rows replaced and refuses a model whose other rows change a row's norms,
and :meth:`LayerwiseGradients.check` compares the per-example gradients with ``grad`` of the per-example loss, one
example at a time, on a few examples: that catches a parameter used outside a supported layer. An in-place operation
on a layer's output is served; one on a layer's input after the layer ran is refused. Hooks exist only for the
duration of one call.

Modules: :mod:`~opake_torch.layerwise.engine` (:class:`LayerwiseGradients`), :mod:`~opake_torch.layerwise.hooks` (the
hooks of one chunk's pass), :mod:`~opake_torch.layerwise.kinds` (the layers served), :mod:`~opake_torch.layerwise.calls`
(one recorded layer call), :mod:`~opake_torch.layerwise.dense` (instantiated gradients),
:mod:`~opake_torch.layerwise.ghost` (ghost norms and book-keeping sums), :mod:`~opake_torch.layerwise.gradients` (a
chunk's gradients, norms and scaled sum), :mod:`~opake_torch.layerwise.precision` (matmul precision, the TF32 margin,
bf16 factors), :mod:`~opake_torch.layerwise.experts` (the MoE taps), :mod:`~opake_torch.layerwise.uses` (parameters a
layer uses in its own code), :mod:`~opake_torch.layerwise.compiled` (the traced pass for ``torch.compile``).
"""

from opake_torch.layerwise.engine import LayerwiseGradients
from opake_torch.layerwise.kinds import unsupported_parameters
from opake_torch.layerwise.precision import matmul_precision, product_error

__all__ = ["LayerwiseGradients", "matmul_precision", "product_error", "unsupported_parameters"]
