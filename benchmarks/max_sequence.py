"""The longest sequence that fits on one GPU: Hugging Face's ``Trainer`` against ``DPTrainer``, same model and knobs.

For each mode, sequence lengths grow by ``--factor`` from ``--start`` (rounded to ``--resolution`` tokens) until a
run fails, then the gap between the longest that ran and the shortest that failed is bisected down to
``--resolution`` tokens. Each trial is one row of :mod:`e2e_trainer` (``--warmup`` + ``--steps`` steps of
``train()`` with the workload's ``trainer_args``, such as ``gradient_checkpointing``) in a fresh subprocess, so an
out-of-memory failure leaves nothing behind for the next trial.

The private mode is ``dp_q1``: the dataset is one batch drawn with q = 1, so every step runs one full chunk of the
expected batch, the largest chunk a Poisson draw runs at the default ``microbatch_size`` (a larger draw runs as
several chunks of that size). A run at q = 0.01 would fit longer sequences on the steps whose draw is small, and is
the wrong measure of what fits.

    python benchmarks/max_sequence.py --workload llama8b_lora16_s4096_b8_ckpt --modes hf dp_q1 --out max_seq

Writes ``results.json`` (every trial) and ``results.md`` to ``--out`` after every trial.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_trainer


def search(run: Any, *, start: int, factor: float, resolution: int, budget_s: float) -> tuple[int | None, int | None]:
    """``(longest that ran, shortest that failed)`` over the lengths tried by ``run(seq) -> ok``; None where no trial
    gave one (or the budget ran out first)."""
    begin = time.perf_counter()

    def rounded(seq: float) -> int:
        return max(resolution, round(seq / resolution) * resolution)

    fits, fails = None, None
    seq = rounded(start)
    while time.perf_counter() - begin < budget_s:
        if run(seq):
            fits = seq
        else:
            fails = seq
        if fails is None:
            seq = max(rounded(seq * factor), seq + resolution)
        elif fits is None:
            if seq <= resolution:
                break
            seq = rounded(seq / factor)
        else:
            if fails - fits <= resolution:
                break
            seq = rounded((fits + fails) / 2)
            if seq in (fits, fails):
                break
    return fits, fails


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Longest sequence that fits: {report['workload']}",
        "",
        f"{report['meta']['device']}, {report['meta']['date_utc']}; batch {report['batch']}, "
        f"trainer_args {report['trainer_args']}, {report['settings']['warmup'] + report['settings']['steps']} "
        f"steps per trial, resolution {report['settings']['resolution']} tokens.",
        "",
        "| mode | longest that ran | shortest that failed | its peak GiB |",
        "|---|---|---|---|",
    ]
    for mode, (fits, fails) in report["results"].items():
        peak = next((t["peak_gib"] for t in report["trials"] if t["mode"] == mode and t["seq"] == fits), None)
        lines.append(f"| {mode} | {fits} | {fails} | {e2e_trainer.fmt(peak, '.2f')} |")
    lines += ["", "| mode | seq | ran | peak GiB | step s | error |", "|---|---|---|---|---|---|"]
    for t in report["trials"]:
        error = (t.get("error") or "")[:80].replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {t['mode']} | {t['seq']} | {t['ok']} | {e2e_trainer.fmt(t.get('peak_gib'), '.2f')} | "
            f"{e2e_trainer.fmt(t.get('step_s_mean'), '.3f')} | {error} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True, help="an e2e_trainer workload name (its batch and knobs)")
    parser.add_argument("--modes", nargs="+", default=["hf", "dp_q1"], help="e2e_trainer modes to search")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--start", type=int, default=4096, help="the first length tried")
    parser.add_argument("--factor", type=float, default=1.5, help="growth between lengths until a failure")
    parser.add_argument("--resolution", type=int, default=1024, help="lengths are multiples of this")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="a tiny workload on CPU (smoke)")
    parser.add_argument("--budget-s", type=float, default=1800.0, help="per mode: no new trial after this")
    parser.add_argument("--trial-timeout-s", type=float, default=600.0)
    opts = parser.parse_args(argv)
    if opts.factor <= 1 or opts.resolution < 1 or opts.start < 2:
        parser.error("--factor must exceed 1, --resolution be positive and --start at least 2")
    row_args = ["--workloads", opts.workload, "--modes", *opts.modes, "--out", str(opts.out)]
    row_args += ["--steps", str(opts.steps), "--warmup", str(opts.warmup)] + ["--tiny"] * opts.tiny
    row_opts = e2e_trainer.parse(row_args)
    (workload,) = row_opts.workloads
    opts.out.mkdir(parents=True, exist_ok=True)
    shared = e2e_trainer.Settings(
        device=row_opts.device, steps=opts.steps, warmup=opts.warmup, noise_multiplier=e2e_trainer.NOISE_MULTIPLIER,
        clipping_norm=e2e_trainer.CLIPPING_NORM, microbatch=None, tf32=row_opts.tf32, profile_steps=0,
        max_batch_cap=0, max_batch_budget_s=0.0,
    )  # fmt: skip
    report: dict[str, Any] = {
        "meta": e2e_trainer.environment(shared, sys.argv[1:] if argv is None else argv),
        "workload": workload.name,
        "batch": workload.batch,
        "trainer_args": workload.trainer_args,
        "settings": {k: getattr(opts, k) for k in ("start", "factor", "resolution", "steps", "warmup")},
        "trials": [],
        "results": {},
    }

    def write() -> None:
        (opts.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
        (opts.out / "results.md").write_text(markdown(report))

    for mode in opts.modes:

        def run(seq: int, mode: str = mode) -> bool:
            at = dataclasses.replace(workload, seq=seq)
            record = e2e_trainer.run_in_subprocess(at, mode, row_opts, timeout=opts.trial_timeout_s)
            trial = {k: record.get(k) for k in ("mode", "seq", "ok", "peak_gib", "reserved_gib", "step_s_mean")}
            report["trials"].append({**trial, "mode": mode, "seq": seq, "error": record.get("error")})
            print(json.dumps(report["trials"][-1]), file=sys.stderr, flush=True)
            write()
            return bool(record.get("ok"))

        report["results"][mode] = search(
            run, start=opts.start, factor=opts.factor, resolution=opts.resolution, budget_s=opts.budget_s
        )
        write()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
