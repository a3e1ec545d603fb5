"""The ``opake`` command line: questions to answer before training.

``opake privacy epsilon|calibrate|steps`` wraps :mod:`opake_core.accounting`. Every command prints one line
for people, or one JSON object with ``--json`` holding the answer and every input it used. Defaults match the
trainer: PLD accountant, Poisson sampler, ``delta = 1 / N**1.1`` when a dataset size is given.

To add a command, write ``_add_<name>(subparsers)`` that registers a parser with
``set_defaults(run=<function>)`` and call it from :func:`build_parser`; ``run(args) -> dict`` returns the
JSON-ready answer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from opake_core import accounting as acc
from opake_core.errors import ConfigurationError, OpakeError
from opake_torch.demo import add_demo_command

__all__ = ["build_parser", "main"]

SAMPLERS = ("poisson", "truncated_poisson", "k_out_of_t")


def _sampling_arguments(parser: argparse.ArgumentParser, *, steps_known: bool = True) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--sample-rate", type=float, help="Poisson rate q in (0, 1] (or give --batch-size)")
    group.add_argument("--batch-size", type=int, help="expected batch size; q = batch_size / dataset_size")
    group.add_argument("--dataset-size", type=int, help="N; also sets the default delta 1/N**1.1")
    if steps_known:
        group.add_argument("--steps", type=int, help="number of training steps (or give --epochs)")
        group.add_argument("--epochs", type=float, help="epochs; steps = ceil(epochs / q)")
    group.add_argument("--sampler", choices=SAMPLERS, default="poisson", help="batch sampler (default poisson)")
    group.add_argument("--truncated-batch-size", type=int, help="cap of truncated_poisson")
    group.add_argument("--k", type=int, help="participations per example for k_out_of_t")
    group.add_argument("--allocation", choices=("block", "total"), help="k_out_of_t allocation")
    group.add_argument("--mc-samples", type=int, default=1_000_000, help="Monte Carlo samples (k_out_of_t)")
    priv = parser.add_argument_group("privacy")
    priv.add_argument("--delta", type=float, help="delta in (0, 1); default 1/N**1.1 with --dataset-size")
    priv.add_argument(
        "--accountant", choices=("pld", "rdp"), default=None, help="default pld (monte_carlo for k_out_of_t)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE", help="write epsilon against steps to a PNG")


def _fail(message: str) -> None:
    raise ConfigurationError(message)


def _sample_rate(args: argparse.Namespace) -> float:
    if args.sample_rate is not None:
        if args.batch_size is not None:
            _fail("give --sample-rate or --batch-size with --dataset-size, not both.")
        return args.sample_rate
    if args.batch_size is None or args.dataset_size is None:
        _fail("the sample rate is missing: give --sample-rate, or --batch-size and --dataset-size.")
    if args.dataset_size < 1 or args.batch_size < 1:
        _fail(f"--batch-size and --dataset-size must be >= 1, got {args.batch_size} and {args.dataset_size}.")
    return args.batch_size / args.dataset_size


def _delta(args: argparse.Namespace) -> float:
    if args.delta is not None:
        return args.delta
    if args.dataset_size is None:
        _fail("delta is missing: give --delta, or --dataset-size for the default 1/N**1.1.")
    if args.dataset_size < 2:
        _fail(f"--dataset-size must be >= 2 for the default delta, got {args.dataset_size}; give --delta.")
    return 1.0 / args.dataset_size**1.1


def _steps(args: argparse.Namespace, q: float) -> int:
    if (args.steps is None) == (args.epochs is None):
        _fail("give exactly one of --steps and --epochs.")
    if args.steps is not None:
        if args.steps < 1:
            _fail(f"--steps must be >= 1, got {args.steps}.")
        return args.steps
    if not math.isfinite(args.epochs) or args.epochs <= 0:
        _fail(f"--epochs must be a positive number, got {args.epochs}.")
    return math.ceil(args.epochs / q - 1e-9)


def _step_factory(args: argparse.Namespace, q: float) -> Callable[[float], acc.Process]:
    """The process of one step at a noise multiplier, for the per-step samplers."""
    if args.sampler == "truncated_poisson":
        if args.truncated_batch_size is None or args.dataset_size is None:
            _fail("--sampler truncated_poisson needs --truncated-batch-size and --dataset-size.")
        return lambda sigma: acc.truncated_poisson(
            acc.gaussian(sigma),
            q,
            dataset_size=args.dataset_size,
            truncated_batch_size=args.truncated_batch_size,
        )
    return lambda sigma: acc.poisson(acc.gaussian(sigma), q)


def _run_factory(args: argparse.Namespace, q: float, steps: int) -> Callable[[float], acc.Process]:
    """The whole-run process at a noise multiplier."""
    if args.sampler == "k_out_of_t":
        if args.k is None or args.allocation is None:
            _fail("--sampler k_out_of_t needs --k and --allocation (block or total); t is --steps.")
        return lambda sigma: acc.k_out_of_t(acc.gaussian(sigma), k=args.k, t=steps, allocation=args.allocation)
    step = _step_factory(args, q)
    return lambda sigma: acc.repeat(step(sigma), steps)


def _query(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"accountant": args.accountant}
    if args.sampler == "k_out_of_t":
        extra["monte_carlo"] = acc.MonteCarlo(num_samples=args.mc_samples)
    return extra


def _inputs(args: argparse.Namespace, **resolved: Any) -> dict[str, Any]:
    names = ("sample_rate", "batch_size", "dataset_size", "steps", "epochs", "sampler", "delta", "accountant")
    out = {name: getattr(args, name, None) for name in names}
    for name in ("truncated_batch_size", "k", "allocation"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    if args.sampler == "k_out_of_t":
        out["mc_samples"] = args.mc_samples
    out.update(resolved)
    return out


def _plot(path: str, make_run: Callable[[int], acc.Process], steps: int, delta: float, query: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted({max(1, round(steps * i / 12)) for i in range(1, 13)})
    values = [acc.epsilon(make_run(n), delta=delta, **query).value for n in points]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(points, values, marker="o")
    ax.set_xlabel("steps")
    ax.set_ylabel(f"epsilon at delta={delta:.3g}")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_steps(args: argparse.Namespace, sigma: float, q: float, steps: int, delta: float, query: dict) -> None:
    if args.plot:
        if args.sampler == "k_out_of_t":
            _fail("--plot needs a per-step sampler; k_out_of_t is accounted for its whole horizon only.")
        step = _step_factory(args, q)(sigma)
        _plot(args.plot, lambda n: acc.repeat(step, n), steps, delta, query, f"noise multiplier {sigma:.4g}")


def run_epsilon(args: argparse.Namespace) -> dict[str, Any]:
    q = _sample_rate(args)
    steps, delta = _steps(args, q), _delta(args)
    query = _query(args)
    result = acc.epsilon(_run_factory(args, q, steps)(args.noise_multiplier), delta=delta, **query)
    _plot_steps(args, args.noise_multiplier, q, steps, delta, query)
    return {
        "epsilon": result.value,
        **_inputs(args, noise_multiplier=args.noise_multiplier, sample_rate=q, steps=steps, delta=delta),
        "accountant": result.accountant,
    }


def run_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    q = _sample_rate(args)
    steps, delta = _steps(args, q), _delta(args)
    query = _query(args)
    found = acc.calibrate_noise_multiplier(
        _run_factory(args, q, steps),
        target_epsilon=args.target_epsilon,
        delta=delta,
        min=args.min,
        max=args.max,
        tolerance=args.tolerance,
        **query,
    )
    _plot_steps(args, found.value, q, steps, delta, query)
    return {
        "noise_multiplier": found.value,
        "epsilon": found.epsilon,
        "target_epsilon": args.target_epsilon,
        **_inputs(args, sample_rate=q, steps=steps, delta=delta),
        "min": args.min,
        "max": args.max,
        "tolerance": args.tolerance,
        "accountant": found.accountant,
    }


def run_steps(args: argparse.Namespace) -> dict[str, Any]:
    q = _sample_rate(args)
    delta = _delta(args)
    if args.sampler == "k_out_of_t":
        _fail("'steps' needs a per-step sampler; k_out_of_t is accounted for its whole horizon, use 'epsilon'.")
    query = _query(args)
    found = acc.calibrate_steps(
        _step_factory(args, q)(args.noise_multiplier),
        target_epsilon=args.target_epsilon,
        delta=delta,
        max_steps=args.max_steps,
        **query,
    )
    _plot_steps(args, args.noise_multiplier, q, int(found.value), delta, query)
    return {
        "steps": int(found.value),
        "epsilon": found.epsilon,
        "target_epsilon": args.target_epsilon,
        **_inputs(args, noise_multiplier=args.noise_multiplier, sample_rate=q, delta=delta, steps=int(found.value)),
        "epochs": found.value * q,
        "max_steps": args.max_steps,
        "accountant": found.accountant,
    }


def _add_privacy(subparsers: argparse._SubParsersAction) -> None:
    privacy = subparsers.add_parser("privacy", help="privacy accounting before training")
    commands = privacy.add_subparsers(dest="privacy_command", required=True)

    eps = commands.add_parser("epsilon", help="epsilon of a run at a noise multiplier")
    eps.add_argument("--noise-multiplier", type=float, required=True, help="sigma >= 0 (0 = non-private)")
    _sampling_arguments(eps)
    eps.set_defaults(run=run_epsilon)

    cal = commands.add_parser("calibrate", help="smallest noise multiplier for a target epsilon")
    cal.add_argument("--target-epsilon", type=float, required=True)
    cal.add_argument("--min", type=float, default=0.11, help="smallest multiplier searched (default 0.11)")
    cal.add_argument("--max", type=float, default=10.0, help="largest multiplier searched (default 10.0)")
    cal.add_argument("--tolerance", type=float, default=1e-3, help="relative epsilon tolerance (default 1e-3)")
    _sampling_arguments(cal)
    cal.set_defaults(run=run_calibrate)

    stp = commands.add_parser("steps", help="how many steps fit a target epsilon")
    stp.add_argument("--noise-multiplier", type=float, required=True)
    stp.add_argument("--target-epsilon", type=float, required=True)
    stp.add_argument("--max-steps", type=int, default=10**7)
    _sampling_arguments(stp, steps_known=False)
    stp.set_defaults(run=run_steps, steps=None, epochs=None)


def build_parser() -> argparse.ArgumentParser:
    """The ``opake`` parser; each subcommand sets ``run(args) -> dict``."""
    parser = argparse.ArgumentParser(prog="opake", description="Opake: differentially private training tools.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_privacy(subparsers)
    add_demo_command(subparsers)
    return parser


def _human(answer: dict[str, Any]) -> str:
    name = next(iter(answer))
    head = f"{name} = {answer[name]:.6g}" if isinstance(answer[name], float) else f"{name} = {answer[name]}"
    details = ", ".join(f"{k}={v}" for k, v in answer.items() if k != name and v is not None)
    return f"{head}  ({details})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0, or 2 for refused input)."""
    args = build_parser().parse_args(argv)
    try:
        answer = args.run(args)
    except OpakeError as exc:
        print(f"opake: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(answer, sort_keys=False) if args.json else _human(answer))
    return 0
