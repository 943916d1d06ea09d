"""Saving and resuming a DP step: its settings, ``steps_taken``, the model, the optimizer and the noise generator."""

from __future__ import annotations

import warnings
from dataclasses import fields

import torch
import torch.nn as nn

from .._errors import DPConfigError
from .._generators import state_loads
from . import update_graph
from .config import MECHANISM, DPConfig


def step_state(step) -> dict:
    """What resuming the training needs: the settings (every field of ``config``, as assigned between steps), why
    adaptive clipping stalled (None if it did not), ``steps_taken``, the model's and the optimizer's
    ``state_dict`` and the noise generator's state (when ``generator=`` was given). Tensors are shared with the
    live objects, as in ``nn.Module.state_dict``: ``torch.save`` it, or keep ``copy.deepcopy`` of it (loading a
    state whose tensors are still the live ones, after steps were taken, is refused: ``_check_not_live``).
    Torch's global generator is the user's to save (``torch.get_rng_state``), and ``secure_rng=True``
    (``os.urandom``) cannot be resumed by design: its draws are not reproducible."""
    return {"kind": "DPStep",
            "config": {f.name: getattr(step.config, f.name) for f in fields(DPConfig)},
            "stalled_bound": step._stalled_bound,
            "steps_taken": step.steps_taken,
            "model": step.model.state_dict(),
            "optimizer": step.optimizer.state_dict(),
            "optimizer_kind": _optimizer_kind(step.model, step.optimizer),
            "generator": None if step.noise.generator is None else step.noise.generator.get_state()}


def load_step_state(step, state: dict) -> None:
    """Restore what ``state_dict`` saved, into a step built the same way (same model class, optimizer and
    arguments; the settings that define the mechanism, ``config.MECHANISM``, must be the saved ones). The next
    step continues exactly where the saved run stopped (same noise with a seeded ``generator``). Everything is
    checked before anything is loaded: a state of another model, optimizer or mechanism changes nothing."""
    check_state_kind(state, "DPStep")
    saved_steps = saved_step_count(state)
    if (state["generator"] is not None) != (step.noise.generator is not None):
        raise DPConfigError("the saved step and this one disagree on generator=: build the step with a "
                            "torch.Generator exactly when the saved one had one")
    config = _saved_config(step.config, state["config"])
    step.check_config(config)  # the noise range, a PrivateTraining's rules: refused before anything is loaded
    _check_model_state(step.model, state["model"])
    _check_optimizer_state(step.optimizer, state["optimizer"])
    _check_optimizer_kind(step.model, step.optimizer, state.get("optimizer_kind"))
    _check_optimizer_steps(step.optimizer, state["optimizer"])
    _check_not_live(step, state, saved_steps)
    _check_no_rollback(step, saved_steps)
    if step.noise.generator is not None:
        _check_generator_state(step.noise.generator, state["generator"])
    stalled = state.get("stalled_bound")
    if not (stalled is None or isinstance(stalled, str)):
        raise DPConfigError(f"the saved stalled_bound must be a message or None, got {type(stalled).__name__}. "
                            "Nothing was loaded")
    # the optimizer first: torch's loader assigns nothing before it can raise, the model's copies entry by entry.
    # Its tensors copied: torch's loader keeps the saved ones (same device and dtype), so the training would write
    # into the checkpoint (a state kept in memory, loaded again later, would hold a later step's moments)
    saved_optimizer = state["optimizer"]
    step.optimizer.load_state_dict({**saved_optimizer, "state": {
        k: {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in per.items()}
        if isinstance(per, dict) else per for k, per in saved_optimizer["state"].items()}})
    _keep_scalar_dtypes(step.optimizer, saved_optimizer)
    step.config = config
    step._stalled_bound = stalled  # after the config, whose assignment clears it
    step.model.load_state_dict(state["model"])
    if step.noise.generator is not None:
        step.noise.generator.set_state(state["generator"])
    if saved_steps != step.steps_taken:  # a state of this count leaves the steps released since as released
        step.steps_at_load = saved_steps
    step.steps_taken = saved_steps
    step.steps_reached = max(step.steps_reached, saved_steps)
    # The first step runs eagerly so that the optimizer creates its state, which the program reads (a stateless
    # optimizer, plain SGD, runs the program from the first step). A run that has stepped has that state: resume
    # on the program, as the uninterrupted run would.
    step.state_ready = (step.steps_taken > 0 or bool(step.optimizer.state)
                        or update_graph.creates_no_state(step.optimizer))


#: the entries a state of each kind holds (``kind``, ``stalled_bound`` and ``poisson_sampling`` are told from the
#: others in a state saved without them)
STATE_KEYS = {"DPStep": ("config", "steps_taken", "model", "optimizer", "generator"),
              "PrivateTraining": ("step", "accountant", "sampler", "sample_rate")}

_KIND_FIX = {
    ("DPStep", "PrivateTraining"): "load it with PrivateTraining.load_state_dict, into the training make_private "
                                   "built the same way: it resumes the step with its accountant and sampler",
    ("PrivateTraining", "DPStep"): "a DPStep's state resumes a step built with compile_step (step.load_state_dict); "
                                   "a PrivateTraining resumes what a PrivateTraining's state_dict() returned",
}


def check_state_kind(state: object, kind: str, holder: str | None = None) -> None:
    """Refuse ``state`` unless it holds what a ``kind``'s ``state_dict()`` saves (its ``kind`` marker, when it has
    one, names ``kind``), naming what it is instead: another kind's state, or its keys, or its type. ``holder``
    names where the state sits inside another one."""
    if isinstance(state, dict):
        marked = state.get("kind")
        marked = marked if marked is None or isinstance(marked, str) else repr(marked)
        missing = [key for key in STATE_KEYS[kind] if key not in state]
        if marked in (None, kind) and not missing:
            return
        other = marked if marked is not None else next(
            (name for name, keys in STATE_KEYS.items() if all(key in state for key in keys)), None)
        got = (f"a {other}'s state_dict()" if other is not None and other != kind else
               f"a dict with keys {sorted(state, key=str)[:8]}{' ...' if len(state) > 8 else ''} (no {missing})")
    else:
        other, got = None, type(state).__name__
    fix = _KIND_FIX.get((kind, other), f"load what {kind}.state_dict() returned (a model's state_dict loads with "
                                       "model.load_state_dict, an optimizer's with optimizer.load_state_dict)")
    where = f"{kind}.load_state_dict takes" if holder is None else f"{holder} must be"
    raise DPConfigError(f"{where} a {kind}'s state_dict(), got {got}. Nothing was loaded. Fix: {fix}")


def saved_step_count(state: dict) -> int:
    """The ``steps_taken`` of a step's state, refused unless it is a count."""
    steps = state["steps_taken"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise DPConfigError(f"the saved steps_taken must be an int >= 0, got {steps!r}. Nothing was loaded. Fix: "
                            "load a state saved by state_dict()")
    return steps


def _saved_config(live: DPConfig, saved: dict) -> DPConfig:
    """The saved config, validated, once it is known to define the same mechanism as ``live``'s (with ``live``'s
    ``memory_budget``)."""
    names = [f.name for f in fields(DPConfig)]
    missing, unknown = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if missing or unknown:
        raise DPConfigError(f"the saved settings are not a DPConfig's: the state has no {missing}"
                            + (f" and unknown {unknown}" if unknown else "") + " (state_dict() saves every field "
                            "of step.config). Nothing was loaded. Fix: load a state saved by DPStep.state_dict()")
    mechanism = {name: saved[name] for name in MECHANISM}
    if mechanism["clip_groups"] is not None:  # lists, from a format without tuples: compared as DPConfig holds them
        mechanism["clip_groups"] = tuple(tuple(g) for g in mechanism["clip_groups"])
    differ = [f"{name}: saved {value!r}, this step {getattr(live, name)!r}"
              for name, value in mechanism.items() if value != getattr(live, name)]
    if differ:
        raise DPConfigError(f"the saved step was built otherwise: {'; '.join(differ)}. These define the mechanism "
                            "(what is clipped, and what the noise is calibrated to) and are fixed when a step is "
                            "built. Nothing was loaded. Fix: build the step with the saved run's settings")
    # memory_budget describes the machine, not the mechanism or the run: the loading step's stays
    try:
        return DPConfig(**{name: saved[name] for name in names if name != "memory_budget"},
                        memory_budget=live.memory_budget)
    except DPConfigError as e:  # a state saved by older code or edited: the build's fix does not apply to a load
        cause = str(e).split(" Fix: ")[0].rstrip(".")  # the build's own fix does not apply to a load
        raise DPConfigError(f"the saved settings are refused: {cause}. Nothing was loaded. Fix: correct that setting "
                            "in the state's 'config' (an option of another clipping mode did nothing in the run "
                            "that saved it: set it to its default), or save the state again") from None


def _check_model_state(model: nn.Module, saved: dict) -> None:
    """``model.load_state_dict(saved)`` would load all of it (``nn.Module.load_state_dict`` copies the entries
    that fit before it raises on the others)."""
    live = model.state_dict()
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    shapes = [f"{k}: saved {tuple(saved[k].shape)}, model {tuple(live[k].shape)}" for k in live
              if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != live[k].shape]
    # torch copies the entries that fit and raises on a non-tensor after them (a module's extra state is no tensor)
    not_tensors = [f"{k} ({type(saved[k]).__name__})" for k in live
                   if k in saved and isinstance(live[k], torch.Tensor) and not isinstance(saved[k], torch.Tensor)]
    if missing or unexpected or shapes or not_tensors:
        problems = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else "",
                    f"other shapes ({'; '.join(shapes[:5])})" if shapes else "",
                    f"no tensors at {not_tensors[:5]}" if not_tensors else ""]
        raise DPConfigError("the saved model state is not one of this model: "
                            + ", ".join(p for p in problems if p) + ". Nothing was loaded. Fix: build the model "
                            "exactly as the saved run did before loading")
    # torch's load_state_dict casts: a float64 run would go on in float32, its noise drawn in another dtype, so
    # the continuation would not be the saved run's (red team N)
    dtypes = [f"{k}: saved {saved[k].dtype}, model {live[k].dtype}" for k in live
              if isinstance(saved[k], torch.Tensor) and saved[k].dtype != live[k].dtype]
    if dtypes:
        raise DPConfigError(f"the saved model state is of other dtypes than this model ({'; '.join(dtypes[:5])}"
                            f"{' ...' if len(dtypes) > 5 else ''}): loading would cast it, and the run would not go "
                            "on as the saved one. Nothing was loaded. Fix: build the model in the saved dtypes "
                            "(model.to(...)) before loading, or cast the saved tensors yourself to change precision")


def _check_generator_state(generator: torch.Generator, saved: object) -> None:
    """``generator.set_state(saved)`` will succeed, or nothing is loaded."""
    if state_loads(generator, saved):
        return
    raise DPConfigError("the saved generator state is not one of this step's generator (a torch.Generator's "
                        "get_state() of the same device). Nothing was loaded. Fix: build the step with a generator "
                        "of the same kind (device) as the saved run's, and load the state its state_dict() saved")


def _check_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The checks of ``Optimizer.load_state_dict`` that can fail, made before the model is loaded."""
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list) and all(isinstance(g, dict) and "params" in g
                                                                     for g in saved["param_groups"])):
        raise DPConfigError("the saved optimizer state is not an optimizer's state_dict() (a dict with a 'state' "
                            "dict and a 'param_groups' list of groups). Nothing was loaded. Fix: load the state "
                            "state_dict() saved")
    groups = saved.get("param_groups", []) if isinstance(saved, dict) else None
    if groups is None or len(groups) != len(optimizer.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, optimizer.param_groups, strict=True)):
        raise DPConfigError("the saved optimizer state holds other parameter groups than this optimizer: "
                            f"{[len(g['params']) for g in groups or []]} parameters per group saved, "
                            f"{[len(g['params']) for g in optimizer.param_groups]} here. Nothing was loaded. Fix: "
                            "build the optimizer with the same parameter groups as the saved run")
    # another optimizer class (SGD's state into Adam): torch raises KeyError after it loaded the param_groups.
    # Flags torch added over versions are filled in by its loader; a class's own hyperparameters are not.
    missing = sorted({k for k in optimizer.defaults if not any(k in g for g in groups)} - _FLAGS_ADDED_BY_VERSIONS)
    if missing:
        raise DPConfigError(f"the saved optimizer state is of another optimizer than this "
                            f"{type(optimizer).__name__}: its groups have no {missing}. Nothing was loaded. Fix: "
                            "build the optimizer the saved run used")


def _check_optimizer_steps(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """A torch optimizer steps from the saved state: tried on a copy of it over meta tensors (no memory, no data),
    loaded with ``saved`` and stepped once. Torch's loader accepts a moment of another shape, a missing one, a
    string ``lr`` or one-element ``betas``, and the next step raises. An optimizer the copy cannot try on its own
    state (another library's, one whose step needs a closure) is not tried."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return
    live = optimizer.state_dict()
    try:
        _step_on_meta(optimizer, live)
    except Exception as error:  # noqa: BLE001 -- not triable on meta tensors: torch's loader's own checks stand
        # an optimizer that makes its scalar state on the parameters' device when it starts (ASGD's eta and mu):
        # a state of its own (the saved one) has them, the copy holds them as numbers
        if live["state"] or not _needs_a_value(error):
            return
    try:
        _step_on_meta(optimizer, saved)
    except Exception as error:  # noqa: BLE001 -- whatever the saved state makes the step raise
        if _needs_a_value(error):  # not the saved state's fault: the trial cannot tell
            return
        raise DPConfigError(f"the saved optimizer state does not step this {type(optimizer).__name__} "
                            f"({type(error).__name__}: {str(error).strip().splitlines()[0][:200]}). Nothing was "
                            "loaded. Fix: load the state its state_dict() saved, into an optimizer built as the "
                            "saved run's") from None


def _step_on_meta(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """One step of a copy of ``optimizer`` over meta tensors, from ``state`` (its tensors as meta tensors, except
    the scalars: a step count is read as a number)."""
    def meta(value):
        if not isinstance(value, torch.Tensor):
            return value
        return value.clone() if value.numel() <= 1 else torch.empty_like(value, device="meta")

    params = [[torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in group["params"]]
              for group in optimizer.param_groups]
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": mine, "foreach": False}
              for group, mine in zip(optimizer.param_groups, params, strict=True)]
    for group in groups:
        if group.get("fused"):
            group["fused"] = False
    on_meta = {"state": {k: {name: meta(v) for name, v in per.items()} if isinstance(per, dict) else per
                         for k, per in state["state"].items()},
               "param_groups": state["param_groups"]}
    flat = [p for mine in params for p in mine]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scratch = type(optimizer)(groups)
        scratch.load_state_dict(on_meta)
        # torch's loader moves a scalar state (NAdam's mu_product) to its parameter's device, meta, where the step
        # cannot read it as a number: the saved value, on the CPU, as a 0-dim state on any device is read
        for index, per in on_meta["state"].items():
            if isinstance(index, int) and 0 <= index < len(flat) and isinstance(per, dict):
                for name, value in per.items():
                    if isinstance(value, torch.Tensor) and value.numel() <= 1 and value.dim() == 0:
                        scratch.state[flat[index]][name] = value
        for p in flat:
            p.grad = torch.zeros_like(p)
        step = type(scratch).step
        getattr(step, "__wrapped__", step)(scratch)  # not the hooks' wrapper: no user code runs for the trial


def _keep_scalar_dtypes(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Each 0-dim state tensor in the dtype it was saved in. torch's loader casts a floating state to its
    parameter's dtype; a running optimizer keeps ASGD's ``eta`` and ``mu`` in float32 beside float64 parameters,
    so the resumed run would step with other numbers (7e-10 off in eta) than the uninterrupted one."""
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per in saved["state"].items():
        if not (isinstance(index, int) and 0 <= index < len(flat) and flat[index] in optimizer.state):
            continue
        live = optimizer.state[flat[index]]
        for name, value in per.items():
            now = live.get(name)
            if isinstance(value, torch.Tensor) and value.dim() == 0 and isinstance(now, torch.Tensor) \
                    and now.dim() == 0 and now.dtype != value.dtype:
                live[name] = value.to(now.device, copy=True)


def _needs_a_value(error: Exception) -> bool:
    """Whether the trial over meta tensors failed for want of a value (``.item()`` of a meta tensor), which no
    state can give it."""
    return "meta tensor" in str(error)


def _optimizer_kind(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's class and the model's name of each parameter it updates, group by group (None for one
    outside the model): what ``_check_optimizer_state`` cannot tell from torch's state (Adam's groups have every
    key of Adamax's and RAdam's; a state saved over the parameters in another order has the same counts)."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "params": [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]}


def _check_optimizer_kind(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: object) -> None:
    """Refuse a state of another optimizer class, or over the parameters in another order (red team N: Adam's
    state loaded into Adamax raised KeyError 'exp_inf' at every later step; into RAdam, or over two equal layers
    in another order, it trained on with the wrong moments). A state saved without it is checked as before."""
    if saved is None:
        return
    here = _optimizer_kind(model, optimizer)
    if not isinstance(saved, dict) or set(saved) != {"class", "params"}:
        raise DPConfigError(f"the saved optimizer_kind must be a dict with 'class' and 'params', got {saved!r}. "
                            "Nothing was loaded")
    if saved["class"] != here["class"]:
        raise DPConfigError(f"the saved optimizer state is of a {saved['class']}, this optimizer is a "
                            f"{here['class']}. Nothing was loaded. Fix: build the optimizer the saved run used")
    if saved["params"] != here["params"]:
        first = next(((g, i, s, h) for g, (sg, hg) in enumerate(zip(saved["params"], here["params"], strict=False))
                      for i, (s, h) in enumerate(zip(sg, hg, strict=False)) if s != h), None)
        where = ("" if first is None else f": group {first[0]} position {first[1]} holds {first[2]!r} in the saved "
                 f"state, {first[3]!r} here")
        raise DPConfigError(f"the saved optimizer state is over the model's parameters in another order than this "
                            f"optimizer{where}. Nothing was loaded. Fix: build the optimizer over the parameters in "
                            "the order of the saved run (e.g. model.parameters())")


#: optimizer settings torch added over versions, which its ``load_state_dict`` fills in for an older state
_FLAGS_ADDED_BY_VERSIONS = {"foreach", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay"}


def _check_not_live(step, saved: dict, saved_steps: int) -> None:
    """Refuse a state whose model or optimizer tensors are the live ones when it was saved at another step: an
    in-memory ``state_dict()`` follows the training (its tensors are shared, as in ``nn.Module.state_dict``), so
    loading it would set the step count (and a ``PrivateTraining``'s accountant) back while the weights stay
    those after every step taken: epsilon would cover fewer steps than the model was trained for. Refused rather
    than reconciled: the weights of the saved step no longer exist anywhere, and a rollback that silently keeps
    the current weights is not the rollback the user asked for."""
    if saved_steps == step.steps_taken:
        return  # the live state at the same step: loading it changes nothing
    live = {_storage(t) for t in _tensors((step.model.state_dict(), step.optimizer.state))} - {None}
    shared = [name for name, t in _named_tensors(saved["model"]) if _storage(t) in live]
    shared += [f"optimizer state of parameter {k}" for k, per_param in saved["optimizer"].get("state", {}).items()
               if any(_storage(t) in live for t in _tensors(per_param))]
    if shared:
        raise DPConfigError(
            f"this state was saved at step {saved_steps} but holds the live model's and optimizer's "
            f"tensors ({', '.join(map(str, shared[:3]))}{', ...' if len(shared) > 3 else ''}), which now hold the "
            f"weights after step {step.steps_taken}: state_dict() shares them with the training, as "
            "nn.Module.state_dict does. Loading it would count fewer steps than the weights were trained for. "
            "Nothing was loaded. Fix: keep a copy when saving, best = copy.deepcopy(private.state_dict()) (or "
            "torch.save it and torch.load it)")


def _check_no_rollback(step, saved: int) -> None:
    """Refuse a rollback: a state below the highest step count the step reached, by its own steps or by a load (no
    load lowers it, so loading a state of the current count first does not open the way to an earlier one), and a
    state of another count into a step that released steps of its own since it was built or loaded a state of
    another count. The accountant would forget released steps, and a seeded noise generator would draw their noise
    again for the steps taken anew: two updates of one step (with another C, learning rate or batch) would cancel
    each other's noise and release a function of the clipped sums without noise."""
    reached = max(step.steps_reached, step.steps_taken)
    fix = ("Nothing was loaded. Fix: keep the best parameters for evaluation (copy.deepcopy(model.state_dict())) and "
           "go on training; resume a checkpoint in a training built afresh, only where the steps after it were not "
           "released")
    if saved < reached:
        raise DPConfigError(
            f"this training reached step {reached} (by its own steps or by a load), and the state is of step "
            f"{saved}: loading it would roll back past steps that may have been released, which epsilon() would "
            "then not count, and a seeded generator would draw their noise again for the steps taken anew (noise "
            "that cancels between two updates of one step). A training never goes below the step count it "
            f"reached. {fix}")
    released = step.steps_taken - step.steps_at_load
    if released > 0 and saved != step.steps_taken:
        raise DPConfigError(
            f"this training released {released} step(s) of its own since it was built or loaded a state of another "
            f"step count (now at step {step.steps_taken}), and the state is of step {saved}: its accountant's "
            "history and step count would replace this training's, and epsilon() would not count the steps released "
            f"here. {fix}")


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _named_tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) for name, t in state.items() if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s memory (a shard's local tensor for a DTensor), None where there is none."""
    local = t.to_local() if hasattr(t, "to_local") else t
    try:
        ptr = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (functional, ...)
        return None
    return ptr or None
