"""A DP step happens completely or not at all, and the accountant counts exactly the steps whose noisy update
reached the parameters: a refused step changes nothing and counts nothing; a step that fails after its update
(eager or fused, first or later step) is undone, parameters, optimizer state, buffers and generator, and
counts nothing (``transactional=False``: it is counted); a step whose update was applied is counted even when
what follows it (adaptive clipping's next bound) goes wrong; a resumed run takes the same program path as the
uninterrupted one."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from compiled_psg import BatchInputError, DPConfigError, compile_step, make_private
from compiled_psg._compile.run import CompiledGraph
from compiled_psg._train import paths


def _data(n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _private(model, x, y, generator, **options):
    """make_private on an SGD optimizer, batches of 8, noise multiplier 1, the eager backend."""
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(TensorDataset(x, y),
                        batch_size=8), lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0,
                        backend="eager", generator=generator, poisson_sampling=False, **options)


def _snapshot(model, generator):
    return [p.detach().clone() for p in model.parameters()], generator.get_state().clone()


def _unchanged(model, generator, snapshot) -> bool:
    params, state = snapshot
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)) and torch.equal(
        generator.get_state(), state)


def _after_one_step():
    """``(model, generator, x, y, private)``: a Linear under make_private (C = 1), one step taken."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    x, y = _data()
    private = _private(model, x, y, gen, max_grad_norm=1.0)
    private.step(x[:8], y[:8])
    return model, gen, x, y, private


def test_adaptive_bound_past_the_float_range_counts_the_step_and_refuses_the_next():
    """clipbound_learning_rate=1000 makes the next bound exp(1000) times the last: the step whose update was
    applied is counted (no OverflowError after the update), and the next step, whose noise would be infinite, is
    refused before anything changes."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(1)
    x, y = _data()
    private = _private(model, x, y, gen, max_grad_norm=0.01, clipping="adaptive", target_unclipped_quantile=1.0,
                       clipbound_learning_rate=1000.0, unclipped_num_std=2.0)
    before = _snapshot(model, gen)
    private.step(x[:8], y[:8])
    assert not _unchanged(model, gen, before)
    assert private.dp_step.steps_taken == 1 and private.accountant.steps == 1
    assert private.dp_step.max_grad_norm == 0.01  # the bound the step used: the next one overflowed
    after_one = _snapshot(model, gen)
    with pytest.raises(DPConfigError, match="max_clipbound"):
        private.step(x[8:], y[8:])
    assert _unchanged(model, gen, after_one)
    assert private.dp_step.steps_taken == 1 and private.accountant.steps == 1
    private.dp_step.max_grad_norm = 0.5  # the user's fix named in the message
    private.step(x[8:], y[8:])
    assert private.dp_step.steps_taken == 2 and private.accountant.steps == 2


def test_a_bound_past_float32_refuses_the_next_step_and_a_new_config_lifts_it():
    """lr=100 gives a next bound of about 1e40: finite in float64, infinite as float32 noise. Assigning a config
    with a finite max_clipbound (the fix the message names) lets training go on."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=0.01, noise_multiplier=1.0, clipping="adaptive", target_unclipped_quantile=1.0,
                        clipbound_learning_rate=100.0, unclipped_num_std=2.0, backend="eager",
                        generator=torch.Generator().manual_seed(1))
    step(x[:8], y[:8])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(DPConfigError, match="max_clipbound"):
        step(x[8:], y[8:])
    assert step.steps_taken == 1
    step.config = step.config.replace(max_clipbound=5.0)
    step(x[8:], y[8:])
    assert step.steps_taken == 2 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_finite_max_clipbound_keeps_adaptive_clipping_going():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=0.01, noise_multiplier=1.0, clipping="adaptive", target_unclipped_quantile=1.0,
                        clipbound_learning_rate=1000.0, unclipped_num_std=2.0, max_clipbound=5.0, backend="eager",
                        generator=torch.Generator().manual_seed(1))
    step(x[:8], y[:8])
    assert step.max_grad_norm == 5.0
    step(x[8:], y[8:])
    assert step.steps_taken == 2


def test_a_step_refused_under_autocast_counts_nothing():
    """The refusal comes before anything is released: the accountant must not count the previous step again."""
    model, gen, x, y, private = _after_one_step()
    history = list(private.accountant.history)
    snapshot = _snapshot(model, gen)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(DPConfigError, match="autocast"):
        private.step(x[8:], y[8:])
    assert private.accountant.history == history and private.dp_step.steps_taken == 1
    assert _unchanged(model, gen, snapshot)


@pytest.mark.inductor
def test_resumed_plain_sgd_takes_the_compiled_program_bit_for_bit():
    """Plain SGD keeps no optimizer state: a resumed step must still run the compiled program, as the
    uninterrupted run's second step does (the eager update differs in the last bits)."""
    x, y = _data(24)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
                            generator=torch.Generator().manual_seed(3))
        return model, step

    model_a, step_a = build()
    for b in batches:
        step_a(*b)
    model_b, step_b = build()
    step_b(*batches[0])
    state = {k: v for k, v in step_b.state_dict().items()}
    model_c, step_c = build()
    step_c.load_state_dict(state)
    for b in batches[1:]:
        step_c(*b)
    for p, q in zip(model_a.parameters(), model_c.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.inductor
def test_batches_sliced_from_one_tensor_run_on_one_capture():
    """``x[8:16]`` starts inside its storage: Dynamo would make the offset a symbol of its own, an input of the
    program that no batch size determines (the compiled step crashed on it). The first batch is such a slice, so
    the capture itself sees it; the steps equal those on contiguous copies."""
    x, y = _data(32)
    results = []

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        return model, compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                                   torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                                   noise_multiplier=1.0, generator=torch.Generator().manual_seed(3))

    for copies in (False, True):
        model, step = build()
        for i in range(8, 32, 8):
            xb, yb = x[i:i + 8], y[i:i + 8]
            assert xb.storage_offset() > 0
            step(*((xb.clone(), yb.clone()) if copies else (xb, yb)))
        assert (step.captures, step.compiles, step.steps_taken) == (1, 1, 3)
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results, strict=True):
        assert torch.equal(p, q)


class _Failing(Exception):
    pass


def _stepper(generator, transactional=True, optimizer=torch.optim.Adam, backend="eager"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model.register_buffer("calls", torch.zeros(()))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, optimizer(model.parameters(), lr=0.1),
                        max_grad_norm=1.0, noise_multiplier=1.0, backend=backend, generator=generator,
                        transactional=transactional)
    return model, step


def _fail_after_update(monkeypatch, target, name, times=1):
    """``target.name`` runs, then raises ``_Failing`` (``times`` times): the update has reached the parameters."""
    real = getattr(target, name)
    left = [times]

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        if left[0] > 0:
            left[0] -= 1
            raise _Failing(name)
        return out

    monkeypatch.setattr(target, name, wrapped)


def _state(model, step, generator):
    order = {p: i for i, p in enumerate(model.parameters())}
    opt = {order[p]: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
           for p, s in step.optimizer.state.items()}
    grads = [torch.full((1,), float("nan")) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return ([t.detach().clone() for t in [*model.parameters(), *model.buffers(), *grads]], opt,
            generator.get_state().clone(), step.steps_taken)


def _same_state(a, b) -> bool:
    """Parameters, buffers, ``.grad`` (None as one NaN), optimizer state, generator and count all equal."""
    (ta, oa, ga, na), (tb, ob, gb, nb) = a, b
    same_opt = oa.keys() == ob.keys() and all(
        oa[k].keys() == ob[k].keys() and all(torch.equal(torch.as_tensor(oa[k][j]), torch.as_tensor(ob[k][j]))
                                             for j in oa[k]) for k in oa)
    return all(torch.equal(p, q) or (p.isnan().all() and q.isnan().all() and p.shape == q.shape)
               for p, q in zip(ta, tb, strict=True)) and same_opt and torch.equal(ga, gb) and na == nb


@pytest.mark.parametrize("when", ["first step", "later step"])
def test_a_step_failing_after_its_update_restores_everything_and_counts_nothing(monkeypatch, when):
    """The step fails after Adam's update has run: on the first step eagerly (the parameters written, the state
    created), later in the fused program (the new values computed, not yet committed). Parameters, optimizer
    state, buffers, the generator and the count are as before the call, and the run that goes on equals one in
    which the failure never happened, bit for bit."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen)
    if when == "later step":
        step(x[:8], y[:8])
    before = _state(model, step, gen)
    if when == "first step":  # the eager update: torch's optimizer.step() has run (no code of the user's in it)
        _fail_after_update(monkeypatch, paths, "eager_update")
    else:  # the fused program (traced, run op by op on the eager backend) has run
        assert step.fused
        _fail_after_update(monkeypatch, CompiledGraph, "run")
    with pytest.raises(_Failing):
        step(x[8:16], y[8:16])
    assert _same_state(before, _state(model, step, gen))
    assert step.released_config is None
    step(x[8:16], y[8:16])
    step(x[16:], y[16:])

    gen_clean = torch.Generator().manual_seed(5)
    clean_model, clean = _stepper(gen_clean)
    if when == "later step":
        clean(x[:8], y[:8])
    clean(x[8:16], y[8:16])
    clean(x[16:], y[16:])
    assert _same_state(_state(model, step, gen), _state(clean_model, clean, gen_clean))


def test_an_accounted_run_counts_no_failed_step(monkeypatch):
    """PrivateTraining: the accountant's history holds the completed steps only."""
    model, gen, x, y, private = _after_one_step()
    _fail_after_update(monkeypatch, CompiledGraph, "run")  # the fused program has updated the parameters
    snapshot = _snapshot(model, gen)
    with pytest.raises(_Failing):
        private.step(x[8:], y[8:])
    assert private.accountant.steps == 1 and private.dp_step.steps_taken == 1 and _unchanged(model, gen, snapshot)


def test_without_the_transaction_a_failure_after_the_noise_is_counted(monkeypatch):
    """transactional=False: no copy; the noise may have reached the parameters (here the eager update of the
    first step has written them), so the step is counted."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, transactional=False)
    before = [p.detach().clone() for p in model.parameters()]
    _fail_after_update(monkeypatch, step.optimizer, "step")
    with pytest.raises(_Failing):
        step(x[:8], y[:8])
    # counted by the step itself; nothing is left released for a later call (or a caller) to count again
    assert step.steps_taken == 1 and step.released_config is None
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_the_fused_program_writes_nothing_of_the_users_until_it_has_run_whole(monkeypatch):
    """The program returns the new parameters, Adam's state and ``.grad``; they are written after it returns
    (``fuse.commit``). So the parameters and state are those of before the step while the program runs and
    after it fails, without a copy of them: the snapshot holds buffers and generators only."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen)
    step(x[:8], y[:8])
    assert step.fused and step.program_cache.current.commits
    real_run, seen = CompiledGraph.run, []

    def run(self, *args, **kwargs):
        before = _state(model, step, gen)
        out = real_run(self, *args, **kwargs)
        seen.append(_same_state(before, _state(model, step, gen)))
        seen.append(step.snapshot.params is None and step.snapshot.optimizer_state is None)
        return out

    monkeypatch.setattr(CompiledGraph, "run", run)
    before = _state(model, step, gen)
    step(x[8:16], y[8:16])
    assert seen == [True, True]
    assert not _same_state(before, _state(model, step, gen))  # committed after the program
    assert step.snapshot is None  # no copy outlives the call


def test_a_failure_after_the_commit_counts_the_completed_step(monkeypatch):
    """Past ``fuse.commit`` the update is in the parameters: a failure there (an interrupt, say) counts the step,
    keeps the update and leaves the generator advanced, so the next step draws fresh noise. The parameters are
    those of an uninterrupted run."""
    import compiled_psg._train.paths as paths

    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen)
    step(x[:8], y[:8])
    _fail_after_update(monkeypatch, paths, "commit")
    with pytest.raises(_Failing):
        step(x[8:16], y[8:16])
    assert step.steps_taken == 2
    gen_clean = torch.Generator().manual_seed(5)
    clean_model, clean = _stepper(gen_clean)
    clean(x[:8], y[:8])
    clean(x[8:16], y[8:16])
    assert _same_state(_state(model, step, gen), _state(clean_model, clean, gen_clean))


@pytest.mark.inductor
def test_the_compiled_program_failing_after_its_update_is_undone(monkeypatch):
    """The fused program updates the parameters in place; a failure after it (here: raised once the program
    has returned) restores them, the optimizer's state tensors the program holds (in place) and the generator,
    so that the next steps equal an uninterrupted run's bit for bit. The compile at the end of the first step
    failing is undone the same way."""
    x, y = _data(32)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, optimizer=torch.optim.SGD, backend="inductor")
    step.optimizer.param_groups[0]["momentum"] = 0.9  # state the program reads and writes
    before = _state(model, step, gen)
    _fail_after_update(monkeypatch, CompiledGraph, "prepare")
    with pytest.raises(_Failing):
        step(x[:8], y[:8])
    assert _same_state(before, _state(model, step, gen)) and not step.optimizer.state
    step(x[:8], y[:8])
    before = _state(model, step, gen)
    _fail_after_update(monkeypatch, CompiledGraph, "run")
    with pytest.raises(_Failing):
        step(x[8:16], y[8:16])
    assert _same_state(before, _state(model, step, gen))
    for i in range(8, 32, 8):
        step(x[i:i + 8], y[i:i + 8])

    gen_clean = torch.Generator().manual_seed(5)
    clean_model, clean = _stepper(gen_clean, optimizer=torch.optim.SGD, backend="inductor")
    clean.optimizer.param_groups[0]["momentum"] = 0.9
    for i in range(0, 32, 8):
        clean(x[i:i + 8], y[i:i + 8])
    assert step.compiles == clean.compiles == 1
    assert _same_state(_state(model, step, gen), _state(clean_model, clean, gen_clean))


def test_a_failed_eager_update_leaves_no_noisy_gradient_in_the_steps_grad_buffers(monkeypatch):
    """After ``zero_grad()`` (``.grad`` None), an eager update that fails has written its noisy gradient into the
    step's ``.grad`` buffers, which the next step installs: they are restored with the parameters."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, optimizer=torch.optim.SGD)
    step(x[:8], y[:8])
    buffers = [b.clone() for b in step.binding.dot_grads]
    step.optimizer.zero_grad()
    step.state_ready = False  # the next step's update runs eagerly (as on an empty batch)
    _fail_after_update(monkeypatch, paths, "eager_update")
    with pytest.raises(_Failing):
        step(x[8:16], y[8:16])
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(step.binding.dot_grads, buffers, strict=True))


def test_a_failed_fused_step_gives_back_each_grad_as_it_was(monkeypatch):
    """The fused path installs the step's gradient buffers as ``.grad`` before its program; a failure inside the
    program leaves ``.grad`` as the caller had it (None after ``zero_grad()``), not the buffers."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen)
    step(x[:8], y[:8])
    step.optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())

    def failing_run(self, *args, **kwargs):
        raise _Failing("inside the program")

    monkeypatch.setattr(CompiledGraph, "run", failing_run)
    with pytest.raises(_Failing):
        step(x[8:16], y[8:16])
    assert all(p.grad is None for p in model.parameters()) and step.steps_taken == 1


def test_a_failed_eager_update_gives_back_the_optimizers_group_settings(monkeypatch):
    """An optimizer that adapts a setting of its parameter group (Prodigy's ``d``, a learning rate) and then fails:
    the group's settings are restored with its state. Its step is not torch's own, so it may have shown the
    update to someone: the step is counted."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    # with momentum: the first step's update runs in Python (plain SGD's runs in the program)
    model, step = _stepper(gen, optimizer=functools.partial(torch.optim.SGD, momentum=0.9))
    group = step.optimizer.param_groups[0]
    group["adapted"] = [1.0]
    real_step = step.optimizer.step

    def adapting_step(*args, **kwargs):
        group["lr"] *= 0.5
        group["adapted"][0] += 1.0
        group["added"] = True
        real_step(*args, **kwargs)
        raise _Failing("after the update")

    monkeypatch.setattr(step.optimizer, "step", adapting_step)
    with pytest.raises(_Failing):
        step(x[:8], y[:8])  # the first step's update runs in Python
    assert group["lr"] == 0.1 and group["adapted"] == [1.0] and "added" not in group
    assert step.steps_taken == 1  # a step that is not torch's own may have shown the update: counted


def test_a_step_called_from_inside_a_step_is_refused_and_the_outer_one_completes():
    """An optimizer hook that calls the step again: the inner call is refused (its commit would be undone by the
    outer call's rollback and its noise drawn again); nothing of it is counted."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, optimizer=torch.optim.SGD)
    refused = []

    def hook(optimizer, args, kwargs):
        try:
            step(x[16:24], y[16:24])
        except DPConfigError as e:
            refused.append(str(e))

    step.optimizer.register_step_post_hook(hook)
    step(x[:8], y[:8])
    assert len(refused) == 1 and "called while it is running" in refused[0]
    assert step.steps_taken == 1


def test_a_private_step_called_from_inside_a_step_is_counted_once_by_the_accountant():
    """The inner ``PrivateTraining.step`` is refused by the step; the accountant counted it as the outer call's
    noise (the outer step's released settings were in flight)."""
    model, gen, x, y, private = _after_one_step()
    refused = []

    def hook(optimizer, args, kwargs):
        try:
            private.step(x[8:], y[8:])
        except DPConfigError as e:
            refused.append(str(e))

    private.dp_step.optimizer.register_step_post_hook(hook)
    for _ in range(2):
        private.step(x[:8], y[:8])
    assert len(refused) == 2 and private.dp_step.steps_taken == 3 and private.accountant.steps == 3


def test_steps_called_from_two_threads_take_turns():
    """Two threads stepping one DP step: every call is a whole step on the parameters and state the previous one
    left (Adam's step count equals the steps taken), none is lost."""
    import threading

    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen)
    step(x[:8], y[:8])
    errors = []

    def run():
        try:
            for _ in range(4):
                step(x[8:16], y[8:16])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and step.steps_taken == 9
    assert all(float(s["step"]) == 9 for s in step.optimizer.state.values())


def test_a_parameter_replaced_after_the_optimizer_was_built_is_refused():
    """``model[2].weight = nn.Parameter(...)`` leaves the optimizer holding the old tensor: the step would train
    the new one with the old one's state. Refused, naming the cause, and nothing moves or is counted."""
    x, y = _data(24)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen)
    step(x[:8], y[:8])
    model[2].weight = nn.Parameter(torch.zeros(3, 8))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError, match="a parameter replaced since the optimizer was built"):
        step(x[8:16], y[8:16])
    assert step.steps_taken == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_parameters_whose_dtype_changed_under_the_optimizers_state_are_named_and_nothing_changes():
    """model.double() after Adam took steps leaves its float32 moments under float64 weights, which Adam cannot
    step. The step said that the batch did not fit a sample's own loss ("kthvalue"); it names the parameter, both
    dtypes and the state entry, and takes no step. A step with state of the parameters' dtype goes on."""
    x, y = _data(8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.Adam(model.parameters()),
                        max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, backend="eager")
    step(x, y)
    model.double()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DPConfigError, match=r"0\.weight is torch\.float64.*'exp_avg'\) is torch\.float32"):
        step(x.double(), y)
    assert step.steps_taken == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    model.float()
    step(x, y)
    assert step.steps_taken == 2


def _interrupt_on(monkeypatch, target, name, call: int):
    """``target.name`` raises KeyboardInterrupt on its ``call``-th call (after running, for ``_step``: the
    update is applied and the interrupt comes before the step counts it)."""
    original, calls = getattr(target, name), [0]

    def interrupted(self, *args):
        calls[0] += 1
        if calls[0] == call and name == "_call":
            raise KeyboardInterrupt
        result = original(self, *args)
        if calls[0] == call:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(target, name, interrupted)


@pytest.mark.parametrize("where", ["before the step runs", "after the update, before it is counted"])
@pytest.mark.parametrize("path", ["eager first step", "fused later step"])
@pytest.mark.usefixtures("eager_first_step")
def test_an_interrupt_anywhere_in_a_step_leaves_the_update_and_the_accountant_agreeing(monkeypatch, where, path):
    """Interrupted on entry the step changes and counts nothing (the accountant does not count the previous
    step's settings again); interrupted between its update and its count, the update is either undone (the eager
    path's transaction) or counted (past the fused program's commit): never applied and uncounted. A step taken
    through ``private.dp_step`` itself is counted too."""
    from compiled_psg._train.step import DPStep

    if path == "fused later step":
        model, gen, x, y, private = _after_one_step()
        private.dp_step(x[8:], y[8:])  # through the step object: counted by the accountant as well
        assert private.steps == private.dp_step.steps_taken == 2
    else:
        torch.manual_seed(0)
        model, gen, (x, y) = nn.Linear(4, 3), torch.Generator().manual_seed(1), _data()
        private = _private(model, x, y, gen, max_grad_norm=1.0)
    steps, before = private.steps, _snapshot(model, gen)
    _interrupt_on(monkeypatch, DPStep, "_call" if where == "before the step runs" else "_step", 1)
    with pytest.raises(KeyboardInterrupt):
        private.step(x[:8], y[:8])
    assert private.steps == private.dp_step.steps_taken
    if where == "before the step runs" or path == "eager first step":
        assert private.steps == steps and _unchanged(model, gen, before)
    else:
        assert private.steps == steps + 1 and not _unchanged(model, gen, before)


def test_an_interrupt_right_after_the_step_marks_itself_running_leaves_it_usable():
    """A KeyboardInterrupt landing between ``_running_thread = ...`` and the ``try`` that clears it left the step
    marked running: every later call was refused as a call from inside the step. Interrupted (``sys.settrace``)
    at the line after the mark, the step is usable again."""
    import inspect
    import sys

    from compiled_psg._train.step import DPStep

    torch.manual_seed(0)
    model, (x, y) = nn.Linear(4, 3), _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                        torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
                        expected_batch_size=8, backend="eager")
    step(x[:8], y[:8])
    code = inspect.unwrap(DPStep.__call__).__code__
    lines, first = inspect.getsourcelines(code)
    mark = first + next(k for k, text in enumerate(lines) if "self._running_thread = threading.get_ident()" in text)
    seen = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno > mark:
            sys.settrace(None)
            seen.append(frame.f_lineno)
            raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        with pytest.raises(KeyboardInterrupt):
            step(x[:8], y[:8])
    finally:
        sys.settrace(None)
    assert seen and step._running_thread is None
    step(x[:8], y[:8])  # not refused as a call from inside the step
    assert step.steps_taken == 2


@pytest.mark.parametrize("path", ["eager first step", "fused later step"])
@pytest.mark.usefixtures("eager_first_step")
def test_a_listener_that_raises_keeps_the_update_and_counts_the_step_once(path):
    """A listener of ``on_release`` raising after the update: the eager path restored the update but kept the
    count, the fused path counted the step twice. The update stays (it was applied) and each record is made once;
    the listener that raised is tried again before the error propagates."""
    if path == "fused later step":
        model, gen, x, y, private = _after_one_step()
    else:
        torch.manual_seed(0)
        model, gen, (x, y) = nn.Linear(4, 3), torch.Generator().manual_seed(1), _data()
        private = _private(model, x, y, gen, max_grad_norm=1.0)
    calls = []

    def listener(sigma):
        calls.append(sigma)
        if len(calls) == 1:
            raise RuntimeError("logger unavailable")

    private.dp_step.on_release(listener)
    steps, before = private.steps, _snapshot(model, gen)
    with pytest.raises(RuntimeError, match="logger unavailable"):
        private.step(x[:8], y[:8])
    assert not _unchanged(model, gen, before)
    assert private.steps == private.dp_step.steps_taken == steps + 1 and len(calls) == 2
    private.step(x[8:], y[8:])
    assert private.steps == private.dp_step.steps_taken == steps + 2 and len(calls) == 3


def _adam_float64_run(monkeypatch, interrupt: bool) -> list[torch.Tensor]:
    """Four steps of a float64 Linear with Adam (fused from the second); the third interrupted after the commit's
    first ``_foreach_copy_`` group where ``interrupt``."""
    import compiled_psg._train.fuse as fuse

    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = _data()
    x = x.double()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                        torch.optim.Adam(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=0.0,
                        expected_batch_size=8, backend="eager")
    step(x[:8], y[:8])
    step(x[8:], y[8:])
    if interrupt:
        original, copies = torch._foreach_copy_, []

        def first_then_interrupt(targets, values):
            copies.append(len(targets))
            original(targets, values)
            if len(copies) == 1:
                raise KeyboardInterrupt

        monkeypatch.setattr(fuse.torch, "_foreach_copy_", first_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            step(x[:8], y[:8])
        monkeypatch.setattr(fuse.torch, "_foreach_copy_", original)
        assert len(copies) == 3  # the first group twice (done, then again with the rest), the second once
    else:
        step(x[:8], y[:8])
    assert step.steps_taken == 3
    step(x[8:], y[8:])
    return [p.detach().clone() for p in model.parameters()]


def test_an_interrupt_between_the_commits_groups_finishes_the_commit(monkeypatch):
    """A float64 model with Adam commits two groups (the float32 ``step`` counters, the float64 rest): an
    interrupt between them counted the step with Adam's counters advanced and the weights and moments not
    written. The commit finishes before the interrupt propagates: the run goes on as one without it."""
    for a, b in zip(_adam_float64_run(monkeypatch, False), _adam_float64_run(monkeypatch, True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("secure", [False, True])
def test_no_noise_is_kept_on_the_step_after_it(secure):
    """The step kept its last draw in the buffer it reuses: ``p.grad * m - noise`` gave back the un-noised clipped
    sum exactly. The buffer is zeroed when the step ends, on the eager and the fused path."""
    torch.manual_seed(0)
    model, (x, y) = nn.Linear(4, 3), _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(),
                                                                                          lr=0.1),
                        max_grad_norm=1.0, noise_multiplier=5.0, expected_batch_size=8, secure_rng=secure,
                        backend="eager")
    for _ in range(2):  # eager, then fused
        step(x[:8], y[:8])
        flat = step.noise._buffer.get("flat")
        assert flat is None or not flat.any()
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())  # the noised gradient is still there


def test_a_failed_step_gives_back_torchs_global_generator_the_models_dropout_drew_from(monkeypatch):
    """With ``generator=`` for the noise, the model's dropout still draws from torch's global generator: a
    failed step puts it back too, so the run goes on as if the call never happened."""
    runs = []
    for fail in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
        gen = torch.Generator().manual_seed(1)
        x, y = _data()
        private = _private(model, x, y, gen, max_grad_norm=1.0)
        private.step(x[:8], y[:8])
        if fail:  # the fused program runs (its dropout draws), then the call fails before the commit
            _fail_after_update(monkeypatch, CompiledGraph, "run")
            with pytest.raises(_Failing):
                private.step(x[8:], y[8:])
            monkeypatch.undo()
            assert private.steps == 1
        private.step(x[8:], y[8:])
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_the_accountant_refuses_values_with_no_privacy_meaning():
    from compiled_psg import Accountant

    accountant = Accountant("rdp")
    for sigma, steps in ((float("nan"), 1), (-1.0, 1), ("1.0", 1), (True, 1), (1.0, -5), (1.0, 0), (1.0, 2.5)):
        with pytest.raises(DPConfigError):
            accountant.step(sigma, 0.01, steps)
    assert accountant.history == []
    accountant.step(1.0, 0.01, 3)
    assert accountant.steps == 3


def test_a_schedule_whose_noise_is_refused_stays_at_its_epoch():
    from compiled_psg import LambdaNoise

    model, gen, x, y, private = _after_one_step()
    schedule = LambdaNoise(private, lambda epoch: 1.0 if epoch < 2 else float("inf"))
    schedule.step()
    assert schedule.last_epoch == 1 and private.noise_multiplier == 1.0
    with pytest.raises(DPConfigError):
        schedule.step()
    assert schedule.last_epoch == 1 and private.noise_multiplier == 1.0


@pytest.mark.parametrize("setting", [
    dict(expected_batch_size=1e-320), dict(expected_batch_size=float("inf")), dict(expected_batch_size="8"),
    dict(noise_multiplier=True), dict(max_grad_norm=True), dict(secure_rng="no"), dict(backend="foo"),
    dict(automatic_gamma="x", clipping="automatic"), dict(target_unclipped_quantile="0.5", clipping="adaptive"),
    dict(min_clipbound=None, clipping="adaptive"),
    dict(clipping="adaptive", unclipped_num_std=float("inf"), noise_multiplier=1.0),
    dict(in_dims="x"), dict(in_dims=(0, True)), dict(transactional="no"), dict(distributed="no"),
    dict(cuda_graphs="no"), dict(secure_rng=True, generator=torch.Generator().manual_seed(0)),
], ids=["tiny_divisor", "infinite_divisor", "string_divisor", "bool_sigma", "bool_bound", "string_secure",
        "unknown_backend", "string_gamma", "string_quantile", "none_min_bound", "infinite_count_noise",
        "string_in_dims", "bool_in_dims", "string_transactional", "string_distributed", "string_cuda_graphs",
        "secure_with_a_generator"])
def test_settings_that_would_break_the_training_are_refused_naming_them(setting):
    model = nn.Linear(4, 3)
    options = dict(max_grad_norm=1.0, noise_multiplier=0.0, backend="eager") | setting
    with pytest.raises(DPConfigError) as info:
        compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                     **options)
    named = next(k for k in setting if k != "clipping" and not (k == "noise_multiplier" and len(setting) > 2))
    assert named in str(info.value)


@pytest.mark.parametrize("optimizer", [lambda p: torch.optim.LBFGS(p), lambda p: torch.optim.SparseAdam(p)],
                         ids=["LBFGS", "SparseAdam"])
def test_an_optimizer_that_cannot_take_a_dp_step_is_refused_when_the_step_is_built(optimizer):
    """They were accepted, and the first step raised torch's own TypeError / RuntimeError."""
    model = nn.Linear(4, 3)
    with pytest.raises(DPConfigError, match=r"cannot take a DP step: .*Fix: use an optimizer"):
        compile_step(lambda x, y: F.cross_entropy(model(x), y), model, optimizer(list(model.parameters())),
                     max_grad_norm=1.0, backend="eager")


@pytest.mark.parametrize("setting", [dict(secure_rng=True, generator=torch.Generator().manual_seed(0)),
                                     dict(poisson_sampling="no"), dict(secure_rng="yes")],
                         ids=["secure_with_a_generator", "string_poisson", "string_secure"])
def test_make_private_refuses_a_setting_it_would_misread_before_reading_the_loader(setting):
    """``secure_rng=True`` with a generator ignored the generator (a run seeded to be reproducible was not);
    ``poisson_sampling="no"`` sampled with Poisson coins."""
    from torch.utils.data import DataLoader, TensorDataset

    class Watched(TensorDataset):
        reads = 0

        def __getitem__(self, i):
            Watched.reads += 1
            return super().__getitem__(i)

    model = nn.Linear(4, 3)
    loader = DataLoader(Watched(torch.randn(16, 4), torch.randint(0, 3, (16,))), batch_size=4)
    with pytest.raises(DPConfigError, match=next(iter(setting))):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager", **setting)
    assert Watched.reads == 0


def test_trained_parameters_sharing_memory_are_refused_and_disjoint_views_of_one_buffer_train_exactly():
    """Round M: ``m[2].weight.data = m[0].weight.data`` (two Parameters, one memory) took a fused update 0.046 off
    torch's, the same clipped sums given (each parameter's new value written from the old memory, one over the
    other); with a parameter made of rows of another's data, those rows were not updated at all."""
    def tied():
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
        model[2].weight.data = model[0].weight.data
        return model

    def overlapping():
        model = nn.Linear(4, 3).double()
        model.rows = nn.Parameter(model.weight.data[:2])
        return model

    for make, names in ((tied, "'0.weight' and '2.weight'"), (overlapping, "'weight' and 'rows'")):
        model = make()
        with pytest.raises(DPConfigError, match=f"the parameters {names} share memory.*Fix: tie them as one"):
            compile_step(lambda x, y, model=model: F.cross_entropy(model(x)[:, :3], y), model,
                         torch.optim.SGD(model.parameters(), lr=0.5), max_grad_norm=1.0, backend="eager")
    torch.manual_seed(0)
    flat = torch.randn(4 * 3 + 3, dtype=torch.float64)
    model, reference = nn.Linear(4, 3).double(), nn.Linear(4, 3).double()
    model.weight, model.bias = nn.Parameter(flat[:12].view(3, 4)), nn.Parameter(flat[12:])  # one buffer, apart
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.5),
                        max_grad_norm=1e6, backend="eager")
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):  # the eager first step, then the fused program's
        step(x, y)
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_parameters_tied_through_data_after_the_step_was_built_are_refused_at_the_next_step():
    """Red team O: the check ran when the step was built only; ``m[2].weight.data = m[0].weight.data`` after two
    steps let later steps run, 0.0196 off torch's SGD. The next step refuses, changing nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 4, (6,))
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.5),
                        max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=6, backend="eager",
                        generator=torch.Generator().manual_seed(0))
    step(x, y)
    step(x, y)  # the fused program's
    model[2].weight.data = model[0].weight.data
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        with pytest.raises(DPConfigError, match="the parameters '0.weight' and '2.weight' share memory"):
            step(x, y)
    assert step.steps_taken == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model[2].weight.data = model[0].weight.data.clone()  # apart again: the step goes on
    step(x, y)
    assert step.steps_taken == 3


def test_a_secure_sampler_takes_no_generator():
    from compiled_psg._train.sampling import PoissonBatchSampler

    with pytest.raises(DPConfigError, match="generator= would be ignored"):
        PoissonBatchSampler(16, 0.25, generator=torch.Generator().manual_seed(0), secure=True)
    with pytest.raises(DPConfigError, match="secure must be True or False, got str 'no'"):
        PoissonBatchSampler(16, 0.25, secure="no")
    assert PoissonBatchSampler(16, 0.25, secure=True).generator is None


def test_an_unknown_keyword_of_make_private_is_named_as_its_own():
    """``make_private(..., foo=1)`` forwarded it: "compile_step() got an unexpected keyword argument 'foo'"."""
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Linear(4, 3)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,))), batch_size=4)
    with pytest.raises(DPConfigError, match=r"make_private got unexpected keyword arguments \['foo'\]"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, foo=1, backend="eager")


def test_a_function_passed_as_the_model_is_named():
    model = nn.Linear(4, 3)
    with pytest.raises(DPConfigError, match="model must be an nn.Module"):
        compile_step(lambda x: model(x).sum(), lambda x: model(x), torch.optim.SGD(model.parameters(), lr=0.1))


# ----- hooks that would see the batch's un-noised gradient, or change it ------------------------------------------


def _scale_gradient(g):
    return g * 2


def _optimizer_in_backward(p):
    with torch.no_grad():
        p.add_(p.grad, alpha=-0.1)


def _double_input_gradients(module, grad_input, grad_output):
    return tuple(None if g is None else 2 * g for g in grad_input)


def _double_output_gradients(module, grad_output):
    return tuple(None if g is None else 2 * g for g in grad_output)


#: hook -> (register it on ``_stepper``'s model, what the refusal names: the qualified name and the hook kind)
GRADIENT_HOOKS = {
    "post_accumulate_grad": (lambda m: m[0].weight.register_post_accumulate_grad_hook(_optimizer_in_backward),
                             r"parameter 0\.weight has a post-accumulate-grad hook "
                             r"\(register_post_accumulate_grad_hook\): _optimizer_in_backward at .*"
                             r"test_step_transaction\.py:\d+.*optimizer in backward.*Fix: remove the hook"),
    "register_hook": (lambda m: m[2].bias.register_hook(_scale_gradient),
                      r"parameter 2\.bias has a gradient hook \(register_hook\): _scale_gradient at .*"
                      r"test_step_transaction\.py:\d+.*Fix: remove the hook"),
    "full_backward_hook": (lambda m: m[2].register_full_backward_hook(_double_input_gradients),
                           r"module 2 \(Linear\), which holds parameters that require grad, has a backward "
                           r"hook \(register_full_backward_hook\): _double_input_gradients at .*Fix: remove the hook"),
    "backward_hook": (lambda m: m[0].register_backward_hook(_double_input_gradients),
                      r"module 0 \(Linear\), which holds parameters that require grad, has a backward hook "
                      r"\(register_backward_hook\)"),
    "full_backward_pre_hook": (lambda m: m.register_full_backward_pre_hook(_double_output_gradients),
                               r"the model \(Sequential\), which holds parameters that require grad, has a backward "
                               r"pre-hook "
                               r"\(register_full_backward_pre_hook\): _double_output_gradients at .*Fix: "
                               r"remove the hook"),
}


def _everything(model, step, generator):
    """``_state`` and torch's global generator (the model's dropout draws from it)."""
    return _state(model, step, generator), torch.get_rng_state()


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("hook", list(GRADIENT_HOOKS))
def test_a_gradient_hook_added_after_the_step_was_built_is_refused_and_changes_nothing(hook, optimizer):
    """A hook on a trained parameter or on a module holding one, registered after two steps (the fused program
    built: plain SGD runs it from the first step, Adam after an eager first step). The program writes ``.grad``
    and applies the update itself, so the hook would not run (post-accumulate: an optimizer stepped in backward
    was silently skipped), or it would see and change the batch's un-noised gradient. The step refuses it with
    ``DPConfigError`` naming the parameter or module, the hook kind and the fix, and changes nothing: after the
    hook is removed the run equals one that never had it, bit for bit."""
    register, names = GRADIENT_HOOKS[hook]
    x, y = _data(32)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, optimizer=optimizer)
    step(x[:8], y[:8])
    step(x[8:16], y[8:16])
    assert step.fused
    handle = register(model)
    before = _everything(model, step, gen)
    with pytest.raises(DPConfigError, match=names):
        step(x[16:24], y[16:24])
    after = _everything(model, step, gen)
    assert _same_state(before[0], after[0]) and torch.equal(before[1], after[1])
    handle.remove()
    step(x[16:24], y[16:24])
    step(x[24:], y[24:])

    gen_clean = torch.Generator().manual_seed(5)
    clean_model, clean = _stepper(gen_clean, optimizer=optimizer)
    for k in range(4):
        clean(x[8 * k:8 * (k + 1)], y[8 * k:8 * (k + 1)])
    assert _same_state(_state(model, step, gen), _state(clean_model, clean, gen_clean))


@pytest.mark.parametrize("hook", list(GRADIENT_HOOKS))
def test_a_gradient_hook_is_refused_when_the_step_is_built(hook):
    register, names = GRADIENT_HOOKS[hook]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    register(model)
    with pytest.raises(DPConfigError, match=names):
        compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                     max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")


def test_a_backward_hook_on_the_second_owner_of_a_tied_parameter_is_refused_when_the_step_is_built():
    """Round K: the walk lists a parameter's own hooks once, and skipped its second owner when it listed the
    modules holding trained parameters, so a backward hook on that module fell to the capture's refusal, which
    does not name it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 3))
    model[2].weight, model[2].bias = model[0].weight, model[0].bias
    model[2].register_full_backward_hook(_double_input_gradients)
    with pytest.raises(DPConfigError, match=r"module 2 \(Linear\), which holds parameters that require grad, has a "
                                            r"backward hook"):
        compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                     max_grad_norm=1.0, noise_multiplier=1.0, backend="eager")


def test_a_gradient_hook_under_make_private_is_refused_and_the_accountant_counts_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(1)
    x, y = _data()
    private = _private(model, x, y, gen, max_grad_norm=1.0)
    private.step(x[:8], y[:8])
    handle = model[2].weight.register_post_accumulate_grad_hook(_optimizer_in_backward)
    snapshot, history = _snapshot(model, gen), list(private.accountant.history)
    with pytest.raises(DPConfigError, match=r"parameter 2\.weight has a post-accumulate-grad hook"):
        private.step(x[8:], y[8:])
    assert _unchanged(model, gen, snapshot) and private.accountant.history == history and private.steps == 1
    handle.remove()
    private.step(x[8:], y[8:])
    assert private.steps == 2


def test_a_global_module_backward_hook_is_refused_by_the_step():
    x, y = _data(16)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, optimizer=torch.optim.SGD)
    step(x[:8], y[:8])
    full_before = nn.modules.module._global_is_full_backward_hook  # set for good by a registration
    handle = nn.modules.module.register_module_full_backward_hook(_double_input_gradients)
    before = _everything(model, step, gen)
    try:
        with pytest.raises(DPConfigError, match=r"a global module backward hook \(register_module_full_backward_hook"
                                                r".*_double_input_gradients at .*Fix: remove the hook"):
            step(x[8:], y[8:])
    finally:
        handle.remove()
        nn.modules.module._global_is_full_backward_hook = full_before
    after = _everything(model, step, gen)
    assert _same_state(before[0], after[0]) and torch.equal(before[1], after[1])
    step(x[8:], y[8:])
    assert step.steps_taken == 2


def test_a_backward_hook_on_a_module_without_trained_parameters_is_still_refused():
    """The Tanh holds no parameter: its hook is refused by the capture (it would rewrite the gradient flowing
    through it), not by the step's check, which names modules that hold trained parameters."""
    from compiled_psg import UnsupportedError

    x, y = _data(16)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, optimizer=torch.optim.SGD)
    step(x[:8], y[:8])
    handle = model[1].register_full_backward_hook(_double_input_gradients)
    before = _everything(model, step, gen)
    with pytest.raises(UnsupportedError, match="a module backward hook.*Fix: remove the hook"):
        step(x[8:], y[8:])
    after = _everything(model, step, gen)
    assert _same_state(before[0], after[0]) and torch.equal(before[1], after[1])
    handle.remove()


class _ExportingSGD(torch.optim.SGD):
    """An optimizer whose own ``step`` shows the noisy gradient to the user's code (``look``)."""

    look = None

    def step(self, closure=None):
        type(self).look()
        return super().step(closure)


@pytest.mark.parametrize("where", ["post hook", "pre hook", "global post hook", "global pre hook",
                                   "a subclass's step"])
def test_a_step_whose_noisy_update_the_users_code_saw_is_counted_and_its_noise_not_drawn_again(where):
    """The user's code in ``optimizer.step()`` (a hook, a subclass's step) copies the noisy gradient, then the
    call is interrupted. The update is released: the step and the accountant count it, and the generator is left
    past its noise, so that the retry on the same batch shows other noise (drawn again, the two copies would
    differ by nothing, and two batches' copies by their noiseless difference). The parameters go back to before
    the call, and the training goes on from there."""
    from torch.optim import optimizer as optim_module

    x, y = _data(16)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(5)
    seen, fail = [], [True]

    def look(*_):
        seen.append(model.weight.grad.clone())
        if fail[0]:
            fail[0] = False
            raise KeyboardInterrupt

    kind = _ExportingSGD if where == "a subclass's step" else torch.optim.SGD
    private = make_private(model, kind(model.parameters(), lr=0.1), DataLoader(TensorDataset(x, y), batch_size=8),
                           lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, max_grad_norm=1.0,
                           backend="eager", generator=gen, poisson_sampling=False)
    optimizer, handle = private.dp_step.optimizer, None
    if where == "a subclass's step":
        _ExportingSGD.look = staticmethod(look)
    elif where.startswith("global"):
        register = (optim_module.register_optimizer_step_post_hook if "post" in where
                    else optim_module.register_optimizer_step_pre_hook)
        handle = register(look)
    else:
        handle = (optimizer.register_step_post_hook if "post" in where else optimizer.register_step_pre_hook)(look)
    try:
        before = _snapshot(model, gen)
        with pytest.raises(KeyboardInterrupt):
            private.step(x[:8], y[:8])
        assert private.dp_step.steps_taken == 1 and private.accountant.steps == 1
        params, state = before
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
        assert not torch.equal(gen.get_state(), state)  # left past the released noise
        private.step(x[:8], y[:8])
        assert len(seen) == 2 and not torch.allclose(seen[0], seen[1])
        assert private.dp_step.steps_taken == 2 and private.accountant.steps == 2
    finally:
        if handle is not None:
            handle.remove()


class _WatchedRate(float):
    """A learning rate of the user's type: torch's SGD computes ``-lr`` for each parameter after updating the ones
    before it, so ``__neg__`` runs the user's code between the parameters' updates (``watch``)."""

    watch = None

    def __neg__(self):
        type(self).watch()
        return float.__neg__(self)


def test_a_setting_of_the_users_type_counts_as_the_users_code_in_the_step():
    """Round K: ``lr=_WatchedRate(0.1)`` on a torch SGD with no hook copies the noisy weight already updated (the
    bias's ``-lr`` runs after the weight's update) and raises. Taken for torch's own code, the step was rolled back
    whole and its generator set back, and the retry on another batch drew the same noise, so the copy and the
    released update differed by the noiseless difference of the two batches. The step is released: counted, and
    its noise not drawn again. Also through an empty batch (Poisson's step of noise alone), always eager."""
    x, y = _data(16)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    gen = torch.Generator().manual_seed(5)
    seen, calls = [], [0]

    def watch():
        calls[0] += 1
        seen.append(model.weight.detach().clone())
        if calls[0] == 2:  # the bias's: the weight holds the noisy update
            raise KeyboardInterrupt

    _WatchedRate.watch = staticmethod(watch)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                        torch.optim.SGD(model.parameters(), lr=_WatchedRate(0.1), momentum=0.9), max_grad_norm=1.0,
                        noise_multiplier=1.0, expected_batch_size=8, backend="eager", generator=gen)
    for batch in ((x[:0], y[:0]), (x[:8], y[:8])):
        calls[0] = 0
        seen.clear()
        steps, state = step.steps_taken, gen.get_state()
        with pytest.raises(KeyboardInterrupt):
            step(*batch)
        assert step.steps_taken == steps + 1 and not torch.equal(gen.get_state(), state)
        calls[0] = 10  # the retry raises nothing
        step(*batch)
        assert step.steps_taken == steps + 2


def test_a_torch_optimizer_without_hooks_is_rolled_back_whole(monkeypatch):
    """The same interrupt after torch's own SGD has updated the parameters, with no code of the user's in its step:
    nothing was seen, so nothing is counted and the generator is set back."""
    x, y = _data(16)
    gen = torch.Generator().manual_seed(5)
    model, step = _stepper(gen, optimizer=functools.partial(torch.optim.SGD, momentum=0.9))
    before = _state(model, step, gen)
    _fail_after_update(monkeypatch, paths, "eager_update")
    with pytest.raises(_Failing):
        step(x[:8], y[:8])
    assert _same_state(before, _state(model, step, gen))


def _sgd_step(model, generator, lr=0.1):
    return compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=lr),
                        max_grad_norm=1.0, noise_multiplier=1.0, backend="eager", generator=generator)


@pytest.mark.parametrize("shared", ["a generator given to both", "torch's global generator"])
@pytest.mark.parametrize("when", ["after its own draw", "inside its own draw"])
def test_a_failed_step_does_not_rewind_a_generator_another_step_drew_released_noise_from(monkeypatch, shared, when):
    """Step A fails after step B has drawn its noise from the same generator and released its update (another
    thread's step; here B runs from inside A's noise draw). Setting the generator back to before A's call would
    give B's noise again to B's next update, and the two would differ by their noiseless sums. A leaves the
    generator where B left it (its own unreleased draw is skipped); A itself is rolled back and counts nothing.
    Inside A's draw, B's draw is not seen in the generator's state (A notes it after its own draw), only in the
    count of draws every step keeps."""
    torch.manual_seed(0)
    x, y = _data(16)
    gen = torch.Generator().manual_seed(5) if shared == "a generator given to both" else None
    shared_generator = gen if gen is not None else torch.default_generator
    model_a, model_b = nn.Linear(4, 3), nn.Linear(4, 3)
    step_a, step_b = _sgd_step(model_a, gen), _sgd_step(model_b, gen, lr=0.0)  # B's weights stay: same sums
    step_a(x[:8], y[:8])
    step_b(x[8:], y[8:])
    released, after_b = [], []
    real_draw = step_a.noise.draw_many

    def draw_with_b_in_between(*args):
        if when == "inside its own draw":
            step_b(x[8:], y[8:])
            released.append(model_b.weight.grad.clone())
            after_b.append(None)  # A's own draw follows: the generator moves on from B's state
        real_draw(*args)
        if when == "after its own draw":
            step_b(x[8:], y[8:])
            released.append(model_b.weight.grad.clone())
            after_b.append(shared_generator.get_state())
        raise _Failing("A fails after B's released draw")

    monkeypatch.setattr(step_a.noise, "draw_many", draw_with_b_in_between)
    weights_a = [p.detach().clone() for p in model_a.parameters()]
    with pytest.raises(_Failing):
        step_a(x[:8], y[:8])
    monkeypatch.undo()
    assert step_a.steps_taken == 1 and all(torch.equal(p, q) for p, q in zip(model_a.parameters(), weights_a,
                                                                           strict=True))
    if after_b[0] is not None:
        assert torch.equal(shared_generator.get_state(), after_b[0])
    step_b(x[8:], y[8:])
    assert not torch.allclose(model_b.weight.grad, released[0])  # other noise on the same clipped sum


def test_a_failed_step_does_not_rewind_a_draw_made_between_its_own(monkeypatch):
    """Code other than a DP step draws from the step's generator between the step's snapshot and its own draws
    (another thread's ``torch.randn(..., generator=g)``): the failed step does not set the generator back past
    that draw. Alone, the same failure sets it back (``test_a_step_failing_after_its_update...``)."""
    torch.manual_seed(0)
    x, y = _data(16)
    gen = torch.Generator().manual_seed(5)
    model = nn.Linear(4, 3)
    step = _sgd_step(model, gen)
    step(x[:8], y[:8])
    real_install, drawn = step.binding.install, []

    def install_after_a_draw():
        torch.randn(3, generator=gen)
        drawn.append(gen.get_state())
        real_install()

    monkeypatch.setattr(step.binding, "install", install_after_a_draw)
    _fail_after_update(monkeypatch, CompiledGraph, "run")
    before = gen.get_state()
    with pytest.raises(_Failing):
        step(x[8:], y[8:])
    assert step.steps_taken == 1 and drawn
    assert not torch.equal(gen.get_state(), before) and not torch.equal(gen.get_state(), drawn[0])


@pytest.mark.parametrize("where", ["drawing", "noise_draw"])
def test_an_interrupt_at_the_end_of_a_draw_sets_the_generator_back(where):
    """Red team R (F1): a KeyboardInterrupt landing as the step leaves one of its drawing regions (the call of the
    context manager's ``__exit__``, where CPython delivers a signal; injected with ``sys.settrace``) skipped the
    code that notes the generator's state after the owner's draw (``Rewind.drawing``) or counts the draw as ended
    (``noise_draw``): the step was rolled back, the generator left advanced. It is set back as well."""
    import sys

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    gen = torch.Generator().manual_seed(3)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.Adam(model.parameters()),
                        max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=8, backend="eager",
                        generator=gen)
    x, y = _data(8)
    x = x.double()
    step(x, y)
    if where == "drawing":
        step(x, y)  # the fused program: the draw's region is paths.fused_path's `with drawing(step)`
    hits = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__exit__":
            gen_code = getattr(getattr(frame.f_locals.get("self"), "gen", None), "gi_code", None)
            if gen_code is not None and gen_code.co_name == where:
                sys.settrace(None)
                hits.append(where)
                raise KeyboardInterrupt
        return None

    before, n = _snapshot(model, gen), step.steps_taken
    _interrupted(step, tracer, x, y)
    assert hits == [where]
    assert step.steps_taken == n and _unchanged(model, gen, before)
    step(x, y)  # and the next step sets it back again after a failure: nothing stuck in flight
    after_one, n = _snapshot(model, gen), step.steps_taken
    with pytest.raises(BatchInputError):
        step(x[:, :2], y)
    assert step.steps_taken == n and _unchanged(model, gen, after_one)


def test_public_buffers_are_fixed_and_transactional_is_a_flag():
    """Red team R (info): ``step.public_buffers = {...}`` took any set after the loss's writes were checked against
    the one the step was built with, and ``step.transactional = "no"`` any value."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, backend="eager")
    with pytest.raises(DPConfigError, match="public_buffers is fixed when the step is built"):
        step.public_buffers = {"x"}
    with pytest.raises(DPConfigError, match="transactional must be True or False, got str 'no'"):
        step.transactional = "no"
    step.transactional = False
    assert step.public_buffers == frozenset() and step.transactional is False


def test_an_unclipped_num_std_past_int64_is_a_float():
    """Red team R (F5): ``unclipped_num_std=2**70`` stayed a Python int and the count's noise raised torch's
    ``OverflowError`` after the update was applied and counted."""
    torch.manual_seed(0)
    model, (x, y) = nn.Linear(4, 3), _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, clipping="adaptive",
                        unclipped_num_std=2**70, backend="eager")
    assert type(step.config.unclipped_num_std) is float
    step(x[:8], y[:8])
    assert step.steps_taken == 1 and all(torch.isfinite(p).all() for p in model.parameters())


def _interrupted(step, tracer, *batch) -> None:
    """``step(*batch)`` under ``tracer`` (``sys.settrace``), which raises ``KeyboardInterrupt`` in it."""
    import sys

    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            step(*batch)
    finally:
        sys.settrace(None)


def _interrupt_at_line(filename_suffix: str, text: str, occurrence: int = 0):
    """A tracer raising KeyboardInterrupt at the ``occurrence``-th source line of the file that contains ``text``."""
    import compiled_psg

    path = os.path.join(os.path.dirname(compiled_psg.__file__), filename_suffix)
    with open(path) as f:
        numbers = [k + 1 for k, line in enumerate(f) if text in line]
    target, hit = numbers[occurrence], []

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != path:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == target and not hit:
                hit.append(target)
                raise KeyboardInterrupt
            return local
        return local
    return tracer, hit


def test_an_interrupt_in_the_end_of_a_noise_draw_leaves_later_failures_restorable():
    """Red team S (F8): an interrupt at ``with _lock:`` in ``noise_draw``'s ``finally`` left the draw counted as
    begun and never ended; every later failed step then left the generator advanced (the rewind took the stuck
    draw for another's). The owner's own stuck draws are told apart from the start."""

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(1)
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.Adam(model.parameters()),
                        max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, backend="eager",
                        generator=gen)
    x, y = _data(8)
    step(x, y)
    step(x, y)
    tracer, hit = _interrupt_at_line("_generators.py", "with _lock:", occurrence=1)  # noise_draw's finally
    before, n = _snapshot(model, gen), step.steps_taken
    _interrupted(step, tracer, x, y)
    assert hit and step.steps_taken == n and _unchanged(model, gen, before)
    step(x, y)
    for _ in range(2):  # later failures still set the generator back
        after, n = _snapshot(model, gen), step.steps_taken
        with pytest.raises(BatchInputError):
            step(x[:, :2], y)
        assert step.steps_taken == n and _unchanged(model, gen, after)


def test_an_interrupt_in_the_finally_that_clears_the_running_thread_leaves_the_step_usable():
    """Red team S (F6): an interrupt at ``self._running_thread = None`` (the ``finally`` of ``__call__``) left the
    step marked running: every later call was refused as "called while it is running". The lock tells."""

    torch.manual_seed(0)
    model, (x, y) = nn.Linear(4, 3), _data()
    step = compile_step(lambda x, y: F.cross_entropy(model(x), y), model, torch.optim.SGD(model.parameters(), lr=0.1),
                        max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, backend="eager")
    step(x[:8], y[:8])
    tracer, hit = _interrupt_at_line(os.path.join("_train", "step.py"), "self._running_thread = None")
    _interrupted(step, tracer, x[:8], y[:8])
    assert hit
    step(x[8:], y[8:])  # not refused as a call from inside the step
    assert step.steps_taken == 3
