"""Settings shared by every test: one intra-op thread per test process (and the processes it starts).

The tests run tiny CPU workloads, and ``make test`` runs two pytest workers on two cores: a second intra-op thread
per process has no core of its own, and its synchronization dominates small ops (a step of a 16 x 32 MLP took 70 ms
with two threads on a loaded two-core machine, 2 ms with one). Set ``OMP_NUM_THREADS`` to choose another count.
"""

from __future__ import annotations

import os

import torch

if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the notebooks' kernels, scripts and distributed workers
    torch.set_num_threads(1)
