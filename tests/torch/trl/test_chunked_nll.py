"""chunked_nll: equal to the plain cross-entropy (loss and gradient, also under vmap) with less peak memory."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, vmap
from torch.profiler import ProfilerActivity, profile

from opake_torch.transformers.loss import causal_lm_loss
from opake_torch.transformers.trl.chunked_nll import chunked_nll, chunked_token_logps


def _case(length=37, hidden=16, vocab=50, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(length, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype) / hidden**0.5
    b = torch.randn(vocab, generator=gen, dtype=dtype)
    labels = torch.randint(0, vocab, (length,), generator=gen)
    labels[:6] = -100  # a prompt
    labels[-4:] = -100  # padding
    return h, w, b, labels


def _plain(h, w, b, labels):
    logits = h @ w.T + b
    targets, mask = labels[1:], labels[1:] != -100
    logps = torch.log_softmax(logits[:-1], -1).gather(-1, torch.where(mask, targets, 0)[:, None]).squeeze(-1)
    return -(logps * mask).sum() / mask.sum().clamp(min=1)


@pytest.mark.parametrize("chunk_size", [1, 5, 36, 100])
def test_loss_and_gradient_equal_plain_cross_entropy(chunk_size):
    h, w, b, labels = _case()
    expected = grad(_plain, argnums=(0, 1, 2))(h, w, b, labels)
    got = grad(lambda *a: chunked_nll(*a[:2], a[3], bias=a[2], chunk_size=chunk_size), argnums=(0, 1, 2))(
        h, w, b, labels
    )
    torch.testing.assert_close(
        chunked_nll(h, w, labels, bias=b, chunk_size=chunk_size), _plain(h, w, b, labels), atol=1e-10, rtol=1e-10
    )
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


def test_float32_matches_causal_lm_loss_within_1e_5():
    h, w, _, labels = _case(dtype=torch.float32)
    loss = chunked_nll(h, w, labels, chunk_size=8)
    torch.testing.assert_close(loss, causal_lm_loss(h @ w.T, labels), atol=1e-5, rtol=1e-5)
    g_chunked = grad(lambda w: chunked_nll(h, w, labels, chunk_size=8))(w)
    g_plain = grad(lambda w: causal_lm_loss(h @ w.T, labels))(w)
    torch.testing.assert_close(g_chunked, g_plain, atol=1e-5, rtol=1e-5)


def test_per_example_gradients_under_vmap_and_zero_weight_for_ignored_tokens():
    h, w, _, labels = _case(dtype=torch.float32)
    hs = torch.stack([h, h.flip(0), 2 * h])
    ls = torch.stack([labels, labels.flip(0), torch.full_like(labels, -100)])  # the last has no target at all
    got = vmap(grad(lambda w, h, l: chunked_nll(h, w, l, chunk_size=6)), in_dims=(None, 0, 0))(w, hs, ls)
    expected = vmap(grad(lambda w, h, l: causal_lm_loss(h @ w.T, l)), in_dims=(None, 0, 0))(w, hs, ls)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(w))
    targets = torch.zeros(len(h) - 1, dtype=torch.long)
    logps = chunked_token_logps(h[:-1], w, targets, chunk_size=4)
    assert logps.shape == (len(h) - 1,)  # ignored positions are kept, not compacted


def _peak_bytes(fn):
    """Peak of the running sum of CPU allocations and frees that torch.profiler records while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_peak_memory_is_lower_with_a_large_vocabulary(capsys):
    """Peak CPU memory of loss + backward measured with torch.profiler, T=256, H=32, V=32768, chunks of 32."""
    h, w, _, labels = _case(length=256, hidden=32, vocab=32768, dtype=torch.float32)
    w.requires_grad_(True)

    def plain():
        causal_lm_loss(h @ w.T, labels).backward()

    def chunked():
        chunked_nll(h, w, labels, chunk_size=32).backward()

    plain_peak, chunked_peak = _peak_bytes(plain), _peak_bytes(chunked)
    with capsys.disabled():
        print(f"\n[chunked_nll] peak MiB: plain {plain_peak / 2**20:.1f}, chunked {chunked_peak / 2**20:.1f}")
    logits_bytes = 256 * 32768 * 4
    assert plain_peak > logits_bytes
    assert chunked_peak < plain_peak / 3
