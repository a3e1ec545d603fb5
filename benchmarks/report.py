"""The harness's outputs: ratios to the non-private record, the markdown report, and both result files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from timing import fmt, table, table_row


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Each record's step time, memory and throughput relative to its workload's non-private record."""
    base = {r["workload"]: r for r in records if r["mode"] == "nonprivate" and r["ok"]}
    for r in records:
        b = base.get(r["workload"])
        ok = r["ok"] and b is not None
        r["time_vs_nonprivate"] = r["step_s_median"] / b["step_s_median"] if ok else None
        r["throughput_vs_nonprivate"] = b["step_s_median"] / r["step_s_median"] if ok else None
        peak, base_peak = r.get("peak_mem_gib"), (b or {}).get("peak_mem_gib")
        r["mem_vs_nonprivate"] = peak / base_peak if ok and peak and base_peak else None


# (header, key, format) of the numeric columns of the two tables
RECORD_NUMBERS = (
    ("step s (median)", "step_s_median", ".4f"),
    ("examples/s", "examples_per_s", ".1f"),
    ("tokens/s", "tokens_per_s", ".0f"),
    ("peak GiB", "peak_mem_gib", ".2f"),
    ("peak reserved GiB", "peak_reserved_gib", ".2f"),
    ("max batch", "max_batch", "d"),
    ("time vs non-private", "time_vs_nonprivate", ".2f"),
    ("memory vs non-private", "mem_vs_nonprivate", ".2f"),
)
CHECK_NUMBERS = (
    ("l2 relative diff", "l2_rel_diff", ".2e"),
    ("max relative diff", "max_rel_diff", ".2e"),
    ("max abs diff", "max_abs_diff", ".2e"),
    ("tolerance", "tolerance_l2_rel", ".0e"),
)


def _numbers(row: dict[str, Any], columns: tuple[tuple[str, str, str], ...]) -> list[str]:
    return [fmt(row.get(key), spec) for _, key, spec in columns]


def _headers(columns: tuple[tuple[str, str, str], ...]) -> list[str]:
    return [header for header, _, _ in columns]


def _records(records: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in records:
        status = "ok" if r["ok"] else ("skipped: " if r.get("skipped") else "failed: ") + r.get("error", "")[:80]
        if r["ok"] and "per_example_gradients" in r:
            status += f" ({r['per_example_gradients']})"
        mode = r["mode"] + (f" (microbatch {r['microbatch']})" if r.get("microbatch") else "")
        batch = f"{r['batch']} x {r['seq']}"
        rows.append([r["workload"], mode, batch, *_numbers(r, RECORD_NUMBERS), status.replace("|", "/")])
    return table(["workload", "mode", "batch x seq", *_headers(RECORD_NUMBERS), "status"], rows)


def _checks(checks: list[dict[str, Any]]) -> list[str]:
    rows = []
    for c in checks:
        result = "pass" if c["ok"] else ("skipped: " if c.get("skipped") else "FAIL ") + c.get("error", "")[:80]
        rows.append([c["workload"], c["reference"], *_numbers(c, CHECK_NUMBERS), result.replace("|", "/")])
    return table(["workload", "reference", *_headers(CHECK_NUMBERS), "result"], rows)


def _phases(phases: list[dict[str, Any]]) -> list[str]:
    lines = table(["workload", "phase", "host ms", "GPU span ms", "kernel ms"], [])
    for p in phases:
        if not p["ok"]:
            lines.append(f"| {p['workload']} | failed: {p.get('error', '')[:80]} | | | |")
            continue
        for name, row in sorted(p["phases"].items()):
            cells = [p["workload"], name, f"{row['host_ms']:.2f}", f"{row['gpu_span_ms']:.2f}"]
            lines.append(table_row([*cells, f"{row['kernel_ms']:.2f}"]))
        extra = [
            ("step, unprofiled (median)", p["step_ms_unprofiled"]),
            ("per-example grads only (vmap grad, plain sum)", p["per_example_grads_ms"]),
        ]
        lines += [f"| {p['workload']} | {name} | {value:.2f} | | |" for name, value in extra]
    return lines


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    lines = [
        f"# Opake benchmark ({meta['date_utc']})",
        "",
        f"Device: {meta['device']}; CUDA {meta['cuda']}; {versions}; commit {meta['git_commit']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        *_records(report["records"]),
        "",
        "## Same-batch clipped sum (noise off)",
        "",
        *_checks(report["checks"]),
    ]
    if report["phases"]:
        lines += ["", "## Phase breakdown of the opake_core step (ms per step)", "", *_phases(report["phases"])]
        lines += [
            "",
            f"Accounting: one epsilon query (PLD, 1000 Poisson steps, host) takes {report['accounting_query_ms']:.1f} "
            "ms; DPTrainer asks it at logging and checkpoint steps only."
            if report.get("accounting_query_ms") is not None
            else "Accounting: not measured yet (the query runs after the last workload).",
        ]
    return "\n".join(lines) + "\n"


def write_results(report: dict[str, Any], out: Path) -> None:
    """Write ``results.json`` and ``results.md`` (called after every record, so a killed run keeps what finished)."""
    add_ratios(report["records"])
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "results.md").write_text(markdown(report))
