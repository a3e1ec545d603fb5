"""Launch a worker (``ddp_worker.py`` by default) on CPU processes (Gloo, 2 by default) with torchrun and load what
each rank wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).with_name("ddp_worker.py")
GLOO_ABORT = "terminate called without an active exception"
ROOT = Path(__file__).resolve().parents[3]


def launch(
    mode: str,
    out: Path,
    timeout: float = 120,
    *,
    worker: Path = WORKER,
    ranks: int = 2,
    check: bool = True,
    **env: str,
) -> Any:
    """What each rank wrote; ``check=False``: the finished launch itself (a run expected to fail)."""
    out.mkdir(parents=True, exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k not in {"WORLD_SIZE", "RANK", "LOCAL_RANK"}}
    environ.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    for attempt in range(2):
        done = subprocess.run(
            [*command, str(worker), mode, str(out)], env=environ, capture_output=True, text=True, timeout=timeout
        )
        # Gloo's threads can abort a rank at teardown under heavy load ("terminate called without an active
        # exception", SIGABRT): the launch is retried once for that signature only; any other failure, and the
        # same abort twice, fails the test, and the results are always those of a run in which every rank finished.
        if done.returncode == 0 or GLOO_ABORT not in done.stderr or attempt or not check:
            break
    if not check:
        return done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
