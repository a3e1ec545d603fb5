"""The benchmark harness on its tiny CPU suite: well-formed outputs and a passing same-batch clipped-sum check; the
end-to-end trainer benchmark (``benchmarks/e2e_trainer.py``) on its tiny workloads.

Timings are not asserted: they depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py"
E2E_TRAINER = HARNESS.with_name("e2e_trainer.py")
MODES = (
    "nonprivate",
    "opacus_hooks",
    "opacus_ghost",
    "opake_core",
    "opake_trainer",
    "opake_trainer_kernels",
    "opake_trainer_graphs",
)
WORKLOADS = ("tiny_bert_s16_b4", "tiny_llama_lora4_s16_b4", "tiny_gpt2_s16_b4")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench")
    command = [
        sys.executable,
        str(HARNESS),
        "--suite",
        "smoke",
        "--out",
        str(out),
        "--steps",
        "2",
        "--profile",
        "--profile-steps",
        "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_one_record_per_workload_and_mode(report: tuple[dict, str]) -> None:
    results, _ = report
    pairs = [(r["workload"], r["mode"]) for r in results["records"]]
    assert pairs == [(w, m) for w in WORKLOADS for m in MODES]
    for r in results["records"]:
        if r["mode"] in ("opacus_hooks", "opacus_ghost") and r.get("skipped"):
            assert r["error"] == "opacus not installed"
            continue
        if r["mode"] == "opake_trainer_graphs":  # CPU
            assert r["skipped"] and r["error"] == "CUDA graphs need a CUDA device"
            continue
        assert r["ok"], r
        assert r["step_s_median"] > 0 and r["steps_timed"] == 2
        assert r["tokens_per_s"] == pytest.approx(r["examples_per_s"] * r["seq"])
        assert r["time_vs_nonprivate"] > 0
        assert r["peak_mem_gib"] is None and r["peak_reserved_gib"] is None  # CPU: no CUDA allocator statistics


def test_clipped_sum_matches_reference(report: tuple[dict, str]) -> None:
    results, _ = report
    assert [c["workload"] for c in results["checks"]] == list(WORKLOADS)
    for check in results["checks"]:
        assert check["ok"], check
        assert check["reference"] in ("opacus_hooks", "float64_loop")
        assert check["leaves_compared"] > 0 and not check["leaves_unmatched"]
        assert check["l2_rel_diff"] <= check["tolerance_l2_rel"]
    core = [r for r in results["records"] if r["mode"] == "opake_core"]
    assert all(any(k.startswith("clipped_sum_max_rel_diff_vs_") for k in r) for r in core)


def test_phase_breakdown_names_the_core_labels(report: tuple[dict, str]) -> None:
    results, _ = report
    assert results["accounting_query_ms"] > 0
    for phases in results["phases"]:
        assert phases["ok"], phases
        names = set(phases["phases"])
        assert {"opake::dp_step", "opake::clipped_grad", "opake::gaussian_noise"} <= names
        assert any(name.startswith("opake::optim.") for name in names)
        assert phases["per_example_grads_ms"] > 0


def test_meta_and_markdown(report: tuple[dict, str]) -> None:
    results, text = report
    meta = results["meta"]
    assert meta["device"] and meta["date_utc"] and meta["versions"]["torch"]
    table = [line for line in text.splitlines() if line.startswith("| tiny_")]
    header = next(line for line in text.splitlines() if line.startswith("| workload | mode |"))
    assert all(line.count("|") == header.count("|") for line in table[: len(WORKLOADS) * len(MODES)])
    for workload in WORKLOADS:
        assert f"| {workload} | opake_core" in text
    assert "Same-batch clipped sum" in text and "Phase breakdown" in text


def test_e2e_trainer_tiny_in_process(tmp_path: Path) -> None:
    """``trainer.train()`` of HF's Trainer and DPTrainer on the tiny workloads: every row runs and has a finite step
    time and a finite ratio to its ``hf`` row (memory is not measured on CPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny CPU ops: threads only add contention
    modes = ("hf", "dp", "dp_q1", "dp_fixed", "dp_user4")
    command = [sys.executable, str(E2E_TRAINER), "--tiny", "--in-process", "--modes", *modes, "--out", str(tmp_path)]
    command += ["--profile-steps", "1"]  # one more step per row, profiled
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    records = results["records"]
    assert [(r["workload"], r["mode"]) for r in records] == [(w, m) for w in WORKLOADS for m in modes]
    for r in records:
        assert r["ok"], r
        assert r["steps_timed"] == results["settings"]["steps"]
        for key in ("step_s_mean", "step_s_median", "time_vs_baseline", "median_time_vs_baseline"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["baseline"] == "hf" and r["peak_gib"] is None  # CPU: no CUDA allocator statistics
        if r["mode"] == "hf":
            assert r["time_vs_baseline"] == 1.0 and r["sampling_rate"] is None
        else:
            sampler = "fixed_size" if r["mode"] == "dp_fixed" else "poisson"
            assert r["engine"] in ("layerwise", "vmap") and r["sampling_mode"] == sampler
            assert r["sampling_rate"] == (1.0 if r["mode"] == "dp_q1" else 0.01)
            assert r["diagnostic"] == (r["mode"] == "dp_q1")
            assert r["profile"]["opake_ranges_host_ms"]["opake::clipped_grad"] > 0  # the private step's ranges
        assert r["profile"]["steps"] == 1 and r["profile"]["host_ops_per_step"] > 0
        assert r["profile"]["kernels_per_step"] == 0  # CPU: no GPU kernels
    text = (tmp_path / "results.md").read_text()
    assert text.count("| ok |") == len(records) and "dp_q1 (diagnostic)" in text
    profile = text.split("Profile of the steps after the timed ones", 1)[1]  # its table: a row per profiled row
    assert all(f"| {r['workload']} | {r['mode']} |" in profile for r in records)
    sys.path.insert(0, str(E2E_TRAINER.parent))
    from e2e_trainer import markdown  # a compiled row that fell back to eager says so in its status

    fell_back = records[1]
    fell_back["compile_fallback"] = ["torch.compile(backend='inductor') failed for 'chunk'; running it eagerly"]
    start = f"| {fell_back['workload']} | {fell_back['mode']} |"
    row = next(line for line in markdown(results).splitlines() if line.startswith(start))
    assert "| ok, ran eagerly: torch.compile" in row and text.count("ran eagerly") == 0


def test_e2e_trainer_passes_the_workload_knobs_to_both_trainers(tmp_path: Path) -> None:
    """A workload's ``trainer_args`` (gradient checkpointing and bf16 on a full fine-tune) reach both trainers:
    HF's Trainer checkpoints the model's layers, and DPTrainer serves the run with the layerwise engine."""
    command = [sys.executable, str(E2E_TRAINER), "--tiny", "--in-process", "--modes", "hf", "dp"]
    command += ["--out", str(tmp_path), "--workloads", "tiny_llama_full_s16_b4_ckpt", "--seq", "12", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert [r["mode"] for r in records] == ["hf", "dp"] and all(r["ok"] for r in records), records
    for r in records:
        assert r["seq"] == 12 and r["trainer_args"] == {"gradient_checkpointing": True, "bf16": True}
    assert records[1]["engine"] == "layerwise"


def test_kernel_owners_name_the_engine_functions_that_launched_them(tmp_path: Path) -> None:
    """``--kernel-owners`` (on a CPU: operators named exactly so) attributes each launch to the Opake frames that made
    it: the private step's batched matmuls come from the layerwise engine's norms and sums."""
    command = [sys.executable, str(E2E_TRAINER), "--tiny", "--in-process", "--modes", "dp", "--out", str(tmp_path)]
    command += ["--workloads", "tiny_llama_full_s16_b4_ckpt", "--steps", "1", "--profile-steps", "1"]
    command += ["--kernel-owners", "aten::bmm"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = json.loads((tmp_path / "results.json").read_text())["records"]
    owners = record["profile"]["kernel_owners"]
    assert owners and all(row["kernel"] == "aten::bmm" and row["calls"] > 0 for row in owners), owners
    frames = " ".join(row["frames"] for row in owners)
    assert "opake_torch/layerwise/ghost.py" in frames and "opake_torch/layerwise/precision.py" in frames, frames


def test_the_moe_workload_runs_its_routers_and_experts_on_the_layerwise_engine(tmp_path) -> None:
    """The mixture-of-experts workload (a full fine-tune, routers and stacked experts included) runs on both
    trainers, the private one on the layerwise engine."""
    command = [sys.executable, str(E2E_TRAINER), "--tiny", "--in-process", "--modes", "hf", "dp"]
    command += ["--out", str(tmp_path), "--workloads", "tiny_qwen3moe_full_s16_b4", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert [(r["mode"], r["ok"], r["engine"]) for r in records] == [("hf", True, "autograd"), ("dp", True, "layerwise")]


def test_max_sequence_search_brackets_the_limit() -> None:
    """The search of ``max_sequence.py`` against a known limit: the longest length that ran and the shortest that
    failed are one resolution apart around it, whatever the start."""
    sys.path.insert(0, str(HARNESS.parent))
    from max_sequence import search

    for limit, start in ((10_000, 4096), (3000, 4096), (40_000, 1024)):
        tried: list[int] = []

        def run(seq: int, limit: int = limit, tried: list[int] = tried) -> bool:
            tried.append(seq)
            return seq <= limit

        fits, fails = search(run, start=start, factor=1.5, resolution=1024, budget_s=60)
        assert fits is not None and fails is not None
        assert fits <= limit < fails and fails - fits == 1024 and fits % 1024 == 0, (limit, fits, fails, tried)
        assert len(tried) == len(set(tried))  # no length tried twice


def test_the_bf16_experts_baseline_multiplies_hugging_faces_experts_in_bf16() -> None:
    """``hf_bf16_experts``'s autocast rule: under CPU bf16 autocast a tiny Qwen3-MoE model's stacked experts call
    ``torch._grouped_mm`` on bf16 factors with the rule and on float32 ones without it, and the rule goes with its
    library."""
    import gc

    import torch
    from tiny_hf import tiny_moe
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(E2E_TRAINER.parent))
    from e2e_trainer import autocast_grouped_mm

    class Dtypes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[torch.dtype] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default:
                self.seen.update(a.dtype for a in args[:2])
            return func(*args, **(kwargs or {}))

    model = tiny_moe("qwen3_moe", torch.float32).eval()
    model.config._experts_implementation = "grouped_mm"
    ids = torch.randint(1, 32, (2, 8))

    def factors() -> set[torch.dtype]:
        with Dtypes() as mode, torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            model(input_ids=ids)
        return mode.seen

    assert factors() == {torch.float32}
    rule = autocast_grouped_mm("cpu")
    assert factors() == {torch.bfloat16}
    del rule
    gc.collect()
    assert factors() == {torch.float32}
