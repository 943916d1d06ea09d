"""``python -m compiled_psg train``: a small CNN on scikit-learn's digits with DP-SGD (or ``--no-dp``).

Prints a progress bar and, per epoch, test accuracy, epsilon, samples/second and compile time; writes
``metrics.json`` and ``accuracy.png`` (accuracy against epsilon and against wall time) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cli import (
    FlagError,
    config_record,
    delta,
    epsilon_text,
    flags_without_effect,
    momentum,
    nonnegative_int,
    output_folder,
    positive_float,
    positive_int,
    run,
    seed,
)

DEFAULTS = dict(epochs=30, epsilon=8.0, delta=1e-5, batch_size=256, lr=0.25, momentum=0.9, max_grad_norm=1.0,
                optimizer="sgd")
DP_FLAGS = ("epsilon", "sigma", "delta", "max_grad_norm", "accountant", "secure_rng")  # nothing without DP


def small_cnn() -> nn.Module:
    """Two 3x3 convolutions with tanh (bounded activations suit clipped training), max-pooling, a linear
    head: 6,570 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 10))


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compiled-psg train", add_help=add_help,
                                description="Train a small CNN on scikit-learn's digits with DP-SGD.")
    p.add_argument("--epochs", type=positive_int, default=DEFAULTS["epochs"])
    p.add_argument("--epsilon", type=positive_float, default=DEFAULTS["epsilon"],
                   help="target epsilon: the noise multiplier is calibrated to reach it after --epochs")
    p.add_argument("--sigma", type=positive_float, default=None, help="noise multiplier (overrides --epsilon)")
    p.add_argument("--delta", type=delta, default=DEFAULTS["delta"])
    p.add_argument("--no-dp", action="store_true", help="non-private baseline: no clipping, no noise")
    p.add_argument("--batch-size", type=positive_int, default=DEFAULTS["batch_size"],
                   help="expected batch size; the Poisson sampling rate is batch-size / training-set size")
    p.add_argument("--lr", type=positive_float, default=DEFAULTS["lr"])
    p.add_argument("--momentum", type=momentum, default=DEFAULTS["momentum"])
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=DEFAULTS["optimizer"])
    p.add_argument("--max-grad-norm", type=positive_float, default=DEFAULTS["max_grad_norm"])
    p.add_argument("--accountant", choices=("rdp", "pld", "prv", "opacus-rdp"), default="rdp")
    p.add_argument("--secure-rng", action="store_true", help="noise and sampling from os.urandom")
    p.add_argument("--backend", choices=("inductor", "eager"), default="inductor",
                   help="how the step program (forward, rewritten backward, clipping, noise, update) runs")
    p.add_argument("--train-subset", type=positive_int, default=None, help="use only this many training examples")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--threads", type=nonnegative_int, default=1,
                   help="torch CPU threads (1: these tensors are too small to gain from more, and extra "
                        "threads stall badly on a shared machine; 0: leave torch's setting)")
    p.add_argument("--out", type=output_folder, default=Path("runs/digits"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _optimizer(args, params):
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=args.lr)


def _accuracy(model: nn.Module, dataset) -> float:
    x, y = dataset.tensors
    was_training = model.training
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).sum().item()
    model.train(was_training)
    return correct / len(y)


def expected_batch(args, examples: int, what: str) -> int:
    """``--batch-size``, at most ``examples``: a default above it is lowered (a sampling rate of 1), a given one
    is a usage error (it would not be the batch size that ran)."""
    if args.batch_size > examples and "batch_size" in args.given:
        raise FlagError(f"argument --batch-size: {args.batch_size} is more than the {examples} {what}: use at most "
                        f"{examples}")
    return min(args.batch_size, examples)


def _trainer(args, model, train):
    """``(step, loader, epsilon_fn, info)`` for a private or a non-private run."""
    from torch.utils.data import DataLoader

    from .._train.api import compile_step
    from .._train.private import make_private

    loss_fn = lambda x, y: F.cross_entropy(model(x), y)
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = _optimizer(args, model.parameters())
    batch = expected_batch(args, len(train), "training examples")
    if args.no_dp:
        step = compile_step(loss_fn, model, optimizer, backend=args.backend)
        loader = DataLoader(train, batch_size=batch, shuffle=True, generator=generator)
        return step, loader, lambda: math.inf, dict(noise_multiplier=0.0, sample_rate=None), step
    q = batch / len(train)
    private = make_private(model, optimizer, DataLoader(train, batch_size=batch), loss_fn,
                           noise_multiplier=args.sigma,
                           target_epsilon=None if args.sigma is not None else args.epsilon,
                           target_delta=args.delta, epochs=None if args.sigma is not None else args.epochs,
                           max_grad_norm=args.max_grad_norm,
                           accountant=args.accountant, secure_rng=args.secure_rng, backend=args.backend,
                           generator=None if args.secure_rng else generator, sample_rate=q)
    info = dict(noise_multiplier=private.noise_multiplier, sample_rate=q,
                expected_batch_size=private.expected_batch_size)
    return private.step, private.data_loader, private.epsilon, info, private.dp_step


def train(args) -> dict:
    from tqdm import tqdm

    from .data import load_digits

    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_set, test_set = load_digits(seed=args.seed, train_subset=args.train_subset)
    if args.train_subset is not None and args.train_subset > len(train_set):
        raise FlagError(f"argument --train-subset: {args.train_subset} is more than the {len(train_set)} training "
                        f"examples: use at most {len(train_set)}")
    model = small_cnn()
    step, loader, epsilon_fn, info, dp_step = _trainer(args, model, train_set)
    mode = ("non-private" if args.no_dp
            else f"DP-SGD sigma={info['noise_multiplier']:.4g} q={info['sample_rate']:.4f}")
    print(f"digits: {len(train_set)} train / {len(test_set)} test, {mode}, backend={args.backend}",
          flush=True)
    history = []
    samples_total, train_seconds = 0, 0.0
    bar = tqdm(total=args.epochs * len(loader), disable=args.no_progress, unit="step", dynamic_ncols=True)
    for epoch in range(1, args.epochs + 1):
        epoch_start, samples, losses = time.perf_counter(), 0, []
        for x, y in loader:
            loss = step(x, y)
            if len(y):  # an empty batch's step is noise alone, and its loss (a mean over nothing) NaN
                losses.append(float(loss))
            samples += len(y)
            bar.update(1)
        epoch_seconds = time.perf_counter() - epoch_start
        samples_total, train_seconds = samples_total + samples, train_seconds + epoch_seconds
        accuracy, eps = _accuracy(model, test_set), epsilon_fn()
        row = dict(epoch=epoch, test_accuracy=accuracy, epsilon=None if math.isinf(eps) else eps,
                   train_loss=sum(losses) / max(len(losses), 1), samples=samples,
                   samples_per_second=samples / epoch_seconds, compile_seconds=dp_step.compile_seconds,
                   elapsed_seconds=time.perf_counter() - start)
        history.append(row)
        bar.set_postfix(acc=f"{accuracy:.3f}", eps=f"{eps:.2f}")
        bar.write(f"epoch {epoch:3d}  test acc {accuracy:.4f}  epsilon {eps:.3f}  "
                  f"{row['samples_per_second']:.0f} samples/s  compile {dp_step.compile_seconds:.1f}s")
    bar.close()
    wall = time.perf_counter() - start
    final = history[-1] if history else {}
    metrics = dict(
        config=config_record(args, DP_FLAGS),
        dataset=dict(train=len(train_set), test=len(test_set)),
        mechanism=dict(info, private=not args.no_dp, max_grad_norm=None if args.no_dp else args.max_grad_norm,
                       delta=None if args.no_dp else args.delta, accountant=None if args.no_dp else args.accountant),
        epochs=history,
        final=dict(test_accuracy=final.get("test_accuracy"), epsilon=final.get("epsilon"),
                   delta=None if args.no_dp else args.delta,
                   wall_seconds=wall, compile_seconds=dp_step.compile_seconds,
                   samples_per_second=samples_total / train_seconds if train_seconds else None,
                   captures=dp_step.per_sample.captures, program_builds=dp_step.program_builds,
                   programs_per_step=dp_step.programs))
    write_outputs(metrics, args.out)
    eps_text = epsilon_text(final.get("epsilon"), not args.no_dp)
    print(f"final: test accuracy {final.get('test_accuracy', float('nan')):.4f}, epsilon {eps_text} at "
          f"delta={args.delta:g}, wall {wall:.1f}s (compile {dp_step.compile_seconds:.1f}s); "
          f"wrote {args.out / 'metrics.json'} and {args.out / 'accuracy.png'}", flush=True)
    return metrics


def write_metrics_and_plot(metrics: dict, out: Path, png: str, y: list, y_label: str,
                           left: tuple[list | None, list, str], right: tuple[list, str],
                           titles: tuple[str, str]) -> None:
    """``out/metrics.json`` and ``out/png``: ``y`` against epsilon (``left``: (epsilons or None when non-private,
    the fallback x values, the fallback x label)) and against ``right`` ((x values, x label))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    fig, (ax_eps, ax_right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    epsilons, fallback_x, fallback_label = left
    if epsilons is not None:
        ax_eps.plot(epsilons, y, marker="o")
        ax_eps.set_xlabel(f"epsilon (delta={metrics['mechanism']['delta']:g})")
    else:
        ax_eps.plot(fallback_x, y, marker="o")
        ax_eps.set_xlabel(fallback_label)
    ax_eps.set_title(titles[0])
    ax_right.plot(right[0], y, marker="o")
    ax_right.set_xlabel(right[1])
    ax_right.set_title(titles[1])
    for ax in (ax_eps, ax_right):
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
    fig.savefig(out / png, dpi=100)
    plt.close(fig)


def finite_epsilons(metrics: dict, rows: list[dict]) -> list[float] | None:
    """The rows' epsilons for the plot's x axis; None where one is infinite (null in ``metrics.json``)."""
    epsilons = [r["epsilon"] for r in rows]
    return epsilons if epsilons and None not in epsilons else None


def infinite_epsilon_why(metrics: dict) -> str:
    if metrics["mechanism"]["private"]:
        return "(epsilon is infinite: the noise is too small for a finite bound)"
    return "(non-private: epsilon is infinite)"


def write_outputs(metrics: dict, out: Path) -> None:
    """``metrics.json`` and ``accuracy.png`` (test accuracy against epsilon, and against wall time)."""
    rows = metrics["epochs"]
    write_metrics_and_plot(
        metrics, out, "accuracy.png", [r["test_accuracy"] for r in rows], "test accuracy",
        (finite_epsilons(metrics, rows), [r["epoch"] for r in rows], "epoch " + infinite_epsilon_why(metrics)),
        ([r["elapsed_seconds"] for r in rows], "wall time (s, compilation included)"),
        ("accuracy against privacy spent", "accuracy against time"))


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), train, argv, check=lambda args: flags_without_effect(args, DP_FLAGS))
