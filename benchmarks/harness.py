"""One-run benchmark: the same model, batch and sequence length in every training mode, side by side.

Usage::

    python benchmarks/harness.py --suite gpu --out DIR [--profile] [--find-max-batch]
    python benchmarks/harness.py --suite smoke --out DIR          # tiny CPU configs, for the test suite

Modes, run one after the other in this process for each workload (memory freed in between):

* ``nonprivate``: plain Hugging Face training, ``model(**batch).loss.backward()`` and ``torch.optim.AdamW``.
* ``opacus_hooks``, ``opacus_ghost``: Opacus per-sample hooks and ghost clipping (skipped when opacus is missing).
* ``opake_core``: ``opake_core.step.dp_sgd`` on the model's functional form; a fixed batch instead of a Poisson draw.
* ``opake_trainer``: ``DPTrainer.train()`` with ``max_steps = warmup + steps``, timed by a callback. Its dataset is
  the batch itself (sampling rate 1), so every Poisson draw is that same full batch.
* ``opake_trainer_kernels``: the same with ``use_performance_kernels=True`` (a logged no-op without CUDA and
  Triton).
* ``opake_trainer_graphs``: the same with ``cuda_graphs=1``: each chunk (per-example gradients, clipping, sum) is
  captured once and replayed (CUDA only; skipped elsewhere).

Every private mode uses noise multiplier 1 and clipping norm 1, AdamW with lr 1e-4 and weight decay 0.01. Each
mode times the median of ``--steps`` steps after ``--warmup`` warm-ups (synchronized wall clock around each step)
and reads the peaks of ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the timed steps (a
replayed graph allocates nothing, so compare CUDA graphs on the reserved peak). Same-batch correctness: our clipped
sum (``clipped_grad``, normalize_by=1, noise off, eval mode) against Opacus's hooks with noise multiplier 0 and
loss reduction "sum", or, without Opacus on the smoke suite, against a float64 per-example autograd loop.

Writes ``results.json`` (meta, one record per workload x mode, checks, phases) and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks import check_clipped_sum, reference_for
from environment import environment
from measure import run_mode
from modes import MODES
from profiling import accounting_query_ms
from report import markdown, write_results
from settings import Settings
from workloads import SUITES


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument("--workloads", help="comma-separated subset of the suite's workload names")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--steps", type=int, help="timed steps per mode (default 10 gpu, 3 smoke)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per mode (default 3 gpu, 1 smoke)")
    parser.add_argument("--device", help="default: cuda for the gpu suite, cpu for smoke")
    parser.add_argument("--microbatch", type=int, help="vmap chunk of the opake modes (default: the full batch)")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--clipping-norm", type=float, default=1.0)
    parser.add_argument("--no-tf32", action="store_true", help="fp32 matmuls without TF32 (TF32 is on by default)")
    parser.add_argument("--no-check", action="store_true", help="skip the same-batch clipped-sum check")
    parser.add_argument("--profile", action="store_true", help="phase breakdown of the opake_core step")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--find-max-batch", action="store_true", help="double the batch until OOM, per mode")
    parser.add_argument("--max-batch-cap", type=int, default=1024)
    parser.add_argument("--max-batch-budget-s", type=float, default=60.0, help="time budget per mode and workload")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    smoke = a.suite == "smoke"
    device = torch.device(a.device or ("cpu" if smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the gpu suite needs CUDA; run --suite smoke (or pass --device cpu) on a machine without it.")
    settings = Settings(
        device=device,
        steps=a.steps or (3 if smoke else 10),
        warmup=a.warmup if a.warmup is not None else (1 if smoke else 3),
        noise_multiplier=a.noise_multiplier,
        clipping_norm=a.clipping_norm,
        microbatch=a.microbatch,
        tf32=not a.no_tf32,
        profile_steps=a.profile_steps,
        max_batch_cap=a.max_batch_cap,
        max_batch_budget_s=a.max_batch_budget_s,
    )
    workloads = SUITES[a.suite]
    if a.workloads:
        wanted = a.workloads.split(",")
        unknown = sorted(set(wanted) - {w.name for w in workloads})
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}; the {a.suite} suite has {[w.name for w in workloads]}.")
        workloads = tuple(w for w in workloads if w.name in wanted)
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        raise SystemExit(f"unknown modes {sorted(set(modes) - set(MODES))}; choose from {MODES}.")
    reference = reference_for(a.suite)
    report: dict[str, Any] = {"meta": environment(settings, argv), "records": [], "checks": [], "phases": []}
    report["accounting_query_ms"] = None
    a.out.mkdir(parents=True, exist_ok=True)
    for workload in workloads:
        for mode in modes:
            record = run_mode(mode, workload, settings, find_max_batch=a.find_max_batch, profile=a.profile)
            phases = record.pop("phase_breakdown", None)
            if phases is not None:
                report["phases"].append(phases)
            report["records"].append(record)
            print(json.dumps(record), flush=True)
            write_results(report, a.out)
        if not a.no_check:
            check = check_clipped_sum(workload, settings, reference=reference)
            report["checks"].append(check)
            print(json.dumps(check), flush=True)
            for r in report["records"]:
                if r["workload"] == workload.name and r["mode"] == "opake_core":
                    r[f"clipped_sum_max_rel_diff_vs_{reference}"] = check.get("max_rel_diff")
            write_results(report, a.out)
    if a.profile:
        report["accounting_query_ms"] = accounting_query_ms()
    write_results(report, a.out)
    print(markdown(report))
    failed_checks = [c for c in report["checks"] if not c["ok"] and not c.get("skipped")]
    return 1 if failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
