"""Differentiable float64 losses (torch autograd on the CPU) for the scipy L-BFGS strategy optimizers.

Only the host uses these: parameters are NumPy float64 vectors, the loss and its gradient come back as NumPy.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.signal
import torch

from opake_core.mf.workload import Workload

_F64 = torch.float64


class _InverseSeries(torch.autograd.Function):
    """``c_inv = 1 / c`` as a truncated power series (length ``n``), with the gradient of ``c * c_inv = delta``.

    ``d c_inv = -(c_inv * c_inv) * d c``, so ``dL/dc_r = -sum_k g_k q_{k-r}`` with ``q = c_inv * c_inv``.
    Both directions are recursive filters: ``O(n len(c))`` instead of a dense triangular solve.
    """

    @staticmethod
    def forward(ctx, c: torch.Tensor, n: int) -> torch.Tensor:
        c_np = c.detach().numpy()
        impulse = np.zeros(n)
        impulse[0] = 1.0
        inv = scipy.signal.lfilter([1.0], c_np, impulse)
        ctx.save_for_backward(c)
        ctx.inv = inv
        return torch.from_numpy(inv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (c,) = ctx.saved_tensors
        inv = ctx.inv
        n = inv.size
        q = scipy.signal.lfilter([1.0], c.detach().numpy(), inv)
        g = grad.detach().numpy()
        out = np.array([-(g[r:] @ q[: n - r]) for r in range(c.numel())])
        return torch.from_numpy(out), None


def inverse_series(c: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of ``1 / c(x)`` (differentiable in ``c``)."""
    return _InverseSeries.apply(c, n)


def causal_conv(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """``(a * b)[:n]`` along dim 0 through the FFT (``b`` may have trailing dims)."""
    size = 2 * n
    fa = torch.fft.rfft(a[:n], n=size)
    fb = torch.fft.rfft(b[:n], n=size, dim=0)
    if b.dim() > 1:
        fa = fa.reshape(-1, *([1] * (b.dim() - 1)))
    return torch.fft.irfft(fa * fb, n=size, dim=0)[:n]


def per_query_error(noising: torch.Tensor, workload: Workload, n: int) -> torch.Tensor:
    """``||B[i, :]||^2`` for ``B = A T(noising)`` and every row ``i < n``."""
    if workload.is_toeplitz:
        a = torch.from_numpy(workload.toeplitz_coef(n))
        b = causal_conv(a, noising, n)
        return torch.cumsum(b * b, dim=0)
    k = torch.arange(n, dtype=_F64)
    h = causal_conv(workload.beta**k, noising, n)
    lag = k[:, None] - k[None, :]
    lower = lag >= 0
    dense = torch.where(lower, h[lag.clamp(min=0).long()], torch.zeros((), dtype=_F64))
    dense = torch.from_numpy(workload.rates(n))[:, None] * dense
    B = causal_conv(workload.alpha**k, dense, n)
    return (B * B).sum(dim=1)


def minsep_sensitivity_squared(c: torch.Tensor, min_sep: int, k: int) -> torch.Tensor:
    """``||sum_{m<k} shift_{m b}(c)||^2`` (the closed form of ``toeplitz.minsep_sensitivity_squared`` for
    non-negative non-increasing ``c``, here on the raw coefficients so that it is differentiable)."""
    n = c.numel()
    rows = math.ceil(n / min_sep)
    blocks = torch.nn.functional.pad(c, (0, rows * min_sep - n)).reshape(rows, min_sep)
    cs = torch.cumsum(blocks, dim=0)
    if k < rows:
        cs = torch.cat([cs[:k], cs[k:] - cs[:-k]], dim=0)
    v = cs.reshape(-1)[:n]
    return v @ v
