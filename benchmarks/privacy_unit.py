"""Record-level against user-level privacy on the demo corpus, measured (the tables of ``docs/privacy_unit.md``).

Two measurements, on the CPU, every private run seeded by its noise seed (``privacy_noise_seed``) so that a rerun
gives the same numbers:

1. **Canary exposure both ways.** The demo corpus (:func:`opake_torch.demo.make_user_corpus`): customers with two
   records each, and canaries whose 8 repeats all belong to one user, their owner. The demo model is trained at the
   same target epsilon with ``privacy_unit="record"`` and with ``privacy_unit="user"``, and once without privacy;
   each canary's exposure (Carlini et al. 2019: ``log2(candidates + 1) - log2(rank)`` of its true code among random
   codes; about 1.4 bits on average by chance) is reported as a mean and a max over the canaries, for several noise
   seeds.
2. **ULS against ELS** (Chua et al. 2024, "Mind the Privacy Unit!", arXiv 2406.14322) at the same user-level
   epsilon. The demo's records are dealt to users with a heavy-tailed number of rows (1 to 16, ``P(n) ~ n^-1.5``);
   held-out users' rows measure utility (mean per-row loss in nats per token, and next-token accuracy).

   * ULS: ``privacy_unit="user"``, users Poisson-sampled at ``q_u``, each giving at most ``k`` rows, the mean of a
     user's row gradients clipped to ``C``; the noise is calibrated by the trainer over users.
   * ELS: the dataset capped at the first ``k`` rows of each user, record-level Poisson sampling at the same rate
     (so that a user's capped rows are seen as often), each row clipped to ``C``; the noise multiplier is calibrated
     here so that the *user's* epsilon (a group of ``k`` records: :func:`opake_core.accounting.poisson_group`, the
     exact mixture accounting) meets the target. The group-privacy theorem (``k eps``, ``k e^((k-1) eps) delta``)
     would need the larger multiplier reported beside it.

   Both use the same steps, the same delta (``1 / U^1.1``, ``U`` the training users) and the same model.

Usage::

    python benchmarks/privacy_unit.py            # the full setting (22 minutes on two busy CPU cores)
    python benchmarks/privacy_unit.py --quick    # a smoke test (a minute or two)

The results go to ``benchmarks/privacy_unit_results.json`` (``--out`` to change it) and print as Markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from opake_core import accounting
from opake_torch.demo import CharTokenizer, DemoConfig, _model, make_corpus, train

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Setting:
    """The sizes of one run of this script; :data:`FULL` and :data:`QUICK` are the two used."""

    exposure_demo: DemoConfig  # the demo run of measurement 1 (its target_epsilon and epochs apply to both units)
    noise_seeds: tuple[int, ...]
    users_train: int  # measurement 2: training users, and held-out users for the utility
    users_held_out: int
    max_rows: int  # the most rows a user holds (the counts are 1..max_rows)
    batch_users: int  # the expected users per step (ULS); ELS samples records at the same rate
    epochs: float  # passes over the users
    caps: tuple[int, ...]  # the k compared
    target_epsilons: tuple[float, ...]


EXPOSURE_DEMO = replace(
    DemoConfig(), records=300, canaries=4, candidates=200, hidden_size=32, layers=1, target_epsilon=8.0, epochs=4.0
)
FULL = Setting(EXPOSURE_DEMO, (0, 1, 2), 150, 30, 16, 15, 3.0, (2, 8), (4.0,))
QUICK = Setting(replace(EXPOSURE_DEMO, records=60, canaries=2, candidates=50, epochs=1.0), (0,), 30, 8, 16, 6, 1.0,
                (2,), (4.0,))  # fmt: skip
CALIBRATION_GRID = 1e-3  # the PLD discretization while calibrating (pessimistic: still an upper bound); the
# calibrated multiplier's epsilon is then checked at the default 1e-4


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def exposure_runs(setting: Setting) -> list[dict]:
    """Measurement 1: one row per (unit, noise seed), plus the non-private baseline."""
    rows = []
    for seed in setting.noise_seeds:
        for unit in ("record", "user"):
            config = replace(setting.exposure_demo, privacy_unit=unit, noise_seed=seed)
            rows.append(_exposure_row(config, private=True, unit=unit, seed=seed))
    config = replace(setting.exposure_demo, noise_seed=setting.noise_seeds[0])
    rows.append(_exposure_row(config, private=False, unit="non-private", seed=None))
    return rows


def _exposure_row(config: DemoConfig, *, private: bool, unit: str, seed: int | None) -> dict:
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        result = train(config, Path(folder), private=private)
    row = {
        "unit": unit,
        "noise_seed": seed,
        "epsilon": result["final_epsilon"],
        "delta": result["delta"],
        "noise_multiplier": result["noise_multiplier"],
        "units": result["units"],
        "exposures": result["exposures"],
        "mean_exposure": mean(result["exposures"]),
        "max_exposure": max(result["exposures"]),
        "seconds": time.perf_counter() - begin,
    }
    print(json.dumps(row), flush=True)
    return row


def row_counts(users: int, max_rows: int, rng: np.random.Generator) -> np.ndarray:
    """``[users]`` rows per user, heavy-tailed on ``1..max_rows``: ``P(n) ~ n^-1.5``."""
    n = np.arange(1, max_rows + 1)
    p = n**-1.5
    return rng.choice(n, size=users, p=p / p.sum())


def user_dataset(setting: Setting, seed: int = 0) -> tuple[list[dict], list[dict], np.ndarray]:
    """``(train, held_out, counts)``: the demo's records dealt in order to users with :func:`row_counts` rows, the
    first ``users_train`` users for training (rows ``{"input_ids", "user"}``), the rest held out."""
    rng = np.random.default_rng(seed)
    counts = row_counts(setting.users_train + setting.users_held_out, setting.max_rows, rng)
    corpus = make_corpus(replace(DemoConfig(), records=int(counts.sum()), canaries=0, seed=seed))[0]
    tokenizer = CharTokenizer()
    owners = np.repeat(np.arange(len(counts)), counts)
    rows = [{"input_ids": tokenizer.encode(text), "user": int(u)} for text, u in zip(corpus, owners, strict=True)]
    cut = int(counts[: setting.users_train].sum())
    return rows[:cut], rows[cut:], counts[: setting.users_train]


def capped(rows: list[dict], k: int) -> list[dict]:
    """The first ``k`` rows of each user (ELS trains on these)."""
    seen: dict[int, int] = {}
    kept = []
    for row in rows:
        seen[row["user"]] = seen.get(row["user"], 0) + 1
        if seen[row["user"]] <= k:
            kept.append(row)
    return kept


def els_multipliers(*, sample_rate: float, steps: int, k: int, target_epsilon: float, delta: float) -> dict:
    """The noise multipliers of record-level Poisson sampling at ``sample_rate`` for ``steps`` steps that give a user
    of ``k`` rows ``(target_epsilon, delta)``: exactly (the mixture accounting of :func:`accounting.poisson_group`)
    and through the group-privacy theorem (record-level ``(target / k, delta / (k e^((k - 1) target / k)))``)."""
    g = accounting.gaussian
    exact = accounting.calibrate_noise_multiplier(
        lambda z: accounting.repeat(accounting.poisson_group(g(z), sample_rate, group_size=k), steps),
        target_epsilon=target_epsilon,
        delta=delta,
        max=100.0,
        discretization=CALIBRATION_GRID,
    )
    record_eps = target_epsilon / k
    record_delta = delta / (k * math.exp((k - 1) * record_eps))
    theorem = accounting.calibrate_noise_multiplier(
        lambda z: accounting.repeat(accounting.poisson(g(z), sample_rate), steps),
        target_epsilon=record_eps,
        delta=record_delta,
        max=100.0,
        discretization=CALIBRATION_GRID,
    )
    group = accounting.repeat(accounting.poisson_group(g(exact.value), sample_rate, group_size=k), steps)
    return {
        "noise_multiplier": exact.value,
        "user_epsilon": accounting.epsilon(group, delta=delta).value,
        "theorem_noise_multiplier": theorem.value,
    }


def held_out_metrics(model: torch.nn.Module, rows: list[dict]) -> dict:
    """Mean over held-out rows of each row's mean next-token loss (nats), and the next-token accuracy over all
    their predicted tokens."""
    ids = torch.nn.utils.rnn.pad_sequence([r["input_ids"] for r in rows], batch_first=True, padding_value=0)
    mask = ids != 0
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float()
    targets, live = ids[:, 1:], mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    per_row = (nll * live).sum(1) / live.sum(1)
    correct = (logits.argmax(-1) == targets) & live
    return {"held_out_loss": per_row.mean().item(), "held_out_accuracy": (correct.sum() / live.sum()).item()}


def _train(rows: list[dict], held_out: list[dict], *, batch: int, steps: int, privacy: dict, seed: int) -> dict:
    from opake_torch.transformers import DPTrainer, TrainingArguments

    config = replace(EXPOSURE_DEMO, seed=seed)
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            folder,
            per_device_train_batch_size=batch,
            max_steps=steps,
            learning_rate=config.learning_rate,
            lr_scheduler="constant",
            optim="adam",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
            seed=seed,
            privacy_noise_seed=seed,
            **{"clipping_norm": config.clipping_norm, **privacy},
        )
        trainer = DPTrainer(_model(config, CharTokenizer().vocab_size), args, train_dataset=rows)
        output = trainer.train()
        return {
            "trainer_epsilon": output.metrics.get("privacy_epsilon", math.inf),
            "trainer_delta": trainer.state.privacy_resolved_delta,
            "noise_multiplier": trainer.state.privacy_resolved_noise_multiplier,
            **held_out_metrics(trainer.model, held_out),
        }


def strategy_runs(setting: Setting) -> tuple[list[dict], dict]:
    """Measurement 2: ULS and ELS at each cap ``k`` and target epsilon, plus the non-private model on all rows."""
    rows, held_out, counts = user_dataset(setting)
    users = setting.users_train
    rate = setting.batch_users / users
    steps = math.ceil(setting.epochs / rate)
    delta = users**-1.1
    data = {
        "users": users,
        "rows": len(rows),
        "held_out_users": setting.users_held_out,
        "held_out_rows": len(held_out),
        "rows_per_user": {"mean": float(counts.mean()), "median": float(np.median(counts)), "max": int(counts.max())},
        "sample_rate": rate,
        "steps": steps,
        "delta": delta,
    }
    print(json.dumps(data), flush=True)
    results = []
    for eps in setting.target_epsilons:
        for k in setting.caps:
            begin = time.perf_counter()
            uls = _train(
                rows,
                held_out,
                batch=setting.batch_users,
                steps=steps,
                privacy={
                    "privacy_target_epsilon": eps,
                    "privacy_unit": "user",
                    "privacy_user_column": "user",
                    "privacy_max_rows_per_user": k,
                },
                seed=0,
            )
            results.append({"strategy": "ULS", "k": k, "target_epsilon": eps, "user_epsilon": uls["trainer_epsilon"],
                            **uls, "seconds": time.perf_counter() - begin})  # fmt: skip
            print(json.dumps(results[-1]), flush=True)

            begin = time.perf_counter()
            kept = [{"input_ids": r["input_ids"]} for r in capped(rows, k)]
            batch = max(1, round(rate * len(kept)))  # the trainer's rate is batch / rows: as close to q_u as can be
            noise = els_multipliers(sample_rate=batch / len(kept), steps=steps, k=k, target_epsilon=eps, delta=delta)
            els = _train(kept, held_out, batch=batch, steps=steps,
                         privacy={"privacy_noise_multiplier": noise["noise_multiplier"]}, seed=0)  # fmt: skip
            results.append({"strategy": "ELS", "k": k, "target_epsilon": eps, "rows_kept": len(kept),
                            "record_sample_rate": batch / len(kept), **noise, **els,
                            "seconds": time.perf_counter() - begin})  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
    begin = time.perf_counter()
    everything = [{"input_ids": r["input_ids"]} for r in rows]
    baseline = {"privacy_noise_multiplier": 0.0, "clipping_norm": math.inf}
    plain = _train(everything, held_out, batch=round(rate * len(rows)), steps=steps, privacy=baseline, seed=0)
    results.append({"strategy": "non-private", **plain, "seconds": time.perf_counter() - begin})
    print(json.dumps(results[-1]), flush=True)
    return results, data


def exposure_table(rows: list[dict], max_bits: float) -> str:
    lines = [
        f"| unit | noise seed | epsilon | noise multiplier | mean exposure | max exposure (of {max_bits:.2f} bits) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        seed = "-" if r["noise_seed"] is None else r["noise_seed"]
        lines.append(f"| {r['unit']} | {seed} | {r['epsilon']:.3f} | {r['noise_multiplier']:.3f} | "
                     f"{r['mean_exposure']:.2f} | {r['max_exposure']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def strategy_table(rows: list[dict]) -> str:
    lines = [
        "| target epsilon | strategy | k | user epsilon | noise multiplier | group-theorem multiplier "
        "| held-out loss | held-out accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        theorem = f"{r['theorem_noise_multiplier']:.3f}" if "theorem_noise_multiplier" in r else "-"
        lines.append(f"| {r.get('target_epsilon', '-')} | {r['strategy']} | {r.get('k', '-')} | "
                     f"{r.get('user_epsilon', math.inf):.3f} | {r['noise_multiplier']:.3f} | {theorem} | "
                     f"{r['held_out_loss']:.3f} | {r['held_out_accuracy']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test of a minute or two")
    parser.add_argument("--out", type=Path, default=HERE / "privacy_unit_results.json")
    args = parser.parse_args()
    setting = QUICK if args.quick else FULL
    torch.set_num_threads(2)
    begin = time.perf_counter()
    exposures = exposure_runs(setting)
    strategies, data = strategy_runs(setting)
    result = {
        "command": "python benchmarks/privacy_unit.py" + (" --quick" if args.quick else ""),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}",
        "setting": asdict(setting),
        "exposure": exposures,
        "strategies": {"data": data, "runs": strategies},
        "seconds": time.perf_counter() - begin,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    max_bits = math.log2(setting.exposure_demo.candidates + 1)
    print(exposure_table(exposures, max_bits), "", strategy_table(strategies), sep="\n")
    print(f"wrote {args.out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
