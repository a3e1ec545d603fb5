"""The Gram route's squares and spreads formed for a chunk's calls in batches (``ghost.gram_squares``) against each
call's own Gram matrices and row norms in float64, for shared inputs (q, k and v), inputs of other shapes and
outputs of several widths, and for batch budgets that put every call in its own batch, some together, or all
together."""

from __future__ import annotations

import pytest
import torch

from opake_torch.layerwise import ghost
from opake_torch.layerwise.calls import Call, same_tensor

M, T = 3, 5


def _call(inputs: torch.Tensor, out: int, gen: torch.Generator) -> Call:
    grad = torch.randn(M, T, out, generator=gen, dtype=torch.float64)
    call = Call("linear", torch.nn.Linear(1, 1), {}, inputs, T, grad)
    call.input_key = same_tensor(inputs)
    return call


def _calls() -> list[Call]:
    """q, k and v reading one input (widths 16, 8, 8), o reading another of the same shape, a fifth call reading
    q's input with o's output shape, and a down projection reading a wider input; float32 inputs (copied to float64
    by the route), float64 output gradients but q's (float32: a group of its own)."""
    gen = torch.Generator().manual_seed(0)
    shared, other = torch.randn(M, T, 16, generator=gen), torch.randn(M, T, 16, generator=gen)
    wide = torch.randn(M, T, 24, generator=gen)
    calls = [_call(shared, 16, gen), _call(shared, 8, gen), _call(shared, 8, gen), _call(other, 16, gen)]
    calls += [_call(shared, 16, gen), _call(wide, 16, gen)]  # o's output shape again, q's input: inputs gathered
    calls[0].grad = calls[0].grad.float()
    return calls


@pytest.mark.parametrize("budget", [1, 3 * 8 * M * T * (16 + 16 + 3 * T), 2**30])  # one call a batch, some, all
def test_batched_squares_equal_each_calls_gram_matrices(monkeypatch, budget):
    monkeypatch.setattr(ghost, "GRAM_BATCH_BYTES", budget)
    calls = _calls()
    batched = ghost.gram_squares([ghost.GramSquares(call) for call in calls], [True] * len(calls), M)
    for call, (squares, spread) in zip(calls, batched, strict=True):
        a, g = call.inputs.double(), call.grad.double()
        expected = torch.einsum("mst,mst->m", a @ a.mT, g @ g.mT)
        assert squares.dtype == spread.dtype == torch.float64
        torch.testing.assert_close(squares, expected, rtol=1e-12, atol=0)
        exact = (g.norm(dim=-1) * a.norm(dim=-1)).sum(dim=1)  # S_i = sum_t ||g_t|| ||a_t||
        assert (exact <= spread * ghost._gram_spread_rounding(call, M)).all()  # the bound the margins rely on
        torch.testing.assert_close(spread, exact, rtol=1e-12, atol=0)


def test_a_shared_input_takes_one_gram_matrix_a_batch(monkeypatch):
    """The batch of k, v and o stacks two inputs (k's and v's shared one, o's), not three; without a margin that reads
    them, no spreads are formed."""
    stacked = []
    form = ghost._stacked_grams
    monkeypatch.setattr(ghost, "_stacked_grams", lambda xs: stacked.append(len(xs)) or form(xs))
    calls = _calls()[1:4]  # k, v (output width 8) and o (16), all float64 output gradients
    formed = ghost.gram_squares([ghost.GramSquares(call) for call in calls], [False] * len(calls), M)
    assert stacked == [2, 2, 1]  # inputs (k's and v's shared, o's), the two width-8 outputs, o's output
    assert all(spread is None for _, spread in formed)  # no margin reads them: none formed
