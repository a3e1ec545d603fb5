"""The ``opake`` command line: questions to answer before training.

``opake privacy epsilon|calibrate|steps`` wraps :mod:`opake_core.accounting`. Every command prints one line
for people, or one JSON object with ``--json`` holding the answer and every input it used. Defaults match the
trainer: PLD accountant, Poisson sampler, ``delta = 1 / N**1.1`` when a dataset size is given. ``opake --version``
prints the installed version.

``calibrate`` meets any one :class:`~opake_core.accounting.Budget` (``--target-epsilon`` at ``--delta``,
``--target-delta`` at ``--at-epsilon``, ``--target-advantage``, ``--target-beta`` at ``--at-alpha``,
``--target-bayes-risk`` at ``--prior``) by :func:`opake_core.accounting.calibrate` of one ``--parameter``: the noise
multiplier (the default), or the sample rate or the steps at a given ``--noise-multiplier``. ``epsilon`` also answers
``--advantage``, ``--beta-at-alpha``, ``--bayes-risk-at-prior`` (read from the run's PLD privacy profile, refused for
runs without one) and ``--delta-at-epsilon``.

``--mechanism mf_*`` accounts a DP-FTRL run for its whole horizon through
:func:`opake_core.accounting.mf_process`; the sampler defaults to the mechanism's usual one (mf_band:
cyclic_poisson, mf_identity: poisson, the others: balls_in_bins) and the strategy's parameters come from
``--bands``, ``--max-buffers``, ``--bandwidth``, ``--alpha``, ``--beta`` and ``--lambda``.

``--ddp-shard global --world-size W`` accounts the trainer's parallel Poisson sampling (``ddp_shard="global"``): each
of W ranks draws the whole dataset at its own rate (``--sample-rate``, or one rank's ``--batch-size`` / N), one step
accounted as :func:`opake_core.accounting.poisson_group` of W records, and an epoch is ``1 / (W q)`` steps. The
default ``per_rank`` needs no world size: its ranks split one draw at the cluster's rate, which ``--sample-rate`` or the
cluster's ``--batch-size`` gives.

Every flag is honoured or refused: a number outside :mod:`opake_torch.limits` is a usage error, and a flag that the
chosen sampler or mechanism does not read (``--truncated-batch-size`` without ``--sampler truncated_poisson``,
``--mc-samples`` where no Monte Carlo accountant runs) is refused rather than ignored. Refused input exits with status
2, a file that cannot be written with status 1, each with one ``error:`` line and no traceback.

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
from opake_core import mf, sampling
from opake_core.accounting.mf_monte_carlo import MonteCarloMF, default_monte_carlo
from opake_core.errors import ConfigurationError, OpakeError
from opake_torch import __version__, limits
from opake_torch._cli_types import number, writable_path
from opake_torch.demo import add_demo_command

__all__ = ["build_parser", "main"]

SAMPLERS = ("poisson", "truncated_poisson", "k_out_of_t", "fixed_size")
MF_SAMPLERS = ("cyclic_poisson", "b_min_sep", "balls_in_bins")
MECHANISMS = ("gaussian", *acc.COMPATIBLE_SAMPLERS)
DDP_SHARDS = ("per_rank", "global")
# The samplers whose runs only a Monte Carlo accountant covers (random allocation; DP-FTRL with balls-in-bins or
# b-min-sep): the only ones that read --mc-samples.
MONTE_CARLO_SAMPLERS = ("k_out_of_t", "balls_in_bins", "b_min_sep")
# Normal draws of one Monte Carlo answer (samples x steps): about a minute and a half on one CPU core.
MAX_MC_DRAWS = 10**9
_MF_DEFAULT_SAMPLER = {"mf_band": "cyclic_poisson", "mf_identity": "poisson"}
# A budget kind -> its --target-* flag, the flag of the point it is taken at (--target-epsilon: --delta, resolved as
# in 'epsilon'), and what that point is.
_BUDGET_FLAGS = {
    "epsilon": ("--target-epsilon", None, None),
    "delta": ("--target-delta", "--at-epsilon", "the epsilon at which delta is bounded"),
    "advantage": ("--target-advantage", None, None),
    "beta": ("--target-beta", "--at-alpha", "the type I error at which the type II error is bounded"),
    "bayes_risk": ("--target-bayes-risk", "--prior", "the probability that the example is in the data"),
}
FDP_KINDS = ("advantage", "beta", "bayes_risk")  # read from the PLD privacy profile (opake_core.accounting.fdp)
_SEARCH_LIMITS = {  # what --min / --max may be, by --parameter
    "noise_multiplier": {"low": limits.MIN_NOISE_MULTIPLIER, "high": limits.MAX_NOISE_MULTIPLIER},
    "sample_rate": {"low": 0, "high": 1, "open_low": True},
    "steps": {"low": 1, "high": limits.MAX_COUNT, "integer": True},
}
_STRATEGY_FLAGS = {  # flag -> mechanisms it applies to
    "bands": ("mf_band",),
    "max_buffers": ("mf_blt",),
    "bandwidth": ("mf_bisr", "mf_bsr"),
    "alpha": ("mf_bisr", "mf_bsr"),
    "beta": ("mf_bisr", "mf_bsr"),
    "lambda_": ("mf_lambda_cgd",),
}


def _sampling_arguments(parser: argparse.ArgumentParser, *, steps_known: bool = True) -> None:
    count = number(1, limits.MAX_COUNT, integer=True)
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--sample-rate", type=number(0, 1, open_low=True), help="Poisson rate q in (0, 1] (or give --batch-size)"
    )
    group.add_argument(
        "--batch-size", type=count, help="expected batch size (users with --privacy-unit user); q = batch / N"
    )
    group.add_argument(
        "--dataset-size",
        type=number(1, 2**53, integer=True),
        help="N, the rows (the users with --privacy-unit user); also sets the default delta 1/N**1.1",
    )
    if steps_known:
        group.add_argument("--steps", type=count, help="number of training steps (or give --epochs)")
        group.add_argument(
            "--epochs", type=number(0, limits.MAX_SCALE, open_low=True), help="epochs; steps = ceil(epochs / q)"
        )
    group.add_argument(
        "--sampler",
        choices=SAMPLERS + MF_SAMPLERS,
        default=None,
        help="batch sampler (default poisson; for --mechanism mf_*: the mechanism's usual sampler)",
    )
    group.add_argument("--truncated-batch-size", type=count, help="cap of truncated_poisson")
    group.add_argument("--k", type=count, help="participations per example for k_out_of_t")
    group.add_argument("--allocation", choices=("block", "total"), help="k_out_of_t allocation")
    group.add_argument(
        "--mc-samples",
        type=number(100, MAX_MC_DRAWS, integer=True),
        default=None,
        help="Monte Carlo samples per direction: for k_out_of_t, use the Monte Carlo estimator instead of the "
        "numerical PLD; for DP-FTRL with balls_in_bins or b_min_sep (default ceil(4 log(2G/beta) / delta))",
    )
    ddp = parser.add_argument_group("data parallel")
    ddp.add_argument(
        "--ddp-shard",
        choices=DDP_SHARDS,
        default="per_rank",
        help="the trainer's ddp_shard: per_rank (default; give the cluster's rate or batch) or global (each of "
        "--world-size ranks draws the whole dataset at its own --sample-rate or --batch-size / N)",
    )
    ddp.add_argument("--world-size", type=count, help="--ddp-shard global: the number of ranks (WORLD_SIZE)")
    real = number(None, None)
    mech = parser.add_argument_group("mechanism")
    mech.add_argument("--mechanism", choices=MECHANISMS, default="gaussian", help="noise mechanism (default gaussian)")
    mech.add_argument("--bands", type=count, help="mf_band: bands (= cyclic_poisson groups, b_min_sep min_sep); 16")
    mech.add_argument("--max-buffers", type=count, help="mf_blt: most buffers (default 10)")
    mech.add_argument("--bandwidth", type=count, help="mf_bsr (default 8) / mf_bisr (default 4): bandwidth")
    mech.add_argument("--alpha", type=real, help="mf_bsr / mf_bisr: weight decay factor (default 1.0)")
    mech.add_argument("--beta", type=real, help="mf_bsr (default 0.9) / mf_bisr (default 0.0): momentum")
    mech.add_argument("--lambda", dest="lambda_", type=real, help="mf_lambda_cgd: lambda in [0, 1) (default 0.5)")
    priv = parser.add_argument_group("privacy")
    priv.add_argument(
        "--delta", type=number(0, 1, open_low=True, open_high=True), help="delta in (0, 1); default 1/N**1.1"
    )
    priv.add_argument(
        "--allow-large-delta",
        action="store_true",
        help="accept a --delta >= 1/N (refused by default: at that delta one record may leak in the clear)",
    )
    priv.add_argument("--accountant", choices=("pld", "rdp"), default=None, help="default pld")
    priv.add_argument(
        "--privacy-unit",
        choices=("record", "user"),
        default="record",
        help="what one neighbour adds or removes: a row (default), or a user with all its rows (then --dataset-size "
        "and --batch-size count users, as the trainer's privacy_unit='user')",
    )
    priv.add_argument(
        "--max-rows-per-user",
        type=count,
        help="--privacy-unit user: the most rows a sampled user gives a step (the trainer's privacy_max_rows_per_user; "
        "it bounds the work of a step, not epsilon, and is echoed in the answer)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE", type=writable_path, help="write epsilon against steps to a PNG")


def _fail(message: str) -> None:
    raise ConfigurationError(message)


def _sample_rate(args: argparse.Namespace) -> float | None:
    """q, or None for k_out_of_t (each example takes part in exactly k of the t steps: no rate)."""
    if args.sampler == "k_out_of_t":
        given = [flag for flag, name in (("--sample-rate", "sample_rate"), ("--batch-size", "batch_size"),
                                         ("--epochs", "epochs")) if getattr(args, name, None) is not None]  # fmt: skip
        if given:
            _fail(
                f"{' and '.join(given)} do not apply to --sampler k_out_of_t: each example takes part in exactly "
                "--k of the --steps steps, whatever the rate; drop them and give --steps."
            )
        return None
    if args.sample_rate is not None:
        if args.batch_size is not None:
            _fail("give --sample-rate or --batch-size with --dataset-size, not both.")
        return args.sample_rate
    if args.batch_size is None or args.dataset_size is None:
        _fail("the sample rate is missing: give --sample-rate, or --batch-size and --dataset-size.")
    if args.batch_size > args.dataset_size:
        _fail(f"--batch-size ({args.batch_size}) must be at most --dataset-size ({args.dataset_size}).")
    return args.batch_size / args.dataset_size


def _delta(args: argparse.Namespace) -> float:
    if args.allow_large_delta and args.delta is None:
        _fail("--allow-large-delta applies to an explicit --delta; the default 1/N**1.1 is below 1/N already.")
    if args.delta is not None:
        if args.dataset_size is None:
            return args.delta
        return acc.check_delta(args.delta, dataset_size=args.dataset_size, allow_large=args.allow_large_delta)
    if args.dataset_size is None:
        _fail("delta is missing: give --delta, or --dataset-size for the default 1/N**1.1.")
    if args.dataset_size < 2:
        _fail(f"--dataset-size must be >= 2 for the default delta, got {args.dataset_size}; give --delta.")
    return 1.0 / args.dataset_size**1.1


def _ranks(args: argparse.Namespace) -> int:
    """The ranks that each draw the whole dataset in a step: ``--world-size`` under ``--ddp-shard global``, else 1
    (one draw, whatever the ranks that split it)."""
    if args.ddp_shard == "per_rank":
        if args.world_size is not None:
            _fail(
                "--world-size applies to --ddp-shard global, whose ranks each draw the whole dataset; under per_rank "
                "the ranks split one draw at the cluster's rate (--sample-rate, or the cluster's --batch-size): drop "
                "--world-size, or add --ddp-shard global."
            )
        return 1
    if args.world_size is None:
        _fail("--ddp-shard global needs --world-size, the number of ranks that each draw the whole dataset.")
    for broken, seen, instead in (
        (args.sampler != "poisson", f"--sampler {args.sampler}", "--sampler poisson"),
        (args.mechanism != "gaussian", f"--mechanism {args.mechanism}", "--mechanism gaussian"),
        (args.privacy_unit != "record", "--privacy-unit user", "--privacy-unit record"),
    ):
        if broken:
            _fail(
                f"--ddp-shard global (parallel Poisson sampling, accounted as a group of --world-size records under "
                f"Poisson sampling) has no accountant with {seen}. Use {instead}, or --ddp-shard per_rank."
            )
    return args.world_size


def _steps(args: argparse.Namespace, q: float | None) -> int:
    if (args.steps is None) == (args.epochs is None):
        _fail("give exactly one of --steps and --epochs.")
    if args.steps is not None:
        return args.steps
    steps = math.ceil(args.epochs / (q * _ranks(args)) - 1e-9)  # a step draws W q N records under global
    if steps > limits.MAX_COUNT:
        _fail(f"--epochs {args.epochs} at sample rate {q} is {steps} steps, more than 2**31 - 1; give fewer epochs.")
    return steps


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
    if args.sampler == "fixed_size":
        if args.batch_size is None or args.dataset_size is None:
            _fail("--sampler fixed_size needs --batch-size and --dataset-size (batches of exactly that size).")
        return lambda sigma: acc.without_replacement(
            acc.gaussian(sigma), dataset_size=args.dataset_size, sample_size=args.batch_size
        )
    ranks = _ranks(args)
    if ranks > 1:
        return lambda sigma: acc.poisson_group(acc.gaussian(sigma), q, group_size=ranks)
    return lambda sigma: acc.poisson(acc.gaussian(sigma), q)


def _run_factory(args: argparse.Namespace, q: float, steps: int) -> Callable[[float], acc.Process]:
    """The whole-run process at a noise multiplier."""
    if args.sampler == "k_out_of_t":
        if args.k is None or args.allocation is None:
            _fail("--sampler k_out_of_t needs --k and --allocation (block or total); t is --steps.")
        return lambda sigma: acc.k_out_of_t(acc.gaussian(sigma), k=args.k, t=steps, allocation=args.allocation)
    step = _step_factory(args, q)
    return lambda sigma: acc.repeat(step(sigma), steps)


def _monte_carlo_dpftrl(args: argparse.Namespace) -> bool:
    """Whether the run is DP-FTRL accounted by Monte Carlo only (balls_in_bins or b_min_sep; mf_identity with
    balls_in_bins is a random allocation, which has a numerical PLD)."""
    return args.sampler in ("balls_in_bins", "b_min_sep") and args.mechanism != "mf_identity"


def _mc_samples(args: argparse.Namespace, delta: float) -> int | None:
    """The Monte Carlo samples per direction the accountant draws, or None where no Monte Carlo accountant runs."""
    if args.sampler not in MONTE_CARLO_SAMPLERS:
        return None
    if args.mc_samples is not None:
        return args.mc_samples
    if not _monte_carlo_dpftrl(args):  # random allocation: numerical PLD
        return None
    return default_monte_carlo(delta).num_samples  # DP-FTRL: enough for a certified floor of delta / 4


def _query(args: argparse.Namespace, steps: int, delta: float) -> dict[str, Any]:
    extra: dict[str, Any] = {"accountant": args.accountant}
    samples = _mc_samples(args, delta)
    if samples is not None and samples * steps > MAX_MC_DRAWS:
        _fail(
            f"the Monte Carlo accountant would draw {samples} samples x {steps} steps = {samples * steps:.3g} normals "
            f"(more than {MAX_MC_DRAWS:.0e}, minutes to hours): give fewer --steps, a smaller --mc-samples (a looser "
            "bound at small delta), or a larger --delta."
        )
    if args.mc_samples is not None:
        extra["monte_carlo"] = acc.MonteCarlo(num_samples=samples)
        if args.accountant is None and (args.sampler == "k_out_of_t" or args.mechanism == "mf_identity"):
            extra["accountant"] = "monte_carlo"  # random allocation: the estimator, on request
    return extra


def _resolve_sampler(args: argparse.Namespace) -> None:
    """Fill in the default sampler and refuse flags that do not apply to the mechanism or the sampler."""
    if args.mechanism == "gaussian":
        if args.sampler in MF_SAMPLERS:
            users = [m for m, s in acc.COMPATIBLE_SAMPLERS.items() if args.sampler in s]
            _fail(f"--sampler {args.sampler} is a DP-FTRL sampler; use it with --mechanism in {users}.")
        args.sampler = args.sampler or "poisson"
    else:
        args.sampler = args.sampler or _MF_DEFAULT_SAMPLER.get(args.mechanism, "balls_in_bins")
        if args.plot:
            _fail("--plot draws epsilon against steps; a DP-FTRL run is accounted for its whole horizon only.")
        allowed = acc.COMPATIBLE_SAMPLERS[args.mechanism]
        if args.sampler not in allowed:
            _fail(
                f"--mechanism {args.mechanism} cannot be accounted with --sampler {args.sampler}; "
                f"use one of {list(allowed)}."
            )
    for flag, users in _STRATEGY_FLAGS.items():
        if getattr(args, flag, None) is not None and args.mechanism not in users:
            name = "--lambda" if flag == "lambda_" else "--" + flag.replace("_", "-")
            _fail(f"{name} applies to --mechanism {' / '.join(users)}, not {args.mechanism}; drop it.")
    for name, sampler in (
        ("truncated_batch_size", "truncated_poisson"),
        ("k", "k_out_of_t"),
        ("allocation", "k_out_of_t"),
    ):
        if getattr(args, name) is not None and args.sampler != sampler:
            flag = "--" + name.replace("_", "-")
            _fail(f"{flag} applies to --sampler {sampler}, not {args.sampler}: add --sampler {sampler} or drop {flag}.")
    if args.mc_samples is not None and args.sampler not in MONTE_CARLO_SAMPLERS:
        _fail(
            f"--mc-samples applies to the Monte Carlo accountant, which runs for --sampler "
            f"{' / '.join(MONTE_CARLO_SAMPLERS)} only, not {args.sampler}: drop --mc-samples."
        )
    _ranks(args)  # --ddp-shard and --world-size refused here, before any accounting, where they do not apply


def _strategy(args: argparse.Namespace) -> Any:
    def given(name: str, default: Any) -> Any:
        value = getattr(args, name)
        return default if value is None else value

    if args.mechanism == "mf_band":
        return mf.band_mf(given("bands", 16))
    if args.mechanism == "mf_blt":
        return mf.blt(given("max_buffers", 10))
    if args.mechanism == "mf_bisr":
        return mf.bisr(given("bandwidth", 4), given("alpha", 1.0), given("beta", 0.0))
    if args.mechanism == "mf_bsr":
        return mf.bsr(given("bandwidth", 8), given("alpha", 1.0), given("beta", 0.9))
    if args.mechanism == "mf_lambda_cgd":
        return mf.lambda_cgd(given("lambda_", 0.5))
    return mf.identity()


def _mf_sampler(args: argparse.Namespace, q: float) -> Any:
    # Only cyclic_poisson (group sizes) and truncation depend on N; the others are accounted from q alone.
    size = args.dataset_size or 1
    bands = 16 if args.bands is None else args.bands
    if args.sampler == "cyclic_poisson":
        if args.dataset_size is None:
            _fail("--sampler cyclic_poisson needs --dataset-size: groups hold floor(N / bands) examples.")
        return sampling.cyclic_poisson(dataset_size=args.dataset_size, sample_rate=q, bands=bands)
    if args.sampler == "b_min_sep":
        return sampling.b_min_sep(dataset_size=size, sample_rate=q, min_sep=bands)
    if args.sampler == "balls_in_bins":
        bins = round(1 / q)
        if abs(bins * q - 1) > 1e-9:
            _fail(f"--sampler balls_in_bins needs --sample-rate = 1 / num_bins, got {q}; use 1/{bins} = {1 / bins}.")
        return sampling.balls_in_bins(dataset_size=size, num_bins=bins)
    if args.sampler == "truncated_poisson":
        if args.truncated_batch_size is None or args.dataset_size is None:
            _fail("--sampler truncated_poisson needs --truncated-batch-size and --dataset-size.")
        return sampling.poisson(dataset_size=size, sample_rate=q, truncated_batch_size=args.truncated_batch_size)
    if args.sampler == "poisson":
        return sampling.poisson(dataset_size=size, sample_rate=q)
    users = sorted(m for m, s in acc.COMPATIBLE_SAMPLERS.items() if args.sampler in s)
    _fail(
        f"--mechanism {args.mechanism} cannot be accounted with --sampler {args.sampler}; samplers: {users or 'none'}."
    )
    return None


def _mf_run(args: argparse.Namespace, steps: int) -> Callable[[float, float], Any]:
    """The whole-horizon MF process at a noise multiplier and a sample rate (the strategy is optimized once, for
    ``steps``)."""
    concrete = mf.optimize(_strategy(args), steps)
    return lambda sigma, q: acc.mf_process(
        concrete, sampler=_mf_sampler(args, q), noise_multiplier=sigma, n_steps=steps
    )


def _mf_factory(args: argparse.Namespace, q: float, steps: int) -> Callable[[float], Any]:
    """The whole-horizon MF process at a noise multiplier."""
    run = _mf_run(args, steps)
    run(1.0, q)  # validate before searching
    return lambda sigma: run(sigma, q)


def _inputs(args: argparse.Namespace, **resolved: Any) -> dict[str, Any]:
    names = ("sample_rate", "batch_size", "dataset_size", "steps", "epochs", "sampler", "delta", "accountant")
    out = {name: getattr(args, name, None) for name in names}
    for name in ("truncated_batch_size", "k", "allocation"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    if args.ddp_shard == "global":
        out.update(ddp_shard=args.ddp_shard, world_size=args.world_size)
    if _mc_samples(args, resolved["delta"]) is not None:
        out["mc_samples"] = _mc_samples(args, resolved["delta"])
    out["privacy_unit"] = args.privacy_unit
    if args.privacy_unit == "user":
        out["max_rows_per_user"] = args.max_rows_per_user
    elif args.max_rows_per_user is not None:
        _fail("--max-rows-per-user applies to --privacy-unit user; drop it, or add --privacy-unit user.")
    if args.mechanism != "gaussian":
        out["mechanism"] = args.mechanism
        out.update({k: getattr(args, k) for k in _STRATEGY_FLAGS if getattr(args, k) is not None})
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


def _refuse_without_profile(args: argparse.Namespace, process: Any, flags: Sequence[str]) -> None:
    """Refuse the f-DP questions ``flags`` where the run has no PLD privacy profile to read them from: where the core
    (:mod:`opake_core.accounting.fdp`, :meth:`~opake_core.accounting.Budget.query`) refuses, said in flags."""
    if not flags:
        return
    if args.accountant == "rdp":
        why = "--accountant rdp answers from RDP, which has none: drop --accountant rdp (PLD is the default)"
    elif isinstance(process, MonteCarloMF):
        why = (
            f"--mechanism {args.mechanism} with --sampler {args.sampler} is accounted by Monte Carlo only, which has "
            "none: use a sampler with a PLD (cyclic_poisson for mf_band, poisson or balls_in_bins for mf_identity)"
        )
    elif args.mc_samples is not None:
        why = "--mc-samples asks for the Monte Carlo estimator, which has none: drop it (the numerical PLD answers)"
    elif acc.contains_without_replacement(process):
        why = "--sampler fixed_size is accounted by RDP only (replace-one), which has none: use --sampler poisson"
    else:
        return
    verb = "reads" if len(flags) == 1 else "read"
    _fail(f"{' and '.join(flags)} {verb} the run's PLD privacy profile (delta at every epsilon); here {why}.")


def _profile_flags(args: argparse.Namespace) -> list[str]:
    """The f-DP questions asked of ``epsilon``."""
    asked = {
        "--advantage": args.advantage,
        "--beta-at-alpha": args.beta_at_alpha is not None,
        "--bayes-risk-at-prior": args.bayes_risk_at_prior is not None,
    }
    return [flag for flag, given in asked.items() if given]


def _more_answers(args: argparse.Namespace, process: Any, query: dict[str, Any], delta: float) -> dict[str, Any]:
    """The run's answers to ``--advantage`` (an upper bound), ``--beta-at-alpha`` and ``--bayes-risk-at-prior``
    (lower bounds; from the PLD privacy profile) and ``--delta-at-epsilon`` (by the accountant of its epsilon, with
    the same Monte Carlo samples), each keyed by its flag."""
    out: dict[str, Any] = {}
    if args.advantage:
        out["advantage"] = acc.advantage(process).value
    if args.beta_at_alpha is not None:
        alpha = args.beta_at_alpha
        out["beta_at_alpha"] = {"alpha": alpha, "beta": acc.beta(process, alpha=alpha).value}
    if args.bayes_risk_at_prior is not None:
        prior = args.bayes_risk_at_prior
        out["bayes_risk_at_prior"] = {"prior": prior, "bayes_risk": acc.bayes_risk(process, prior=prior).value}
    if args.delta_at_epsilon is not None:
        samples = _mc_samples(args, delta)
        if samples is not None and "monte_carlo" not in query:  # the count the epsilon query drew by default
            query = {**query, "monte_carlo": acc.MonteCarlo(num_samples=samples)}
        result = acc.delta(process, epsilon=args.delta_at_epsilon, **query)
        out["delta_at_epsilon"] = {
            "epsilon": args.delta_at_epsilon,
            "delta": result.value,
            "accountant": result.accountant,
        }
    return out


def run_epsilon(args: argparse.Namespace) -> dict[str, Any]:
    _resolve_sampler(args)
    q = _sample_rate(args)
    steps, delta = _steps(args, q), _delta(args)
    query = _query(args, steps, delta)
    make = _run_factory if args.mechanism == "gaussian" else _mf_factory
    process = make(args, q, steps)(args.noise_multiplier)
    _refuse_without_profile(args, process, _profile_flags(args))
    result = acc.epsilon(process, delta=delta, **query)
    more = _more_answers(args, process, query, delta)
    _plot_steps(args, args.noise_multiplier, q, steps, delta, query)
    return {
        "epsilon": result.value,
        **more,
        **_inputs(args, noise_multiplier=args.noise_multiplier, sample_rate=q, steps=steps, delta=delta),
        "accountant": result.accountant,
    }


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _budget(args: argparse.Namespace) -> acc.Budget:
    """The budget of ``calibrate``: its one ``--target-*`` flag (argparse admits exactly one) at its point."""
    kind = next(k for k, (flag, _, _) in _BUDGET_FLAGS.items() if getattr(args, _dest(flag)) is not None)
    target, point, meaning = _BUDGET_FLAGS[kind]
    for other, other_point, _ in _BUDGET_FLAGS.values():
        if other_point not in (None, point) and getattr(args, _dest(other_point)) is not None:
            _fail(f"{other_point} is the point of {other}, not of {target}: drop {other_point}.")
    if point is not None and getattr(args, _dest(point)) is None:
        _fail(f"{target} needs {point}, {meaning}.")
    if kind == "epsilon":
        return acc.Budget.epsilon(args.target_epsilon, delta=_delta(args))
    if args.delta is not None:
        _fail(f"--delta is the point of --target-epsilon; {target} does not read it: drop --delta.")
    if kind == "delta":
        bound = args.target_delta
        if args.dataset_size is not None:  # a delta of 1/N or more is refused as for --delta
            bound = acc.check_delta(bound, dataset_size=args.dataset_size, allow_large=args.allow_large_delta)
        return acc.Budget.delta(bound, epsilon=args.at_epsilon)
    if args.allow_large_delta:
        _fail(f"--allow-large-delta applies to --delta or --target-delta; {target} reads no delta: drop it.")
    if kind == "advantage":
        return acc.Budget.advantage(args.target_advantage)
    if kind == "beta":
        return acc.Budget.beta(args.target_beta, alpha=args.at_alpha)
    return acc.Budget.bayes_risk(args.target_bayes_risk, prior=args.prior)


def _searched(args: argparse.Namespace) -> tuple[float | None, float | None, int | None, Callable[[Any], Any]]:
    """The run's noise multiplier, sample rate and steps (None for the one ``--parameter`` searches) and the process
    at a value of that parameter, from the flags ``epsilon`` reads."""
    parameter, sigma = args.parameter, args.noise_multiplier
    gaussian = args.mechanism == "gaussian"
    if parameter == "noise_multiplier":
        if sigma is not None:
            _fail(
                "--noise-multiplier is what --parameter noise_multiplier (the default) searches: drop it, or add "
                "--parameter sample_rate or steps to search those at this multiplier."
            )
        q = _sample_rate(args)
        steps = _steps(args, q)
        return None, q, steps, (_run_factory if gaussian else _mf_factory)(args, q, steps)
    if sigma is None:
        _fail(f"--parameter {parameter} searches at a given noise multiplier: add --noise-multiplier.")
    if parameter == "sample_rate":
        for flag, name, why in (
            ("--sample-rate", "sample_rate", "is what --parameter sample_rate searches"),
            ("--batch-size", "batch_size", "gives the rate that --parameter sample_rate searches"),
            ("--epochs", "epochs", "counts steps at a rate, and the rate is searched: give --steps"),
        ):
            if getattr(args, name) is not None:
                _fail(f"{flag} {why}; drop {flag}.")
        if args.sampler in ("k_out_of_t", "fixed_size", "balls_in_bins"):
            _fail(
                f"--parameter sample_rate needs a sampler with a free rate; --sampler {args.sampler} has none (its "
                "batches come from --k, --batch-size or the number of bins): calibrate the noise multiplier or steps."
            )
        steps = _steps(args, None)
        if gaussian:
            return sigma, None, steps, lambda q: _run_factory(args, q, steps)(sigma)
        run = _mf_run(args, steps)
        return sigma, None, steps, lambda q: run(sigma, q)
    for flag, name in (("--steps", "steps"), ("--epochs", "epochs")):
        if getattr(args, name) is not None:
            _fail(f"{flag} gives the steps that --parameter steps searches; drop {flag}.")
    if not gaussian or args.sampler == "k_out_of_t":
        what = f"--mechanism {args.mechanism}" if not gaussian else "--sampler k_out_of_t"
        _fail(f"--parameter steps needs a per-step run; {what} is accounted for its whole horizon.")
    q = _sample_rate(args)
    step = _step_factory(args, q)(sigma)
    return sigma, q, None, lambda n: acc.repeat(step, n)


def _search_range(args: argparse.Namespace) -> tuple[float | int, float | int, float | None]:
    """``--min``, ``--max`` (checked for ``--parameter``; defaults: the core's ``accounting.DEFAULT_RANGES``) and
    ``--tolerance`` (None for steps, which are exact)."""
    parameter = args.parameter
    lo, hi = acc.DEFAULT_RANGES[parameter]
    if parameter == "sample_rate" and args.sampler == "cyclic_poisson" and args.dataset_size is not None:
        # the largest rate whose conditional rate within a group is 1
        hi = sampling.cyclic_poisson(dataset_size=args.dataset_size, sample_rate=lo, bands=args.bands or 16).group_size
        hi /= args.dataset_size

    def bound(flag: str, value: float | None, default: float | int) -> float | int:
        if value is None:
            return default
        if parameter == "steps" and value.is_integer():
            value = int(value)
        return limits.check_number(value, flag, why=f"the {parameter} searched", **_SEARCH_LIMITS[parameter])

    lo, hi = bound("--min", args.min, lo), bound("--max", args.max, hi)
    if parameter == "steps":
        if args.tolerance is not None:
            _fail("--tolerance applies to a continuous --parameter; steps are exact (one more misses the budget).")
        return lo, hi, None
    return lo, hi, 1e-3 if args.tolerance is None else args.tolerance


def run_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    _resolve_sampler(args)
    budget, parameter = _budget(args), args.parameter
    if args.plot and budget.kind != "epsilon":
        _fail("--plot draws epsilon at --delta against steps; it applies to --target-epsilon only.")
    if _monte_carlo_dpftrl(args) and (budget.kind != "epsilon" or parameter != "noise_multiplier"):
        _fail(
            f"--mechanism {args.mechanism} with --sampler {args.sampler} is accounted by Monte Carlo, which calibrates "
            f"the noise multiplier to --target-epsilon only, not {budget} by --parameter {parameter}."
        )
    sigma, q, steps, make = _searched(args)
    lo, hi, tolerance = _search_range(args)
    delta = budget.at if budget.kind == "epsilon" else None
    query = _query(args, hi if parameter == "steps" else steps, delta)
    if budget.kind in FDP_KINDS:
        _refuse_without_profile(
            args, make(hi if parameter == "noise_multiplier" else lo), [_BUDGET_FLAGS[budget.kind][0]]
        )
    tol = {} if tolerance is None else {"tolerance": tolerance}  # steps are exact: none
    found = acc.calibrate(make, budget=budget, parameter=parameter, min=lo, max=hi, **tol, **query)
    run = {"noise_multiplier": sigma, "sample_rate": q, "steps": steps, parameter: found.value}
    if budget.kind == "epsilon":
        _plot_steps(args, run["noise_multiplier"], run["sample_rate"], run["steps"], delta, query)
    if budget.kind == "epsilon" and parameter == "noise_multiplier":  # the answer of --target-epsilon, as before
        head = {"noise_multiplier": found.value, "epsilon": found.achieved, "target_epsilon": budget.bound}
        run.pop("noise_multiplier")
    else:
        head = {parameter: found.value, "achieved": found.achieved, "budget": str(budget), "parameter": parameter}
        if parameter == "steps":
            run["epochs"] = found.value * q * _ranks(args)
    return {
        **head,
        **_inputs(args, **run, delta=delta),
        "min": lo,
        "max": hi,
        "tolerance": tolerance,
        "accountant": found.accountant,
    }


def run_steps(args: argparse.Namespace) -> dict[str, Any]:
    _resolve_sampler(args)
    if args.mechanism != "gaussian":
        _fail(f"'steps' needs a per-step mechanism; --mechanism {args.mechanism} is accounted for its whole horizon.")
    q = _sample_rate(args)
    delta = _delta(args)
    if args.sampler == "k_out_of_t":
        _fail("'steps' needs a per-step sampler; k_out_of_t is accounted for its whole horizon, use 'epsilon'.")
    query = _query(args, args.max_steps, delta)
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
        "epochs": found.value * q * _ranks(args),
        "max_steps": args.max_steps,
        "accountant": found.accountant,
    }


def _add_privacy(subparsers: argparse._SubParsersAction) -> None:
    privacy = subparsers.add_parser("privacy", help="privacy accounting before training")
    commands = privacy.add_subparsers(dest="privacy_command", required=True)

    sigma = number(
        limits.MIN_NOISE_MULTIPLIER, limits.MAX_NOISE_MULTIPLIER, zero=True, why="or 0 for a non-private run"
    )
    target = number(0, limits.MAX_SCALE, open_low=True, why="an epsilon anywhere near the top protects nothing")
    probability = number(0, 1, open_low=True, open_high=True)
    eps = commands.add_parser("epsilon", help="epsilon of a run at a noise multiplier")
    eps.add_argument("--noise-multiplier", type=sigma, required=True, help="sigma >= 0 (0 = non-private)")
    more = eps.add_argument_group("more answers (from the PLD privacy profile, but --delta-at-epsilon)")
    more.add_argument("--advantage", action="store_true", help="the largest TPR - FPR of a membership test")
    more.add_argument("--beta-at-alpha", type=number(0, 1), metavar="ALPHA", help="the least type II error at ALPHA")
    more.add_argument("--bayes-risk-at-prior", type=probability, metavar="PRIOR", help="the least Bayes error at PRIOR")
    more.add_argument(
        "--delta-at-epsilon", type=number(0, limits.MAX_SCALE), metavar="EPSILON", help="delta at EPSILON"
    )
    _sampling_arguments(eps)
    eps.set_defaults(run=run_epsilon)

    cal = commands.add_parser("calibrate", help="the least private noise multiplier, sample rate or steps for a budget")
    budget = cal.add_argument_group("budget (exactly one --target-*)")
    targets = budget.add_mutually_exclusive_group(required=True)
    targets.add_argument("--target-epsilon", type=target, help="epsilon at most this at --delta")
    targets.add_argument("--target-delta", type=probability, help="delta at most this at --at-epsilon")
    targets.add_argument("--target-advantage", type=probability, help="TPR - FPR of any membership test at most this")
    targets.add_argument("--target-beta", type=probability, help="the least type II error at --at-alpha at least this")
    targets.add_argument(
        "--target-bayes-risk",
        type=number(0, 0.5, open_low=True),
        help="the least Bayes error at --prior at least this (reachable up to min(prior, 1 - prior))",
    )
    budget.add_argument("--at-epsilon", type=number(0, limits.MAX_SCALE), help="--target-delta: its epsilon")
    budget.add_argument("--at-alpha", type=number(0, 1), help="--target-beta: the type I error")
    budget.add_argument("--prior", type=probability, help="--target-bayes-risk: P(the example is in the data)")
    search = cal.add_argument_group("search")
    search.add_argument(
        "--parameter",
        choices=acc.PARAMETERS,
        default="noise_multiplier",
        help="what is searched: the smallest noise multiplier (default), or the largest sample rate or the most steps "
        "at --noise-multiplier",
    )
    search.add_argument("--noise-multiplier", type=sigma, help="--parameter sample_rate or steps: the multiplier")
    bound = number(0, limits.MAX_COUNT, open_low=True)
    search.add_argument(
        "--min", type=bound, help="smallest value searched (default: multiplier 0.11, rate 1e-9, steps 1)"
    )
    search.add_argument(
        "--max",
        type=bound,
        help="largest value searched (default: multiplier 10.0; rate 1, or the most cyclic_poisson allows; steps 1e7)",
    )
    search.add_argument(
        "--tolerance",
        type=number(limits.MIN_TOLERANCE, 1, open_high=True),
        help="relative tolerance of the budget's number (default 1e-3; steps are exact)",
    )
    _sampling_arguments(cal)
    cal.set_defaults(run=run_calibrate)

    stp = commands.add_parser("steps", help="how many steps fit a target epsilon")
    stp.add_argument("--noise-multiplier", type=sigma, required=True)
    stp.add_argument("--target-epsilon", type=target, required=True)
    stp.add_argument("--max-steps", type=number(1, limits.MAX_COUNT, integer=True), default=10**7)
    _sampling_arguments(stp, steps_known=False)
    stp.set_defaults(run=run_steps, steps=None, epochs=None)


def build_parser() -> argparse.ArgumentParser:
    """The ``opake`` parser; each subcommand sets ``run(args) -> dict``."""
    parser = argparse.ArgumentParser(prog="opake", description="Opake: differentially private training tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_privacy(subparsers)
    add_demo_command(subparsers)
    return parser


_MORE_ANSWERS = ("advantage", "beta_at_alpha", "bayes_risk_at_prior", "delta_at_epsilon")


def _said(name: str, value: Any) -> str:
    if isinstance(value, dict):  # an answer at a point: {point: at, number: value, ...}
        (point, at), (number, found) = list(value.items())[:2]
        return f"{number} = {found:.6g} at {point} {at:g}"
    return f"{name} = {value:.6g}" if isinstance(value, float) else f"{name} = {value}"


def _human(answer: dict[str, Any]) -> str:
    said = [next(iter(answer)), *(name for name in _MORE_ANSWERS if name in answer)]
    head = ", ".join(_said(name, answer[name]) for name in said)
    details = ", ".join(f"{k}={v}" for k, v in answer.items() if k not in said and v is not None)
    return f"{head}  ({details})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status: 0, 2 for refused input, 1 for a file that cannot be written.
    A usage error (a malformed or out-of-range flag) exits from ``argparse`` with status 2."""
    args = build_parser().parse_args(argv)
    try:
        answer = args.run(args)
    except OpakeError as exc:
        print(f"opake: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the output folder or the plot file, found unwritable only when written
        print(f"opake: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, sort_keys=False) if args.json else _human(answer))
    return 0
