"""The trainer's engine: how many row counts (shapes) a Poisson draw can meet under each way of running a chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opake_core.clipping.microbatching import chunk_sizes
from opake_torch.transformers import engines


def _args(cuda_graphs: int = 0) -> SimpleNamespace:
    return SimpleNamespace(cuda_graphs=cuda_graphs, device=torch.device("cpu"))


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
    assert eager.row_multiple == engines.ROW_MULTIPLE
