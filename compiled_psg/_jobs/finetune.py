"""``python -m compiled_psg finetune``: DP LoRA fine-tuning of a tiny Llama-style language model on the Python
standard library's docstrings (needs the ``hf`` extra: transformers and peft).

1. A Llama-style causal LM is built from a ``transformers.LlamaConfig`` (2 layers, hidden 128, byte-level
   vocabulary of 256, random weights: nothing downloads) and pre-trained briefly, *without* privacy, on the
   docstrings of one list of stdlib modules (the "public" text, ``text.PUBLIC_MODULES``).
2. LoRA adapters (peft) are added and trained with DP-SGD through ``make_private`` on the docstrings of other
   modules (the "private" text, ``text.PRIVATE_MODULES``); the base weights stay frozen.
3. Perplexity per byte is measured on held-out docstrings of the private modules before and after fine-tuning.

Privacy unit: one window of ``--seq-len`` bytes of the private text (the examples Poisson sampling draws). A
docstring that spans several windows, or a module, is covered only at group level. The pre-training text gets
no protection (it is treated as public). Prints a progress bar, perplexity before and after, and epsilon; writes
``metrics.json`` and ``perplexity.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings
from pathlib import Path

import torch

from .cli import (
    FlagError,
    config_record,
    delta,
    epsilon_text,
    flag,
    flags_without_effect,
    int_at_least,
    momentum,
    nonnegative_int,
    output_folder,
    positive_float,
    positive_int,
    positive_multiple_of,
    run,
    seed,
)
from .train import _optimizer, expected_batch, finite_epsilons, infinite_epsilon_why, write_metrics_and_plot

HF_MISSING = ("python -m compiled_psg finetune needs transformers and peft (the hf extra): "
              'pip install -e ".[hf]"  (or: pip install "transformers==5.23.0" "peft==0.21.2")')


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compiled-psg finetune", add_help=add_help,
                                description="DP LoRA fine-tuning of a tiny Llama-style model on stdlib docstrings.")
    p.add_argument("--steps", type=positive_int, default=100, help="DP fine-tuning steps (Poisson-sampled batches)")
    p.add_argument("--pretrain-steps", type=nonnegative_int, default=300,
                   help="non-private pre-training steps on the public text")
    p.add_argument("--epsilon", type=positive_float, default=8.0,
                   help="target epsilon: the noise multiplier is calibrated to reach it after --steps")
    p.add_argument("--sigma", type=positive_float, default=None, help="noise multiplier (overrides --epsilon)")
    p.add_argument("--delta", type=delta, default=1e-5)
    p.add_argument("--no-dp", action="store_true", help="non-private baseline: no clipping, no noise")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="expected batch size; the Poisson sampling rate is batch-size / training windows")
    p.add_argument("--lr", type=positive_float, default=1e-2, help="fine-tuning learning rate")
    p.add_argument("--momentum", type=momentum, default=0.9)
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adam")
    p.add_argument("--max-grad-norm", type=positive_float, default=1.0)
    p.add_argument("--lora-rank", type=positive_int, default=8)
    p.add_argument("--accountant", choices=("rdp", "pld", "prv", "opacus-rdp"), default="rdp")
    p.add_argument("--backend", choices=("inductor", "eager"), default="eager",
                   help="how the step program runs (eager: Inductor's compile of this model costs more than it "
                        "saves in a run this short)")
    p.add_argument("--seq-len", type=int_at_least(2), default=64, help="bytes per example window")
    p.add_argument("--hidden", type=positive_multiple_of(8), default=128,
                   help="model width (4 attention heads, each an even rotary dimension: a multiple of 8)")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--pretrain-batch-size", type=positive_int, default=16)
    p.add_argument("--pretrain-lr", type=positive_float, default=3e-3)
    p.add_argument("--evals", type=nonnegative_int, default=4,
                   help="held-out evaluations during fine-tuning (for the plot)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--threads", type=nonnegative_int, default=1, help="torch CPU threads (0: leave torch's setting)")
    p.add_argument("--out", type=output_folder, default=Path("runs/finetune"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def build_model(args, transformers):
    """The tiny Llama-style base: random weights from a config, byte-level vocabulary."""
    from .text import VOCAB_SIZE

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq_len, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        loss_type="ForCausalLM")  # loss_type set: else transformers warns inside the loss (a graph break)
    return transformers.LlamaForCausalLM(config)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 128) -> float:
    """exp of the mean next-byte cross-entropy over every predicted byte of ``windows``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        x = windows[start:start + batch_size]
        logits = model(input_ids=x).logits[:, :-1]
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                   reduction="sum").item()
        count += x[:, 1:].numel()
    model.train(was_training)
    return math.exp(total / count)


def pretrain(model, windows: torch.Tensor, args, bar) -> list[float]:
    """Plain (non-private) AdamW on the public text; returns the losses."""
    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr)
    losses = []
    for _ in range(args.pretrain_steps):
        x = windows[torch.randint(0, len(windows), (args.pretrain_batch_size,), generator=g)]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.update(1)
    return losses


def _trainer(args, model, train: torch.Tensor):
    """``(step, batches, epsilon_fn, info, dp_step)``: ``batches()`` yields fine-tuning batches forever."""
    from torch.utils.data import DataLoader, TensorDataset

    from .._train.accounting import calibrate_noise
    from .._train.api import compile_step
    from .._train.private import make_private

    def loss_fn(x):  # the mean over the window's predicted bytes; per sample: that window's own mean
        return model(input_ids=x, labels=x).loss

    dataset = TensorDataset(train)
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = _optimizer(args, [p for p in model.parameters() if p.requires_grad])
    batch = expected_batch(args, len(train), "private training windows")
    if args.no_dp:
        step = compile_step(loss_fn, model, optimizer, backend=args.backend)
        loader = DataLoader(dataset, batch_size=batch, shuffle=True, generator=generator)
        info = dict(noise_multiplier=0.0, sample_rate=None)
        return step, loader, lambda: math.inf, info, step
    q = batch / len(train)
    sigma = args.sigma if args.sigma is not None else calibrate_noise(args.epsilon, args.delta, q, args.steps,
                                                                       args.accountant)
    private = make_private(model, optimizer, DataLoader(dataset, batch_size=batch), loss_fn, noise_multiplier=sigma,
                           target_delta=args.delta, max_grad_norm=args.max_grad_norm, accountant=args.accountant,
                           backend=args.backend, generator=generator, sample_rate=q)
    info = dict(noise_multiplier=private.noise_multiplier, sample_rate=q,
                expected_batch_size=private.expected_batch_size)
    return private.step, private.data_loader, private.epsilon, info, private.dp_step


def finetune(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tiny configs only: nothing may download
    try:
        import peft
        import transformers
    except ImportError as e:
        raise SystemExit(f"{HF_MISSING}\n({e})") from None
    from tqdm import tqdm

    from .text import PRIVATE_MODULES, PUBLIC_MODULES, load_corpus

    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus = load_corpus(length=args.seq_len)
    if min(len(corpus.public), len(corpus.private_train), len(corpus.private_test)) == 0:
        in_bytes = load_corpus(length=1)  # windows of one byte: each text's length
        sizes = {"public": len(in_bytes.public), "private training": len(in_bytes.private_train),
                 "held-out": len(in_bytes.private_test)}
        shortest = min(sizes, key=sizes.get)
        raise FlagError(f"argument --seq-len: {args.seq_len} bytes is longer than the {shortest} text "
                        f"({sizes[shortest]} bytes): use at most {sizes[shortest]}")
    expected_batch(args, len(corpus.private_train), "private training windows")  # a usage error before the run
    model = build_model(args, transformers)
    base_params = sum(p.numel() for p in model.parameters())
    print(f"text: stdlib docstrings, byte-level windows of {args.seq_len}: {len(corpus.public)} public windows "
          f"({len(PUBLIC_MODULES)} modules) for pre-training; {len(corpus.private_train)} private training and "
          f"{len(corpus.private_test)} held-out windows ({len(PRIVATE_MODULES)} other modules)", flush=True)
    bar = tqdm(total=args.pretrain_steps + args.steps, disable=args.no_progress, unit="step", dynamic_ncols=True)
    bar.set_description("pre-train (non-private)")
    pretrain_losses = pretrain(model, corpus.public, args, bar)
    pretrain_seconds = time.perf_counter() - start

    lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = peft.get_peft_model(model, lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    before = perplexity(model, corpus.private_test)  # LoRA starts at B = 0: the pre-trained base itself
    bar.write(f"held-out perplexity before fine-tuning: {before:.3f} (pre-trained base, {base_params:,} "
              f"parameters; unigram: {unigram_perplexity(corpus):.3f})")
    setup_start = time.perf_counter()
    step, loader, epsilon_fn, info, dp_step = _trainer(args, model, corpus.private_train)
    mode = ("non-private" if args.no_dp
            else f"DP-SGD sigma={info['noise_multiplier']:.4g} q={info['sample_rate']:.4f} C={args.max_grad_norm:g}")
    bar.write(f"fine-tune: LoRA rank {args.lora_rank}, {trained:,} trained parameters, {mode}, backend={args.backend}"
              + ("" if args.no_dp else f"; privacy unit: one {args.seq_len}-byte window of the private text (the "
                                        "public pre-training text is not protected)"))
    bar.set_description("DP fine-tune" if not args.no_dp else "fine-tune (non-private)")
    history = [dict(step=0, perplexity=before, epsilon=0.0 if not args.no_dp else None, elapsed_seconds=0.0)]
    eval_at = {round(args.steps * k / args.evals) for k in range(1, args.evals + 1)} if args.evals else set()
    losses, taken, samples = [], 0, 0
    train_start = time.perf_counter()
    while taken < args.steps:
        for (x,) in loader:
            loss = step(x)
            if len(x):  # an empty batch's step is noise alone, and its loss (a mean over nothing) NaN
                losses.append(float(loss))
            taken, samples = taken + 1, samples + len(x)
            bar.update(1)
            if taken in eval_at or taken == args.steps:
                eps = epsilon_fn()
                ppl = perplexity(model, corpus.private_test)
                history.append(dict(step=taken, perplexity=ppl, epsilon=None if math.isinf(eps) else eps,
                                    elapsed_seconds=time.perf_counter() - train_start))
                bar.set_postfix(ppl=f"{ppl:.2f}", eps=f"{eps:.2f}")
            if taken == args.steps:
                break
    bar.close()
    finetune_seconds = time.perf_counter() - setup_start
    wall = time.perf_counter() - start
    after, eps = history[-1]["perplexity"], history[-1]["epsilon"]
    metrics = dict(
        config=config_record(args, DP_FLAGS),
        corpus=dict(public_modules=list(PUBLIC_MODULES), private_modules=list(PRIVATE_MODULES),
                    public_windows=len(corpus.public), private_train_windows=len(corpus.private_train),
                    private_test_windows=len(corpus.private_test), seq_len=args.seq_len,
                    privacy_unit=f"one window of {args.seq_len} bytes of the private text"),
        model=dict(base_parameters=base_params, trained_parameters=trained, lora_rank=args.lora_rank),
        mechanism=dict(info, private=not args.no_dp, max_grad_norm=None if args.no_dp else args.max_grad_norm,
                       delta=None if args.no_dp else args.delta, accountant=None if args.no_dp else args.accountant),
        pretrain=dict(steps=args.pretrain_steps, first_loss=pretrain_losses[0] if pretrain_losses else None,
                      last_loss=pretrain_losses[-1] if pretrain_losses else None, seconds=pretrain_seconds),
        history=history,
        final=dict(perplexity_before=before, perplexity_after=after, epsilon=eps,
                   delta=None if args.no_dp else args.delta,
                   steps=taken, train_loss=sum(losses[-20:]) / max(len(losses[-20:]), 1),
                   wall_seconds=wall, finetune_seconds=finetune_seconds,
                   compile_seconds=dp_step.compile_seconds, samples=samples))
    write_outputs(metrics, args.out)
    eps_text = epsilon_text(eps, not args.no_dp)
    print(f"final: held-out perplexity {before:.3f} -> {after:.3f} (per byte, docstrings of modules the base never "
          f"saw), epsilon {eps_text} at delta={args.delta:g}, wall {wall:.1f}s (capture/compile "
          f"{dp_step.compile_seconds:.1f}s); wrote {args.out / 'metrics.json'} and {args.out / 'perplexity.png'}",
          flush=True)
    return metrics


def unigram_perplexity(corpus) -> float:
    """The held-out perplexity of byte frequencies counted on the private training text (add-one smoothed): the
    reference any model that learned something beats."""
    counts = torch.bincount(corpus.private_train.reshape(-1), minlength=256).double() + 1.0
    logp = (counts / counts.sum()).log()
    test = corpus.private_test[:, 1:].reshape(-1)
    return math.exp(-logp[test].mean().item())


def write_outputs(metrics: dict, out: Path) -> None:
    """``metrics.json`` and ``perplexity.png`` (held-out perplexity against epsilon and against the step)."""
    rows = metrics["history"]
    write_metrics_and_plot(
        metrics, out, "perplexity.png", [r["perplexity"] for r in rows], "held-out perplexity per byte",
        (finite_epsilons(metrics, rows), [r["step"] for r in rows], "step " + infinite_epsilon_why(metrics)),
        ([r["step"] for r in rows], "fine-tuning step"),
        ("perplexity against privacy spent", "perplexity during fine-tuning"))


DP_FLAGS = ("epsilon", "sigma", "delta", "max_grad_norm", "accountant")  # nothing without DP


def check_flags(args) -> str | None:
    """A flag the others make do nothing: a usage error (see ``cli.flags_without_effect``)."""
    if args.pretrain_steps == 0:
        for dest in ("pretrain_batch_size", "pretrain_lr"):
            if dest in args.given:
                return f"argument {flag(dest)}: has no effect with --pretrain-steps 0: drop one of them"
    return flags_without_effect(args, DP_FLAGS)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), finetune, argv, check=check_flags)
