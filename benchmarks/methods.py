"""The methods, as a table: ``METHODS[name]`` holds a setup function that takes a ``Workload`` and returns a
``Prepared``, whose ``run(*batch)`` is the thing timed.

Each setup works on its own deep copy of the model, so hooks, wrappers and optimizer steps of one method
never touch another. ``kind`` says what ``run`` computes, and ``canonical(out)`` turns its raw output into the
common form the check compares with a ``vmap(grad)`` reference (rescaling mean-loss conventions there, outside
the timed call):

- ``grads``: ``{name: [B, *shape]}``, the gradient of each sample's loss alone;
- ``norms``: ``[B]``; ``variance``: ``{name: shape}`` (population variance over samples);
- ``gram``: ``[B, B]``, the inner products of the per-sample gradients;
- ``backward`` / ``step``: no result to check (a plain backward, or a training step that updates the weights).

A DP step (every ``dp_*`` method) is: per-sample clip to ``MAX_NORM``, sum, add N(0, sigma^2 MAX_NORM^2),
divide by the batch size, ``optimizer.step()``. The baseline for those is ``sgd_step``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from .models import Workload

MAX_NORM = 1.0
NOISE_MULTIPLIER = 1.0
LR = 0.01


@dataclass
class Prepared:
    run: Callable
    canonical: Callable = lambda out: out
    counters: Callable[[], dict] | None = None  # compiles so far (and more), for methods that compile
    note: str = ""  # how the method was configured for this model, when that differs between models


@dataclass(frozen=True)
class Method:
    label: str
    group: str  # "baseline", "per-sample grads", "norms", "DP step", "variance", "gram"
    kind: str  # see the module docstring
    setup: Callable[[Workload], Prepared]


# -- helpers ---------------------------------------------------------------------------------------


def _copy(wl: Workload) -> tuple[nn.Module, list[str]]:
    model = copy.deepcopy(wl.model)
    return model, [n for n, _ in model.named_parameters()]


def _grad_samples(model: nn.Module, names: list[str], attr: str = "grad_sample") -> list:
    """What a hook-based library stored on each parameter; an error naming the parameters it skipped."""
    found = [getattr(p, attr, None) for p in model.parameters()]
    missing = [n for n, t in zip(names, found, strict=True) if t is None]
    if missing:
        raise RuntimeError(f"no {attr} for {len(missing)} of {len(names)} parameters ({', '.join(missing[:2])}, ...)")
    return found


def _named(names: list[str], tensors: list, scale: float = 1.0) -> dict:
    return {n: t * scale for n, t in zip(names, tensors, strict=True)}


def noisy_step(params: list[tuple[str, nn.Parameter]], sums: dict, batch_size: int, opt) -> None:
    """The DP-SGD update from clipped sums: add Gaussian noise, divide by B, write ``p.grad``, step."""
    std = NOISE_MULTIPLIER * MAX_NORM
    for name, p in params:
        p.grad = (sums[name] + std * torch.randn_like(p)) / batch_size
    opt.step()


class CountingInductor:
    """A torch.compile backend that counts its compiles (one per graph: with fullgraph, one per recompile)."""

    def __init__(self):
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.compiles += 1
        return lookup_backend("inductor")(gm, example_inputs)


# -- baselines -------------------------------------------------------------------------------------


def backward(wl: Workload) -> Prepared:
    model, _ = _copy(wl)

    def run(x, y):
        model.zero_grad(set_to_none=True)
        wl.criterion(model(x), y).backward()

    return Prepared(run)


def sgd_step(wl: Workload) -> Prepared:
    model, _ = _copy(wl)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def run(x, y):
        opt.zero_grad(set_to_none=True)
        wl.criterion(model(x), y).backward()
        opt.step()

    return Prepared(run)


def _compiled_loss(wl: Workload, model: nn.Module, backend: CountingInductor):
    """forward + loss under ``torch.compile`` with static shapes; ``.backward()`` on its result runs the backward
    graph AOT autograd compiled with it."""
    return torch.compile(lambda x, y: wl.criterion(model(x), y), backend=backend, fullgraph=True, dynamic=False)


def backward_compile(wl: Workload) -> Prepared:
    """The ordinary backward, compiled: ``torch.compile`` (Inductor, static shapes) of forward + loss, whose
    backward is compiled with it."""
    model, _ = _copy(wl)
    backend = CountingInductor()
    loss = _compiled_loss(wl, model, backend)

    def run(x, y):
        model.zero_grad(set_to_none=True)
        loss(x, y).backward()

    return Prepared(run, counters=lambda: {"compiles": backend.compiles})


def sgd_step_compile(wl: Workload) -> Prepared:
    """The plain SGD step, compiled: forward + loss + backward as in ``backward_compile``, and
    ``optimizer.step()`` under its own ``torch.compile`` (the recipe of PyTorch's compiled-optimizer tutorial:
    Dynamo cannot trace ``loss.backward()`` into the same graph without compiled autograd)."""
    model, _ = _copy(wl)
    backend = CountingInductor()
    loss = _compiled_loss(wl, model, backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = torch.compile(opt.step, backend=backend, fullgraph=False, dynamic=False)

    def run(x, y):
        opt.zero_grad(set_to_none=True)
        loss(x, y).backward()
        step()

    return Prepared(run, counters=lambda: {"compiles": backend.compiles})


# -- torch.func ------------------------------------------------------------------------------------


def _func_grads(wl: Workload, model: nn.Module):
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def loss_one(params, x, y):
        out = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return wl.criterion(out, y.unsqueeze(0))

    return params, vmap(grad(loss_one), in_dims=(None, 0, 0))


def clip_and_sum(grads: dict) -> dict:
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    factors = (MAX_NORM / norms).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factors, g) for n, g in grads.items()}


def func_vmap(wl: Workload) -> Prepared:
    model, _ = _copy(wl)
    params, per_sample = _func_grads(wl, model)
    return Prepared(lambda x, y: per_sample(params, x, y))


def func_compile(wl: Workload) -> Prepared:
    model, _ = _copy(wl)
    params, per_sample = _func_grads(wl, model)
    backend = CountingInductor()
    compiled = torch.compile(per_sample, backend=backend, fullgraph=True)
    return Prepared(lambda x, y: compiled(params, x, y), counters=lambda: {"compiles": backend.compiles})


def func_compile_dp(wl: Workload) -> Prepared:
    model, _ = _copy(wl)
    params, per_sample = _func_grads(wl, model)
    backend = CountingInductor()
    clipped = torch.compile(lambda p, x, y: clip_and_sum(per_sample(p, x, y)), backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    named = list(model.named_parameters())

    def run(x, y):
        noisy_step(named, clipped(params, x, y), x.shape[0], opt)

    return Prepared(run, counters=lambda: {"compiles": backend.compiles})


# -- ExpandedWeights -------------------------------------------------------------------------------


def expanded_weights(wl: Workload) -> Prepared:
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    model, names = _copy(wl)
    wrapped = call_for_per_sample_grads(model, loss_reduction="mean")

    def run(x, y):
        for p in model.parameters():
            p.grad_sample = None
        wl.criterion(wrapped(x), y).backward()
        return _grad_samples(model, names)

    return Prepared(run, canonical=lambda out: _named(names, out))


# -- Opacus ----------------------------------------------------------------------------------------


def opacus_hooks(wl: Workload) -> Prepared:
    from opacus import GradSampleModule

    model, names = _copy(wl)
    gsm = GradSampleModule(model, loss_reduction="mean")

    def run(x, y):
        gsm.zero_grad(set_to_none=True)
        wl.criterion(gsm(x), y).backward()
        return _grad_samples(model, names)

    return Prepared(run, canonical=lambda out: _named(names, out))


def _opacus_dp(mode: str) -> Callable[[Workload], Prepared]:
    def setup(wl: Workload) -> Prepared:
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        model, _ = _copy(wl)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = wl.batch(wl.batch_size)
        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        made = PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            criterion=copy.deepcopy(wl.criterion),
            data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_NORM,
            poisson_sampling=False,
            grad_sample_mode=mode,
        )
        dp_model, dp_opt = made[0], made[1]
        criterion = made[2] if mode == "ghost" else wl.criterion

        def run(x, y):
            dp_opt.zero_grad(set_to_none=True)
            criterion(dp_model(x), y).backward()
            dp_opt.step()

        return Prepared(run)

    return setup


# -- BackPACK --------------------------------------------------------------------------------------


def _backpack(extension: str) -> Callable[[Workload], Prepared]:
    """BackPACK's quantities are those of the loss as written: with a mean loss, BatchGrad gives g_i / B and
    Variance the variance of g_i / B, so ``canonical`` rescales; BatchL2Grad gives ||g_i / B||^2 per
    parameter."""

    def setup(wl: Workload) -> Prepared:
        import backpack
        import backpack.extensions as ext

        model, names = _copy(wl)
        model = backpack.extend(model)
        criterion = wl.criterion
        if type(criterion).__module__.startswith("torch.nn"):
            criterion = backpack.extend(copy.deepcopy(criterion))
        attr = {"BatchGrad": "grad_batch", "BatchL2Grad": "batch_l2", "Variance": "variance"}[extension]

        def run(x, y):
            model.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            with backpack.backpack(getattr(ext, extension)()):
                loss.backward()
            return x.shape[0], _grad_samples(model, names, attr)

        def canonical(out):
            b, tensors = out
            if extension == "BatchGrad":
                return _named(names, tensors, b)
            if extension == "Variance":
                return _named(names, tensors, b * b)
            return torch.stack(list(_named(names, tensors).values())).sum(0).sqrt() * b

        return Prepared(run, canonical)

    return setup


# -- torchjd ---------------------------------------------------------------------------------------


def torchjd_gram(wl: Workload) -> Prepared:
    from torchjd.autogram import Engine

    model, _ = _copy(wl)
    batch_dim = None if wl.spec.unbatched_module else 0
    engine = Engine(model, batch_dim=batch_dim)
    per_sample_loss = copy.deepcopy(wl.criterion)
    per_sample_loss.reduction = "none"

    def run(x, y):
        return engine.compute_gramian(per_sample_loss(model(x), y))

    return Prepared(run, note=f"batch_dim={batch_dim}")


# -- compiled_psg ----------------------------------------------------------------------------------


def _psg(reduce_factory: Callable | None) -> Callable[[Workload], Prepared]:
    def setup(wl: Workload) -> Prepared:
        import compiled_psg as psg

        model, _ = _copy(wl)
        reduce = reduce_factory(psg) if reduce_factory else None
        f = psg.per_sample(model, reduce=reduce)(lambda x, y: wl.criterion(model(x), y))
        return Prepared(f, counters=lambda: _psg_counters(f))

    return setup


def _psg_counters(f) -> dict:
    return {
        "compiles": f.compiles,
        "captures": f.captures,
        "compile_s": round(f.compile_seconds, 2),
    }


def psg_dp(wl: Workload) -> Prepared:
    import compiled_psg as psg

    model, _ = _copy(wl)
    f = psg.per_sample(model, reduce=psg.clip_sum(MAX_NORM))(lambda x, y: wl.criterion(model(x), y))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    named = list(model.named_parameters())

    def run(x, y):
        noisy_step(named, f(x, y), x.shape[0], opt)

    return Prepared(run, counters=lambda: _psg_counters(f))


def dp_compile_step(wl: Workload, **options):
    """The page's DP step (clip to ``MAX_NORM``, noise ``NOISE_MULTIPLIER``, SGD) on a fresh copy of the model;
    ``options`` go to ``compile_step`` too (``benchmarks.probes.micro_batches``: ``max_physical_batch_size``)."""
    from compiled_psg import compile_step

    model, _ = _copy(wl)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return compile_step(
        lambda x, y: wl.criterion(model(x), y), model, opt,
        max_grad_norm=MAX_NORM, noise_multiplier=NOISE_MULTIPLIER, expected_batch_size=None, **options,
    )  # fmt: skip


def psg_compile_step(wl: Workload) -> Prepared:
    """``compiled_psg.compile_step``: the same DP step, forward to optimizer update as one compiled program."""
    step = dp_compile_step(wl)

    def counters() -> dict:
        found = _psg_counters(step.per_sample)
        found["compiles"] = getattr(step, "compiles", found["compiles"])
        found["compile_s"] = round(getattr(step, "compile_seconds", found["compile_s"]), 2)
        return found

    return Prepared(step, counters=counters)


# -- the table -------------------------------------------------------------------------------------

METHODS: dict[str, Method] = {
    "backward": Method("ordinary backward", "baseline", "backward", backward),
    "sgd_step": Method("plain SGD step", "baseline", "step", sgd_step),
    "backward_compile": Method("ordinary backward, torch.compile", "baseline", "backward", backward_compile),
    "sgd_step_compile": Method("plain SGD step, torch.compile", "baseline", "step", sgd_step_compile),
    "func_vmap": Method("vmap(grad) eager", "per-sample grads", "grads", func_vmap),
    "func_compile": Method("torch.compile(vmap(grad))", "per-sample grads", "grads", func_compile),
    "expanded_weights": Method("ExpandedWeights", "per-sample grads", "grads", expanded_weights),
    "opacus_hooks": Method("Opacus GradSampleModule (hooks)", "per-sample grads", "grads", opacus_hooks),
    "backpack_batchgrad": Method("BackPACK BatchGrad", "per-sample grads", "grads", _backpack("BatchGrad")),
    "psg_grads": Method("compiled_psg materialized", "per-sample grads", "grads", _psg(None)),
    "backpack_l2": Method("BackPACK BatchL2Grad", "norms", "norms", _backpack("BatchL2Grad")),
    "psg_norms": Method("compiled_psg norms", "norms", "norms", _psg(lambda psg: psg.norms())),
    "dp_func_compile": Method("torch.compile(vmap(grad)) + clip-sum DP step", "DP step", "step", func_compile_dp),
    "dp_opacus_hooks": Method("Opacus DP step (hooks)", "DP step", "step", _opacus_dp("hooks")),
    "dp_opacus_ghost": Method("Opacus DP step (ghost clipping)", "DP step", "step", _opacus_dp("ghost")),
    "dp_psg": Method("compiled_psg clip_sum DP step", "DP step", "step", psg_dp),
    "backpack_variance": Method("BackPACK Variance", "variance", "variance", _backpack("Variance")),
    "psg_variance": Method("compiled_psg variance", "variance", "variance", _psg(lambda psg: psg.variance())),
    "torchjd_gram": Method("torchjd autogram Gramian", "gram", "gram", torchjd_gram),
    "psg_gram": Method("compiled_psg gram", "gram", "gram", _psg(lambda psg: psg.gram())),
}
# Always listed: where compiled_psg (or its compile_step) cannot be imported, setup fails and the failure is
# recorded, with its cause, like any other.
METHODS["dp_psg_compile_step"] = Method("compiled_psg compile_step DP step", "DP step", "step", psg_compile_step)


def baseline_of(method: str) -> str:
    """DP steps are compared with a plain SGD step, everything else with the ordinary backward pass (each the
    faster of its eager and its ``torch.compile`` version where both ran: see ``report.base_entry``)."""
    return "sgd_step" if METHODS[method].group == "DP step" or method.startswith("sgd_step") else "backward"


# A baseline's compiled twin: the report's baseline is whichever of the two is faster at each batch size.
COMPILED_BASELINE = {"backward": "backward_compile", "sgd_step": "sgd_step_compile"}
