"""``benchmarks/kernels_e2e.py`` on its tiny CPU configuration: every row runs, and the outputs are well formed.

On CPU the performance kernels are off (nothing is patched) and the fused clip falls back to the torch path, so this
checks the driving code, not the kernels. Timings are not compared: they depend on the machine and its load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_e2e.py"
CONFIGS = [
    "non-private",
    "kernels off, torch clip",
    "kernels off, fused clip",
    "kernels on, fused clip",
    "layerwise, kernels off",
    "layerwise, kernels on",
]


def _run(*flags: str) -> tuple[dict, subprocess.CompletedProcess]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny CPU ops: threads only add contention
    command = [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("kernels_e2e")
    result, _ = _run("--steps", "2", "--warmup", "1", "--clip-repeats", "2", "--out", str(out))
    return result, out


def test_every_config_runs_on_cpu(report: tuple[dict, Path]) -> None:
    result, _ = report
    rows = result["rows"]
    assert [(r["seq"], r["config"]) for r in rows] == [(16, c) for c in CONFIGS]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["batch"] == 2
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["time_vs_nonprivate"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / r["step_s"])
        assert r["peak_gib"] is None and r["mem_vs_nonprivate"] is None  # CPU: no CUDA allocator statistics
    assert rows[0]["time_vs_nonprivate"] == 1.0 and rows[0]["microbatch"] is None
    for r in rows[1:]:
        assert r["microbatch"] == 2
        assert r["kernels_applied"] == []  # CPU: the kernels are off, whatever was asked


def test_clip_phase_on_the_lora_leaves(report: tuple[dict, Path]) -> None:
    result, _ = report
    (clip,) = result["clip"]
    assert clip["status"] == "ok", clip
    assert clip["m"] == 2
    assert clip["leaves"] == 2 * 7 * 2  # lora_A and lora_B on 7 linear layers of 2 blocks
    assert clip["elements_per_example"] > 0
    assert clip["torch_ms"] > 0 and clip["fused_ms"] > 0 and clip["speedup"] > 0
    assert clip["fused_backend"].startswith("torch")


def test_written_results_match_stdout(report: tuple[dict, Path]) -> None:
    result, out = report
    assert json.loads((out / "results.json").read_text()) == result
    assert result["meta"]["config"]["hidden_size"] == 64 and result["meta"]["kernels_available"] is False
    text = (out / "results.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| seq | config |"))
    table = [line for line in text.splitlines() if line.startswith("| 16 | ")]
    assert len(table) == len(CONFIGS) + 1
    assert all(line.count("|") == header.count("|") for line in table)
    assert "Clip phase alone" in text


def test_spent_budget_skips_and_still_reports() -> None:
    result, _ = _run("--budget-s", "0")
    assert [r["status"] for r in result["rows"]] == ["skipped: time budget"] * len(CONFIGS)
    assert result["clip"][0]["status"] == "skipped: time budget"
