"""The results table of docs/testing-and-auditing.md: one-run audits of correct mechanisms and of planted leaks.

Usage: ``python benchmarks/audit_table.py [--seeds 10] [--quick] [--only NAME,...]``. Prints one JSON line per row
with every seed's numbers, the markdown table, then a table of flag rates on simulated observations by number of
canaries. CPU only, single-threaded torch (about twenty-five minutes on two cores; ``--quick``, 2 seeds and 20
simulations, about four minutes). The rows ``dpsgd4smallq`` and ``leak15smallq`` (q = 0.002, 20,000 steps, about 8
minutes each) run only when named in ``--only``. Rows with 10,000 to 50,000 canaries cost seconds per seed: the core
step forms the canaries' gradients with ``opake_torch.auditing.DiracGradients``, in proportion to the batch.

Every row trains the same small model, for real, with the core step (``opake_torch.auditing.audit_dirac_run``) or
``DPTrainer`` (``audit_trainer_dirac``): an MLP 16-32-10 on 1,000 generated examples, plus one row per canary slot.
Canaries are Dirac gradient canaries of raw norm 100 C (clipped to C by a correct run) unless the row says input-space.
The claim is DP-SGD with Poisson sampling (q = 0.2 of the rows, 200 steps, C = 1) with the noise multiplier
calibrated by the library's accountant to the stated epsilon at delta = 1e-5, or BandMF (4 bands, cyclic Poisson,
conditional rate 0.2, 200 steps). Planted leaks keep the claim and change one piece of the step (in this file only):

* ``noise / 1.5`` and ``noise / 2``: the Gaussian mechanism is built with the multiplier divided by 1.5 or 2;
* ``DDP per-rank noise``: four simulated ranks each clip their shard of the batch and add noise of std
  ``z C / (B W)`` to it, thinking the noise is averaged over the ``W = 4`` ranks; the shards are summed, so the total
  noise std is ``z C / (B sqrt(W))``, half the claimed one (the correct per-rank std is ``z C / (B sqrt(W))``, or
  one rank adds ``z C / B`` after the sum);
* ``clipping skipped``: the first example of every batch, in the shuffled order a data loader yields, is summed
  without clipping.

Columns: the f-DP lower bound (Mahloujifar, Melis and Chaudhuri 2025, Gaussian curves, one guess set chosen in advance
from simulations of the claim) as the mean [min, max] over seeds and as a fraction of the theoretical epsilon; the
epsilon-point bound of Steinke, Nasr and Jagielski (2023) on the same scores (mean); how many seeds were flagged
(f-DP bound above the claimed epsilon at confidence 0.95) and in how many the claimed mechanism's exact PLD curve was
rejected at confidence 0.95.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from opake_core import accounting, mf, random
from opake_core.auditing import (
    audit_claim,
    fdp_audit,
    likelihood_ratio_scores,
    process_tradeoff,
    simulate_dirac_observations,
)
from opake_core.clipping import clipped_grad
from opake_core.noise import gaussian_noise
from opake_core.optim import apply_updates
from opake_core.step import dp_sgd
from opake_core.tree import Clipped, Noised
from opake_torch.auditing import audit_core_run, audit_dirac_run, dirac_canaries, make_canaries, planned_guess_sets

D, H, K = 16, 32, 10
N_REAL = 1000
Q, STEPS, CLIP, DELTA = 0.2, 200, 1.0, 1e-5
SMALL_Q, SMALL_Q_STEPS = 0.002, 20_000  # the regime of large-scale training: a small rate, many steps, z below 1
CANARY_NORM = 100.0


def params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(D, H, generator=g) / D**0.5,
        "b1": torch.zeros(H),
        "w2": torch.randn(H, K, generator=g) / H**0.5,
    }


def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((torch.relu(x @ p["w1"] + p["b1"]) @ p["w2"])[None], y[None])


def data(n: int = N_REAL) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)


def dpsgd_multiplier(epsilon: float, sample_rate: float = Q, steps: int = STEPS) -> float:
    """The multiplier the library's accountant gives for DP-SGD with Poisson sampling."""
    return accounting.calibrate_noise_multiplier(
        lambda z: accounting.repeat(accounting.poisson(accounting.gaussian(z), sample_rate), steps),
        target_epsilon=epsilon,
        delta=DELTA,
    ).value


def bandmf_multiplier(epsilon: float, rows: int, bands: int) -> float:
    from opake_core import sampling

    concrete = mf.optimize(mf.band_mf(bands=bands), STEPS)
    sampler = sampling.cyclic_poisson(dataset_size=rows, sample_rate=Q / bands, bands=bands)
    return accounting.calibrate_noise_multiplier(
        lambda z: accounting.mf_process(concrete, sampler=sampler, noise_multiplier=z, n_steps=STEPS),
        target_epsilon=epsilon,
        delta=DELTA,
    ).value


# -- planted leaks: each replaces one piece of the step and keeps the claim -------------------------------------------


def scaled_noise(z: float, factor: float) -> Callable[..., Any]:
    def mechanism(loss_fn, *, optimizer, expected_batch_size, key, engine):
        return dp_sgd(
            loss_fn,
            clipping_norm=CLIP,
            noise_multiplier=z / factor,
            key=key,
            optimizer=optimizer,
            expected_batch_size=expected_batch_size,
            engine=engine,
        )

    return mechanism


def ddp_per_rank_noise(z: float, world_size: int = 4) -> Callable[..., Any]:
    """Every rank noises its own shard with std ``z C / (B W)`` (the bug: it should be ``/ sqrt(W)``), then the
    shards are summed."""

    def mechanism(loss_fn, *, optimizer, expected_batch_size, key, engine):
        grad_fn, clip_state = clipped_grad(
            loss_fn, clipping_norm=CLIP, batch_argnums=slice(1, None), normalize_by=expected_batch_size, engine=engine
        )
        ranks = [
            gaussian_noise(noise_multiplier=z / world_size, key=random.fold_in(key, "rank", r))
            for r in range(world_size)
        ]

        def step_fn(p, opt_state, states, batch):
            total, new_states, sensitivity = None, [], None
            for r, (noise_fn, _) in enumerate(ranks):
                clipped, _ = grad_fn(p, *(t[r::world_size] for t in batch), state=clip_state)
                noised, state = noise_fn(clipped, states[r])
                new_states.append(state)
                sensitivity = noised.sensitivity
                total = noised.value if total is None else {k: total[k] + noised.value[k] for k in total}
            summed = Noised(total, sensitivity, z * sensitivity / math.sqrt(world_size))
            updates, opt_state = optimizer.update(summed, opt_state, params=p)
            return apply_updates(p, updates), opt_state, new_states, None

        return step_fn, [state for _, state in ranks]

    return mechanism


def first_example_unclipped(z: float) -> Callable[..., Any]:
    """The first example of each batch (in a shuffled order) is summed without clipping."""

    def mechanism(loss_fn, *, optimizer, expected_batch_size, key, engine):
        grad_fn, clip_state = clipped_grad(
            loss_fn, clipping_norm=CLIP, batch_argnums=slice(1, None), normalize_by=expected_batch_size, engine=engine
        )
        noise_fn, noise_state = gaussian_noise(noise_multiplier=z, key=key)
        raw = torch.func.grad(loss_fn)

        def step_fn(p, opt_state, state, batch):
            step, noise = state
            order = random.numpy_generator(random.fold_in(key, "shuffle", step)).permutation(len(batch[0]))
            order = torch.as_tensor(order, dtype=torch.long)
            clipped, _ = grad_fn(p, *(t[order[1:]] for t in batch), state=clip_state)
            value = clipped.value
            if len(order):
                g = raw(p, *(t[order[0]] for t in batch))
                value = {k: value[k] + g[k] / expected_batch_size for k in value}
            noised, noise = noise_fn(Clipped(value, clipped.sensitivity), noise)
            updates, opt_state = optimizer.update(noised, opt_state, params=p)
            return apply_updates(p, updates), opt_state, (step + 1, noise), None

        return step_fn, (0, noise_state)

    return mechanism


# -- rows --------------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    threat: str
    canaries: int
    theoretical: float
    seconds: float = 0.0
    tight: list[float] = field(default_factory=list)  # f-DP bound, one planned guess set
    robust: list[float] = field(default_factory=list)  # f-DP bound, the robust plan (two sets, Bonferroni)
    steinke: list[float] = field(default_factory=list)
    rejected: list[bool] = field(default_factory=list)  # exact claimed curve rejected (robust plan)


def evaluate(row: Row, report: Any, key: random.Key, curve: Any) -> None:
    """Add one run to ``row``: the f-DP bound under both guess plans, the Steinke et al. bound, the exact test."""
    row.theoretical = report.theoretical_epsilon
    row.tight.append(report.fdp.epsilon)
    sets, weights = planned_guess_sets(
        random.fold_in(key, "opake.audit.plan"),
        plan="robust",
        score=report.score,
        num_canaries=len(report.scores),
        **report.plan,
    )
    robust = fdp_audit(report.scores, report.included, delta=DELTA, guess_sets=sets, weights=weights)
    row.robust.append(robust.epsilon)
    row.steinke.append(report.steinke.epsilon)
    if curve is not None:
        claim = audit_claim(report.scores, report.included, tradeoff=curve, guess_sets=sets, weights=weights)
        row.rejected.append(claim.rejected)


def dirac_row(
    name, claimed, seeds, *, observe="all", m=1000, leak=None, strategy=None, n_real=N_REAL, q=Q, steps=STEPS
) -> Row:
    rows = n_real + m
    z = dpsgd_multiplier(claimed, q, steps) if strategy is None else bandmf_multiplier(claimed, rows, strategy)
    row = Row(name, "white-box, all iterates" if observe == "all" else "final model", m, math.nan)
    start, curve = time.time(), None
    for seed in range(seeds):
        key = random.key(1000 + seed)
        canaries = dirac_canaries(key=key, num_canaries=m, gradient_norm=CANARY_NORM * CLIP)
        report = audit_dirac_run(
            loss,
            params(),
            data(n_real),
            canaries,
            key=key,
            noise_multiplier=z,
            clipping_norm=CLIP,
            steps=steps,
            sample_rate=q if strategy is None else q / strategy,
            strategy=None if strategy is None else mf.band_mf(bands=strategy),
            delta=DELTA,
            observe=observe,
            guess_plan="tight",
            mechanism=None if leak is None else leak(z),
        )
        curve = curve or process_tradeoff(report.claim)
        evaluate(row, report, key, curve)
    row.seconds = time.time() - start
    return row


def input_space_row(claimed, seeds, *, observe) -> Row:
    z = dpsgd_multiplier(claimed)
    threat = "white-box, all iterates" if observe == "all" else "final model (loss drop)"
    row = Row("DP-SGD, Poisson, input-space canaries", threat, 1000, math.nan)
    start = time.time()
    for seed in range(seeds):
        key = random.key(2000 + seed)
        canaries = make_canaries(key=key, num_canaries=1000, num_features=D, num_classes=K, scale=3.0)
        report = audit_core_run(
            loss,
            params(),
            data(),
            canaries,
            key=key,
            noise_multiplier=z,
            clipping_norm=CLIP,
            steps=STEPS,
            sample_rate=Q,
            score="gradient" if observe == "all" else "loss_drop",
            observe=observe,
            delta=DELTA,
        )
        row.theoretical = report.theoretical_epsilon
        row.robust.append(report.fdp.epsilon)  # the default sweep of eight guess sets
        row.steinke.append(report.result.epsilon)
    row.seconds = time.time() - start
    return row


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=48,
        max_position_embeddings=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config)


def token_rows(n: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 10, (1,), generator=gen))
        rows.append(
            {
                "input_ids": torch.randint(1, 48, (length,), generator=gen),
                "label": int(torch.randint(0, 3, (1,), generator=gen)),
            }
        )
    return rows


def trainer_row(claimed, seeds) -> Row:
    import tempfile

    from opake_torch.auditing import audit_trainer_dirac
    from opake_torch.transformers import TrainingArguments

    real, m, steps = 500, 1000, 100
    row = Row("DP-SGD, Poisson, in DPTrainer (tiny BERT, 500 rows, 100 steps)", "white-box, all iterates", m, math.nan)
    start, curve = time.time(), None
    for seed in range(seeds):
        args = TrainingArguments(
            tempfile.mkdtemp(),
            per_device_train_batch_size=round(Q * (real + m)),
            max_steps=steps,
            privacy_target_epsilon=claimed,
            privacy_target_delta=DELTA,
            use_cpu=True,
            disable_tqdm=True,
            save_strategy="no",
            report_to="none",
            logging_steps=10**6,
            optim="sgd",
            learning_rate=0.05,
            lr_scheduler="constant",
            clipping_norm=CLIP,
            privacy_noise_seed=seed,
        )
        key = random.key(3000 + seed)
        report = audit_trainer_dirac(
            tiny_bert(),
            args,
            token_rows(real),
            key=key,
            num_canaries=m,
            gradient_norm=CANARY_NORM * CLIP,
            guess_plan="tight",
        )
        curve = curve or process_tradeoff(report.claim)
        evaluate(row, report, key, curve)
    row.seconds = time.time() - start
    return row


def _spread(values: list[float]) -> str:
    v = np.array(values)
    return f"{v.mean():.2f} [{v.min():.2f}, {v.max():.2f}]"


def markdown(rows: list[Row]) -> str:
    lines = [
        "| mechanism | ε (accountant) | threat model | canaries | f-DP bound, tight plan: mean [min, max] | "
        "mean / ε | flagged | f-DP bound, robust plan: mean [min, max] | flagged | exact curve rejected | "
        "Steinke et al. bound (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tight = r.tight and f"{_spread(r.tight)} | {np.mean(r.tight) / r.theoretical:.0%} | " + (
            f"{sum(b > r.theoretical for b in r.tight)} / {len(r.tight)}"
        )
        robust_flags = f"{sum(b > r.theoretical for b in r.robust)} / {len(r.robust)}"
        rejected = f"{sum(r.rejected)} / {len(r.rejected)}" if r.rejected else "n/a"
        lines.append(
            f"| {r.name} | {r.theoretical:.2f} | {r.threat} | {r.canaries:,} | {tight or 'n/a | n/a | n/a'} | "
            f"{_spread(r.robust)} | {robust_flags} | {rejected} | {np.mean(r.steinke):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="")
    a = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("opake_torch.transformers.keys").setLevel(logging.ERROR)  # the seeded keys' warning
    seeds = 2 if a.quick else a.seeds
    claim = 4.0
    dpsgd, bandmf = "DP-SGD, Poisson", "DP-FTRL, BandMF (4 bands), cyclic Poisson"
    plans: dict[str, Callable[[], Row]] = {
        "dpsgd2": lambda: dirac_row(dpsgd, 2.0, seeds),
        "dpsgd4": lambda: dirac_row(dpsgd, 4.0, seeds),
        "dpsgd8": lambda: dirac_row(dpsgd, 8.0, seeds),
        "dpsgd4final": lambda: dirac_row(dpsgd, 4.0, seeds, observe="final"),
        "dpsgd8final": lambda: dirac_row(dpsgd, 8.0, seeds, observe="final"),
        "bandmf": lambda: dirac_row(bandmf, 4.0, seeds, strategy=4),
        "bandmffinal": lambda: dirac_row(bandmf, 4.0, seeds, strategy=4, observe="final"),
        "input": lambda: input_space_row(8.0, seeds, observe="all"),
        "inputfinal": lambda: input_space_row(8.0, seeds, observe="final"),
        "trainer": lambda: trainer_row(4.0, seeds),
        "leak15": lambda: dirac_row("leak: noise / 1.5", claim, seeds, leak=lambda z: scaled_noise(z, 1.5)),
        "leak2": lambda: dirac_row("leak: noise / 2", claim, seeds, leak=lambda z: scaled_noise(z, 2.0)),
        "ddp": lambda: dirac_row("leak: DDP per-rank noise (4 ranks)", claim, seeds, leak=ddp_per_rank_noise),
        "clip": lambda: dirac_row("leak: clipping skipped for one example", claim, seeds, leak=first_example_unclipped),
        "clipsmallbatch": lambda: dirac_row(
            "leak: clipping skipped for one example, q = 0.02, 2,000 steps",
            claim,
            seeds,
            leak=first_example_unclipped,
            q=0.02,
            steps=2000,
        ),
        "dpsgd4smallq": lambda: dirac_row(
            "DP-SGD, Poisson, q = 0.002, 20,000 steps", claim, seeds, q=SMALL_Q, steps=SMALL_Q_STEPS
        ),
        "leak15smallq": lambda: dirac_row(
            "leak: noise / 1.5, q = 0.002, 20,000 steps",
            claim,
            seeds,
            leak=lambda z: scaled_noise(z, 1.5),
            q=SMALL_Q,
            steps=SMALL_Q_STEPS,
        ),
        "leak15big": lambda: dirac_row(
            "leak: noise / 1.5", claim, seeds, m=10_000, leak=lambda z: scaled_noise(z, 1.5)
        ),
        "leak15huge": lambda: dirac_row(
            "leak: noise / 1.5", claim, seeds, m=20_000, leak=lambda z: scaled_noise(z, 1.5)
        ),
        "dpsgd4huge": lambda: dirac_row(dpsgd, claim, seeds, m=20_000),
        "leak15m50k": lambda: dirac_row(
            "leak: noise / 1.5", claim, seeds, m=50_000, leak=lambda z: scaled_noise(z, 1.5)
        ),
        "dpsgd4m50k": lambda: dirac_row(dpsgd, claim, seeds, m=50_000),
    }
    slow = ("dpsgd4smallq", "leak15smallq")  # 20,000 steps
    chosen = [k for k in a.only.split(",") if k] or [k for k in plans if k not in slow]
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread", flush=True)
    rows = []
    for name in chosen:
        row = plans[name]()
        rows.append(row)
        print(json.dumps({"row": name, **row.__dict__}, default=float), flush=True)
    print(markdown(rows))
    if not a.only:
        print()
        print(power_table(claim, trials=20 if a.quick else 100))


def power_table(claimed: float, trials: int) -> str:
    """How often the f-DP flag fires on simulated all-iterates observations of DP-SGD (the claim of the leak rows:
    q = 0.2, 200 steps), by number of canaries and leak: exactly the observations a correct Dirac-canary run
    produces (the real rows above check the match), with the noise divided by the leak factor."""
    z = dpsgd_multiplier(claimed)
    lines = [
        f"| canaries | leak | flagged, tight plan (of {trials}) | flagged, robust plan (of {trials}) |",
        "|---|---|---|---|",
    ]
    for m in (1000, 5000, 20_000, 50_000):
        plan_key = random.key(7)
        score = "likelihood_ratio"
        common = {"score": score, "num_canaries": m, "steps": STEPS, "sample_rate": Q, "noise_multiplier": z}
        tight, _ = planned_guess_sets(plan_key, plan="tight", **common)
        robust, weights = planned_guess_sets(plan_key, plan="robust", **common)
        for factor in (1.0, 1.5, 2.0):
            flags = [0, 0]
            for i in range(trials):
                x, included = simulate_dirac_observations(
                    random.key(10_000 + i), num_canaries=m, steps=STEPS, sample_rate=Q, noise_multiplier=z / factor
                )
                scores = likelihood_ratio_scores(x, noise_multiplier=z, sample_rate=Q)
                flags[0] += fdp_audit(scores, included, delta=DELTA, guess_sets=tight).flags(claimed)
                flags[1] += fdp_audit(scores, included, delta=DELTA, guess_sets=robust, weights=weights).flags(claimed)
            name = "none (correct)" if factor == 1.0 else f"noise / {factor:g}"
            lines.append(f"| {m:,} | {name} | {flags[0]} | {flags[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
