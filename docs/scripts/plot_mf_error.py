"""Plot each DP-FTRL strategy's expected error against DP-SGD (identity): writes docs/img/mf_error.png.

Run from the repository root: ``python docs/scripts/plot_mf_error.py``. Error of step ``t`` at equal privacy:
``sens(C) * ||B[t, :]||`` for the prefix-sum workload (unit noise multiplier, unit clip), single participation.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from opake_core import mf

N = 1000
STRATEGIES = {
    "identity (DP-SGD)": mf.identity(),
    "BandMF (16 bands)": mf.band_mf(16),
    "BLT (<= 10 buffers)": mf.blt(10, objective="mean"),
    "BSR (p=8, alpha=1, beta=0)": mf.bsr(8, alpha=1.0, beta=0.0),
    "BISR (p=4)": mf.bisr(4),
    "lambda-CGD (lambda=0.5)": mf.lambda_cgd(0.5),
}


def main() -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, strategy in STRATEGIES.items():
        concrete = mf.optimize(strategy, N)
        rmse = np.sqrt(mf.per_query_error(concrete, N) * mf.sensitivity_squared(concrete, N))
        ax.plot(np.arange(1, N + 1), rmse, label=f"{label}: {concrete.num_buffers} buffers")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("step t")
    ax.set_ylabel("std of the noise on the prefix sum at t")
    ax.set_title(f"Expected error, prefix-sum workload, n = {N}, single participation")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = pathlib.Path(__file__).resolve().parents[1] / "img" / "mf_error.png"
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
