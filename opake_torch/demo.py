"""The ``opake demo`` job: DP-SGD on a generated classification task, with a non-private baseline.

The data is generated (a mixture of Gaussian clusters, one per class, with label noise), so nothing is downloaded.
The run calibrates the noise multiplier to a target epsilon for Poisson sampling, trains a small MLP from the core
primitives (sample, clip, noise, optimize, account), trains the same model without privacy for comparison, prints
progress and the final accuracies and epsilon, and writes ``metrics.json`` and ``training.png`` to the output folder.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from opake_core import accounting, optim, random
from opake_core.sampling import poisson
from opake_core.step import dp_sgd
from opake_torch.functional import functional_model


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo needs; the defaults take about a minute on two CPU cores."""

    dataset_size: int = 20_000
    test_size: int = 4_000
    num_classes: int = 10
    features: int = 32
    batch_size: int = 500
    epochs: int = 6
    clipping_norm: float = 1.0
    learning_rate: float = 1.0
    target_epsilon: float = 2.0
    seed: int = 0

    @property
    def delta(self) -> float:
        return 1 / self.dataset_size**1.1

    @property
    def sample_rate(self) -> float:
        return self.batch_size / self.dataset_size

    @property
    def steps(self) -> int:
        return self.epochs * self.dataset_size // self.batch_size


def make_data(
    config: DemoConfig,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Gaussian clusters (one centre per class) with 10% of training labels flipped at random."""
    gen = torch.Generator().manual_seed(config.seed)
    centres = torch.randn(config.num_classes, config.features, generator=gen) * 1.2
    n = config.dataset_size + config.test_size
    labels = torch.randint(0, config.num_classes, (n,), generator=gen)
    x = centres[labels] + torch.randn(n, config.features, generator=gen) * 1.5
    noisy = torch.rand(n, generator=gen) < 0.1
    y = torch.where(noisy, torch.randint(0, config.num_classes, (n,), generator=gen), labels)
    train = (x[: config.dataset_size], y[: config.dataset_size])
    test = (x[config.dataset_size :], labels[config.dataset_size :])
    return train, test


def _model(config: DemoConfig) -> nn.Module:
    torch.manual_seed(config.seed)
    return nn.Sequential(nn.Linear(config.features, 64), nn.Tanh(), nn.Linear(64, config.num_classes))


def _accuracy(apply, params, frozen, data) -> float:
    x, y = data
    with torch.no_grad():
        return (apply(params, frozen, x).argmax(dim=1) == y).float().mean().item()


def train(config: DemoConfig, *, noise_multiplier: float, label: str) -> dict:
    """Train with DP-SGD at ``noise_multiplier`` (0 = non-private; clipping is then off too)."""
    train_data, test_data = make_data(config)
    apply, params, frozen = functional_model(_model(config))

    def loss(p, x, y):
        return F.cross_entropy(apply(p, frozen, x[None]), y[None])

    private = noise_multiplier > 0
    optimizer = optim.sgd(lr=config.learning_rate)
    step_fn, dp_state = dp_sgd(
        loss,
        optimizer=optimizer,
        clipping_norm=config.clipping_norm if private else math.inf,
        noise_multiplier=noise_multiplier,
        expected_batch_size=config.batch_size,
    )
    sampler = poisson(dataset_size=config.dataset_size, sample_rate=config.sample_rate)
    sampler_state, opt_state = sampler.init(), optimizer.init(params)
    noise_key, sample_key = random.split(random.key(config.seed), 2)
    history = {"step": [], "loss": []}
    bar = tqdm(range(config.steps), desc=label, unit="step", mininterval=1.0)
    for _ in bar:
        index, sampler_state = sampler.sample(sample_key, sampler_state)
        index = torch.as_tensor(index)
        batch = (train_data[0][index], train_data[1][index])
        params, opt_state, dp_state, metrics = step_fn(params, opt_state, dp_state, batch, noise_key)
        history["step"].append(metrics.step + 1)
        history["loss"].append(metrics.loss.item())
        bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", refresh=False)
    return {
        "params": params,
        "history": history,
        "test_accuracy": _accuracy(apply, params, frozen, test_data),
    }


def run(config: DemoConfig, output_dir: Path) -> dict:
    """Calibrate, train privately and non-privately, report, and write metrics and plots to ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    print(
        f"Opake demo: {config.dataset_size} generated examples, {config.num_classes} classes, Poisson sampling at "
        f"q = {config.sample_rate:.4f}, {config.steps} steps, delta = {config.delta:.2e}"
    )

    sampler = poisson(dataset_size=config.dataset_size, sample_rate=config.sample_rate)
    calibrated = accounting.calibrate_noise_multiplier(
        lambda m: sampler.process(m, config.steps), target_epsilon=config.target_epsilon, delta=config.delta
    )
    sigma = calibrated.value
    print(f"calibrated noise multiplier {sigma:.4f} for epsilon <= {config.target_epsilon}")
    private = train(config, noise_multiplier=sigma, label="DP-SGD")
    baseline = train(config, noise_multiplier=0.0, label="non-private")
    epsilon = accounting.epsilon(sampler.process(sigma, config.steps), delta=config.delta)
    checkpoints = sorted({max(1, config.steps * i // 20) for i in range(1, 21)})
    curve = [accounting.epsilon(sampler.process(sigma, steps), delta=config.delta).value for steps in checkpoints]
    result = {
        "config": asdict(config),
        "delta": config.delta,
        "noise_multiplier": sigma,
        "epsilon": epsilon.value,
        "accountant": epsilon.accountant,
        "private_test_accuracy": private["test_accuracy"],
        "non_private_test_accuracy": baseline["test_accuracy"],
        "epsilon_curve": {"steps": checkpoints, "epsilon": curve},
        "seconds": time.perf_counter() - begin,
    }
    (output_dir / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(private["history"], baseline["history"], result, output_dir / "training.png")
    print(
        f"test accuracy: DP-SGD {private['test_accuracy']:.3f}, non-private {baseline['test_accuracy']:.3f}\n"
        f"privacy: epsilon = {epsilon.value:.3f} at delta = {config.delta:.2e} ({epsilon.accountant} accountant)\n"
        f"wrote {output_dir / 'metrics.json'} and {output_dir / 'training.png'} in {result['seconds']:.0f} s"
    )
    return result


def _plot(private: dict, baseline: dict, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    window = 10
    for history, name in ((private, "DP-SGD"), (baseline, "non-private")):
        loss = torch.tensor(history["loss"])
        smooth = loss.unfold(0, window, 1).mean(dim=1) if len(loss) >= window else loss
        ax_loss.plot(history["step"][len(history["step"]) - len(smooth) :], smooth.tolist(), label=name)
    ax_loss.set(xlabel="step", ylabel="training loss (moving mean)", title="Loss")
    ax_loss.legend()
    ax_eps.plot(result["epsilon_curve"]["steps"], result["epsilon_curve"]["epsilon"], marker="o")
    ax_eps.set(xlabel="step", ylabel="epsilon", title=f"Privacy spent (delta = {result['delta']:.1e})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``opake demo`` on the command line."""
    demo = subparsers.add_parser("demo", help="train a small model with DP-SGD on generated data")
    demo.add_argument("--output-dir", default="demo_output", help="where metrics.json and training.png go")
    demo.add_argument("--epochs", type=int, default=DemoConfig.epochs)
    demo.add_argument("--target-epsilon", type=float, default=DemoConfig.target_epsilon)
    demo.set_defaults(run=_run_command, json=False)


def _run_command(args: argparse.Namespace) -> dict:
    config = DemoConfig(epochs=args.epochs, target_epsilon=args.target_epsilon)
    result = run(config, Path(args.output_dir))
    return {key: result[key] for key in ("epsilon", "delta", "private_test_accuracy", "non_private_test_accuracy")}
