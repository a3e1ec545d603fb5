"""The ``opake demo`` job: private fine-tuning of a small causal LM that must not memorize planted secrets.

The corpus is generated: synthetic customer records ("name: ... city: ... order: ...") plus a few *canaries*,
records that carry a secret six-digit code, each repeated several times. A small Llama-style model (random init,
character-level vocabulary, nothing downloaded) is fine-tuned twice with :class:`DPTrainer`:

* privately, with the noise calibrated to a target epsilon under Poisson sampling;
* non-privately (noise multiplier 0, no clipping), as the baseline.

Every record belongs to a user: each customer has ``rows_per_user`` records, and each canary's repeats belong to one
user, its owner. With ``privacy_unit="record"`` (the default) the guarantee protects one record, so a canary repeated
in 8 records is protected only as a group of 8; ``privacy_unit="user"`` (``opake demo --privacy-unit user``) protects
each user with all its records, the canary's owner included.

After training, every canary's true code is ranked among ``candidates`` random codes by the model's likelihood.
A model that memorized the canary ranks the true code near the top (high *exposure*, Carlini et al. 2019); the
private model's ranks stay close to uniform. The run prints progress, the final epsilon and both exposures, and
writes ``metrics.json`` and ``training.png`` (loss and epsilon against steps; exposures) to the output folder.
"""

from __future__ import annotations

import argparse
import json
import math
import string
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from opake_torch import limits
from opake_torch._cli_types import number, writable_dir
from opake_torch.transformers.loss import causal_lm_loss

__all__ = ["DemoConfig", "add_demo_command", "exposure", "make_corpus", "make_user_corpus", "run"]

MAX_EPOCHS = 100  # the default 4 take about a minute on two CPU cores; 100 about half an hour

ALPHABET = string.ascii_lowercase + string.digits + " :;.,-\n"
NAMES = ["ada", "bo", "cyd", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu", "max", "nia", "oz", "pia"]
CITIES = ["oslo", "lima", "rome", "kyiv", "doha", "baku", "riga", "nice", "bern", "cork"]
COUNTS = ["1", "2", "3", "4", "5"]
ITEMS = ["lamp", "desk", "sofa", "mug", "rug", "fan", "pen", "bag", "cup", "hat"]


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo needs; the defaults take about a minute on two idle CPU cores."""

    records: int = 800
    canaries: int = 4
    canary_repeats: int = 8
    candidates: int = 500
    batch_size: int = 32
    epochs: float = 4.0
    learning_rate: float = 3e-3
    clipping_norm: float = 1.0
    target_epsilon: float = 3.0
    hidden_size: int = 48
    layers: int = 2
    seed: int = 0
    noise_seed: int | None = None  # None: secret noise keys, as a real run has; an int replays the run (tests)
    privacy_unit: str = "record"  # or "user": a user with all its records (batch_size then counts users)
    rows_per_user: int = 2  # the records of each customer; a canary's repeats all belong to its owner


class CharTokenizer:
    """A character-level tokenizer over :data:`ALPHABET` (id 0 is padding)."""

    pad_token_id = 0

    def __init__(self) -> None:
        self.ids = {ch: i + 1 for i, ch in enumerate(ALPHABET)}

    @property
    def vocab_size(self) -> int:
        return len(ALPHABET) + 1

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.ids[ch] for ch in text], dtype=torch.long)


def _code(gen: torch.Generator) -> str:
    return "".join(str(d) for d in torch.randint(0, 10, (6,), generator=gen).tolist())


def _pick(options: list[str], gen: torch.Generator) -> str:
    return options[int(torch.randint(0, len(options), (1,), generator=gen))]


def make_corpus(config: DemoConfig) -> tuple[list[str], list[tuple[str, str]]]:
    """Synthetic records and the canaries ``(prefix, secret code)``; each canary is repeated in the corpus."""
    corpus, _, canaries = make_user_corpus(config)
    return corpus, canaries


def make_user_corpus(config: DemoConfig) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """:func:`make_corpus` with the user of each record: customer ``i // rows_per_user`` for the ``i``-th record,
    ``canary-c`` for every repeat of canary ``c``."""
    gen = torch.Generator().manual_seed(config.seed)
    records = [
        f"name: {_pick(NAMES, gen)}; city: {_pick(CITIES, gen)}; order: {_pick(ITEMS, gen)} x{_pick(COUNTS, gen)}."
        for _ in range(config.records)
    ]
    canaries = [(f"name: {NAMES[i]}; code: ", _code(gen)) for i in range(config.canaries)]
    corpus = records + [prefix + code + "." for prefix, code in canaries for _ in range(config.canary_repeats)]
    users = [f"customer-{i // config.rows_per_user}" for i in range(config.records)]
    users += [f"canary-{c}" for c in range(config.canaries) for _ in range(config.canary_repeats)]
    order = torch.randperm(len(corpus), generator=gen).tolist()
    return [corpus[i] for i in order], [users[i] for i in order], canaries


def _model(config: DemoConfig, vocab_size: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=2 * config.hidden_size,
        num_hidden_layers=config.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(llama)
    model.config._attn_implementation = "eager"
    return model


def exposure(
    model: torch.nn.Module, tokenizer: CharTokenizer, canary: tuple[str, str], candidates: int, seed: int
) -> float:
    """``log2(candidates + 1) - log2(rank)`` of the true code among random codes, ranked by the model's loss."""
    prefix, secret = canary
    gen = torch.Generator().manual_seed(seed)
    codes = [secret] + [_code(gen) for _ in range(candidates)]
    ids = torch.stack([tokenizer.encode(prefix + code + ".") for code in codes])
    labels = ids.clone()
    labels[:, : len(prefix)] = -100  # score only the code
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        losses = torch.vmap(causal_lm_loss)(logits, labels)
    rank = 1 + int((losses[1:] < losses[0]).sum())
    return math.log2(len(codes)) - math.log2(rank)


def train(config: DemoConfig, output_dir: Path, *, private: bool) -> dict:
    """Fine-tune the demo model with DPTrainer, privately or as the non-private baseline."""
    from opake_torch.transformers import DPTrainer, TrainingArguments

    tokenizer = CharTokenizer()
    corpus, users, canaries = make_user_corpus(config)
    dataset = [{"input_ids": tokenizer.encode(text), "user": user} for text, user in zip(corpus, users, strict=True)]
    privacy = (
        {"privacy_target_epsilon": config.target_epsilon, "clipping_norm": config.clipping_norm}
        if private
        else {"privacy_noise_multiplier": 0.0, "clipping_norm": math.inf}
    )
    units = len(dataset)
    if private and config.privacy_unit == "user":  # all of a user's records are one unit; a step draws users
        privacy |= {"privacy_unit": "user", "privacy_user_column": "user",
                    "privacy_max_rows_per_user": max(config.rows_per_user, config.canary_repeats)}  # fmt: skip
        units = len(set(users))
    steps = math.ceil(config.epochs * units / config.batch_size)
    args = TrainingArguments(
        str(output_dir / ("private" if private else "non_private")),
        per_device_train_batch_size=config.batch_size,
        max_steps=steps,
        learning_rate=config.learning_rate,
        lr_scheduler="constant",
        optim="adam",
        logging_steps=max(1, steps // 20),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=config.seed,
        privacy_noise_seed=config.noise_seed,
        **privacy,
    )
    trainer = DPTrainer(_model(config, tokenizer.vocab_size), args, train_dataset=dataset)
    output = trainer.train()
    history = [row for row in trainer.state.log_history if "loss" in row]
    exposures = [
        exposure(trainer.model, tokenizer, c, config.candidates, config.seed + i) for i, c in enumerate(canaries)
    ]
    return {
        "steps": [row["step"] for row in history],
        "loss": [row["loss"] for row in history],
        "epsilon": [row.get("privacy_epsilon", math.inf) for row in history],
        "final_epsilon": output.metrics.get("privacy_epsilon", math.inf),
        "delta": trainer.state.privacy_resolved_delta,
        "noise_multiplier": trainer.state.privacy_resolved_noise_multiplier,
        "exposures": exposures,
        "dataset_size": len(dataset),
        "privacy_unit": config.privacy_unit if private else None,
        "units": units,
    }


def run(config: DemoConfig, output_dir: Path) -> dict:
    """Train privately and non-privately, report, and write metrics and plots to ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    max_exposure = math.log2(config.candidates + 1)
    print(
        f"Opake demo: fine-tune a {config.layers}-layer Llama-style model on {config.records} generated records and "
        f"{config.canaries} planted secrets (each repeated {config.canary_repeats} times)"
    )
    private = train(config, output_dir, private=True)
    unit = "one user with all its records" if config.privacy_unit == "user" else "one record"
    print(f"DP-SGD: epsilon = {private['final_epsilon']:.3f} at delta = {private['delta']:.2e} for {unit}")
    baseline = train(config, output_dir, private=False)
    result = {
        "config": asdict(config),
        "private": private,
        "non_private": baseline,
        "max_exposure": max_exposure,
        "seconds": time.perf_counter() - begin,
    }
    (output_dir / "metrics.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    _plot(result, output_dir / "training.png")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(
        f"canary exposure (of {max_exposure:.1f} bits; about 1 bit = chance): "
        f"non-private {mean(baseline['exposures']):.2f}, private {mean(private['exposures']):.2f}\n"
        f"privacy: epsilon = {private['final_epsilon']:.3f} at delta = {private['delta']:.2e} for {unit} "
        f"(noise multiplier {private['noise_multiplier']:.3f}, PLD accountant, Poisson sampling)\n"
        f"wrote {output_dir / 'metrics.json'} and {output_dir / 'training.png'} in {result['seconds']:.0f} s"
    )
    return result


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    private, baseline = result["private"], result["non_private"]
    fig, (ax_loss, ax_eps, ax_exp) = plt.subplots(1, 3, figsize=(14, 4))
    ax_loss.plot(private["steps"], private["loss"], label="DP-SGD")
    ax_loss.plot(baseline["steps"], baseline["loss"], label="non-private")
    ax_loss.set(xlabel="step", ylabel="training loss", title="Loss")
    ax_loss.legend()
    ax_eps.plot(private["steps"], private["epsilon"], marker="o")
    ax_eps.set(xlabel="step", ylabel="epsilon", title=f"Privacy spent (delta = {private['delta']:.1e})")
    width = 0.4
    positions = range(len(private["exposures"]))
    ax_exp.bar([p - width / 2 for p in positions], baseline["exposures"], width, label="non-private")
    ax_exp.bar([p + width / 2 for p in positions], private["exposures"], width, label="DP-SGD")
    ax_exp.axhline(result["max_exposure"], color="grey", linestyle="--", linewidth=1)
    ax_exp.set_xticks(list(positions))
    ax_exp.set(xlabel="canary", ylabel="exposure (bits)", title="Memorization of planted secrets")
    ax_exp.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``opake demo`` on the command line."""
    demo = subparsers.add_parser("demo", help="private fine-tuning of a small causal LM with planted secrets")
    demo.add_argument(
        "--output-dir", type=writable_dir, default="demo_output", help="where metrics.json and training.png go"
    )
    demo.add_argument(
        "--epochs",
        type=number(0, MAX_EPOCHS, open_low=True, why="the default 4 take about a minute on a CPU"),
        default=DemoConfig.epochs,
    )
    demo.add_argument(
        "--target-epsilon",
        type=number(0, limits.MAX_SCALE, open_low=True, why="an epsilon anywhere near the top protects nothing"),
        default=DemoConfig.target_epsilon,
    )
    demo.add_argument(
        "--privacy-unit",
        choices=("record", "user"),
        default=DemoConfig.privacy_unit,
        help="protect one record (default) or one user with all its records (a canary's owner has 8)",
    )
    demo.set_defaults(run=_run_command, json=False)


def _run_command(args: argparse.Namespace) -> dict:
    chosen = {"epochs": args.epochs, "target_epsilon": args.target_epsilon, "privacy_unit": args.privacy_unit}
    config = replace(DemoConfig(), **chosen)
    result = run(config, Path(args.output_dir))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "epsilon": result["private"]["final_epsilon"],
        "delta": result["private"]["delta"],
        "private_exposure": mean(result["private"]["exposures"]),
        "non_private_exposure": mean(result["non_private"]["exposures"]),
    }
