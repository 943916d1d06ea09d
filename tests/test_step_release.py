"""Nothing computed from the batch leaves a DP step but the noisy update: a loss that writes a buffer or a
parameter from the batch is refused before the step runs (``_train/release.py``), unless the user declares the
buffer public; writes that do not read the batch pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import compiled_psg as psg


class Tracking(nn.Module):
    """A Linear that keeps a running mean of its input, its weight's snapshot and a call counter."""

    def __init__(self, rebind=False):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("snapshot", torch.zeros(3, 4))
        self.register_buffer("calls", torch.zeros(()))
        self.rebind = rebind  # the running mean updated by rebinding the buffer, not in place

    def forward(self, x, track_batch=True):
        with torch.no_grad():
            if track_batch and self.rebind:
                self.running = 0.9 * self.running + 0.1 * x.mean(0)
            elif track_batch:
                self.running.mul_(0.9).add_(0.1 * x.mean(0))
            self.snapshot.copy_(self.lin.weight)
            self.calls.add_(1)
        return self.lin(x)


def _batch(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _refusal_of_a_step(model, **options) -> str:
    """A DP step on ``model`` refuses its first batch, changing nothing and counting nothing: its message."""
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
                            backend="eager", **options)
    before = _state(model)
    with pytest.raises(psg.DPConfigError) as info:
        step(*_batch())
    assert step.steps_taken == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(info.value)


@pytest.mark.parametrize("rebind", [False, True], ids=["in_place", "rebound"])
def test_a_buffer_written_from_the_batch_is_refused_before_anything_changes(rebind):
    """In place or by rebinding the registered buffer (``self.running = 0.9 * self.running + ...``): the same
    refusal, naming the buffer and the line; nothing changes (parameters, grads, optimizer state, buffers,
    generator, steps taken)."""
    from test_step_transaction import _same_state, _state

    torch.manual_seed(0)
    model = Tracking(rebind)
    gen = torch.Generator().manual_seed(1)
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.Adam(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
                            backend="eager", generator=gen)
    before, rng = _state(model, step, gen), torch.get_rng_state()
    with pytest.raises(psg.DPConfigError) as info:
        step(*_batch())
    assert _same_state(before, _state(model, step, gen)) and torch.equal(rng, torch.get_rng_state())
    text = str(info.value)
    line = "self.running = 0.9 * self.running" if rebind else "self.running.mul_"
    assert "buffer 'running'" in text and "test_step_release.py" in text and line in text
    assert "snapshot" not in text and "calls" not in text  # written, but not from the batch
    assert "public_buffers" in text and "eval mode" in text


class CountsExamples(nn.Module):
    """Buffers written from the batch size alone: the sampled batch sizes are private under Poisson sampling."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("last", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(x.shape[0])
        self.last.fill_(len(x))
        return self.lin(x)


def test_a_buffer_written_from_the_batch_size_is_refused():
    torch.manual_seed(0)
    model = CountsExamples()
    text = _refusal_of_a_step(model)
    assert "buffer 'seen'" in text and "buffer 'last'" in text
    public = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                              torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=1.0,
                              backend="eager", public_buffers=["seen", "last"])
    public(*_batch(5))
    assert model.seen.item() == 5 and model.last.item() == 5


@pytest.mark.parametrize("rebind", [False, True], ids=["in_place", "rebound"])
def test_a_public_buffer_and_writes_that_do_not_read_the_batch_pass(rebind):
    torch.manual_seed(0)
    model = Tracking(rebind)
    x, y = _batch()
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, backend="eager",
                            public_buffers=["running"])
    step(x, y)
    torch.testing.assert_close(model.running, 0.1 * x.mean(0))
    assert model.calls.item() == 1 and step.steps_taken == 1
    quiet = Tracking()
    step = psg.compile_step(lambda x, y: F.cross_entropy(quiet(x, track_batch=False), y), quiet,
                            torch.optim.SGD(quiet.parameters(), lr=0.1), max_grad_norm=1.0, backend="eager")
    step(x, y)
    assert step.steps_taken == 1


def test_make_private_refuses_at_set_up():
    torch.manual_seed(0)
    model = Tracking()
    x, y = _batch(16)
    with pytest.raises(psg.DPConfigError, match="buffer 'running'"):
        psg.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         DataLoader(TensorDataset(x, y), batch_size=8), lambda x, y: F.cross_entropy(model(x), y),
                         noise_multiplier=1.0, backend="eager", poisson_sampling=False)
    assert model.running.abs().sum() == 0


def test_embedding_max_norm_renorming_the_batch_rows_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Flatten(), nn.Linear(8, 2))
    x, y = torch.randint(0, 10, (6, 2)), torch.randint(0, 2, (6,))
    weight = model[0].weight.detach().clone()
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, backend="eager")
    with pytest.raises(psg.DPConfigError, match=r"parameter '0.weight'.*max_norm=None"):
        step(x, y)
    assert torch.equal(model[0].weight, weight)


@pytest.mark.parametrize("names, match", [
    (["nope"], "names no buffer"), ("running", "list of buffer names"), (5, "list of buffer names or None.*got int 5"),
    ((n for n in ["running"]), "list of buffer names or None.*got generator"),
    (["running", 3], r"got list \['running', 3\]"),
], ids=["unknown", "string", "int", "generator", "not_a_name"])
def test_public_buffers_must_name_buffers(names, match):
    model = Tracking()
    with pytest.raises(psg.DPConfigError, match=match):
        psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                         torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, backend="eager",
                         public_buffers=names)


def test_public_buffers_none_is_no_public_buffer():
    """None raised a raw TypeError ('NoneType' object is not iterable): it is the default, no public buffer."""
    model = Tracking()
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, backend="eager",
                            public_buffers=None)
    assert step.public_buffers == frozenset()


def test_the_clip_norm_covers_the_optimizers_parameters_and_the_rest_is_named():
    """An optimizer over the last layer only: its step equals DP-SGD of the last layer alone (the frozen first
    layer's gradient is outside the norm), for flat and automatic clipping; the untrained parameters are named."""
    x, y = _batch(8)
    for clipping in ("flat", "automatic"):
        results = []
        for freeze in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
            if freeze:
                model[0].requires_grad_(False)
            opt = torch.optim.SGD(model[2].parameters(), lr=1.0)

            def make(model=model, opt=opt, clipping=clipping):
                return psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model, opt, max_grad_norm=0.01,
                                        backend="eager", clipping=clipping)
            if freeze:
                step = make()
            else:
                with pytest.warns(UserWarning, match=r"\['0.weight', '0.bias'\] require grad but the optimizer"):
                    step = make()
            step(x, y)
            results.append([p.detach().clone() for p in model.parameters()])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_buffer_written_from_a_weight_reads_the_pre_update_weight_on_every_step(backend):
    """``snapshot.copy_(lin.weight)`` in the forward: after each step (the eager first one and the fused ones) the
    snapshot holds the weight the step's forward read, as one eager forward then ``optimizer.step()`` leaves it."""
    torch.manual_seed(0)
    model = Tracking()
    step = psg.compile_step(lambda x, y: F.cross_entropy(model(x, track_batch=False), y), model,
                            torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), max_grad_norm=1.0,
                            backend=backend)
    for i in range(3):
        x, y = _batch(8 + i)
        before = model.lin.weight.detach().clone()
        step(x, y)
        assert not torch.equal(model.lin.weight, before)
        assert torch.equal(model.snapshot, before), f"step {i}: the snapshot is not the pre-update weight"
    assert step.fused and model.calls.item() == 3


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_loss_that_writes_a_trained_parameter_is_refused_before_anything_changes(backend):
    """``weight.clamp_()`` under ``no_grad`` inside the loss: its per-sample gradients were not the loop's (1.4
    away), and the step's update would overwrite the write. Refused, naming the parameter; nothing changes."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)

    def loss(x, y):
        with torch.no_grad():
            model.weight.clamp_(-0.1, 0.1)
        return F.cross_entropy(model(x), y)

    step = psg.compile_step(loss, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                            noise_multiplier=1.0, backend=backend)
    before = _state(model)
    with pytest.raises(psg.UnsupportedError, match=r"writes the parameter 'weight' in place.*p.clamp_"):
        step(*_batch())
    assert step.steps_taken == 0 and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


_STASH = torch.zeros(4)


@pytest.mark.parametrize("where", ["global", "closure"])
def test_a_tensor_outside_the_model_written_from_the_batch_is_named_as_such(where):
    """A global or a tensor the loss closes over, written from the batch: refused before anything changes, named as
    what it is (not "buffer 'a tensor'"), with a fix that applies to it (public_buffers takes model buffers only)."""
    from test_step_transaction import _same_state, _state

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    local = torch.zeros(4)

    def loss(x, y):
        with torch.no_grad():
            (_STASH if where == "global" else local).copy_(x.mean(0))  # the write
        return F.cross_entropy(model(x), y)

    gen = torch.Generator().manual_seed(1)
    step = psg.compile_step(loss, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            max_grad_norm=1.0, noise_multiplier=1.0, backend="eager", generator=gen)
    before, rng = _state(model, step, gen), torch.get_rng_state()
    named = (r"the global tensor _STASH \(module \S*test_step_release\)" if where == "global"
             else "the tensor local that the loss function closes over")
    with pytest.raises(psg.DPConfigError, match=rf"into tensors outside the model.*{named}, written at "
                                                r"\S*test_step_release.py:\d+ in loss: .*# the write.*No step was "
                                                r"taken\. Fix: for a tensor outside the model.*model's buffers only"
                       ) as info:
        step(*_batch())
    assert "buffer" not in str(info.value).split("Fix:")[0] and "public_buffers=[" not in str(info.value)
    assert _same_state(before, _state(model, step, gen)) and torch.equal(rng, torch.get_rng_state())
    assert _STASH.abs().sum() == 0 and local.abs().sum() == 0


def test_an_unbatched_argument_written_from_the_batch_is_refused_naming_it():
    """``stats`` passed with ``in_dims`` None and written from the batch: the caller keeps it after the step with
    the batch's mean in it, outside the noise. Refused before anything changes, named by position and name, with
    the writing line and a fix; the batch itself (a batched argument) may be written."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    stats = torch.zeros(4)

    def loss(x, y, stats):
        with torch.no_grad():
            stats.copy_(x.mean(0))  # the write
        return F.cross_entropy(model(x), y)

    step = psg.compile_step(loss, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                            noise_multiplier=1.0, backend="eager", in_dims=(0, 0, None))
    weight = model.weight.detach().clone()
    with pytest.raises(psg.DPConfigError, match=r"argument 2 \(stats\) of the loss, which in_dims does not slice "
                                                r"per sample \(None\), written at \S*test_step_release.py:\d+ in "
                                                r"loss: .*# the write.*No step was taken\. Fix: .*argument of the "
                                                r"loss, remove the write"):
        step(*_batch(), stats)
    assert stats.abs().sum() == 0 and torch.equal(model.weight, weight) and step.steps_taken == 0

    def scales_its_batch(x, y):
        with torch.no_grad():
            x.mul_(2)
        return F.cross_entropy(model(x), y)

    psg.compile_step(scales_its_batch, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                     noise_multiplier=1.0, backend="eager")(*_batch())


@pytest.mark.parametrize("micro_batches", [None, 2], ids=["whole", "micro_batches"])
def test_a_write_into_a_strided_batch_reaches_the_callers_tensor(micro_batches):
    """Round M: the step passed the loss a contiguous copy of ``x = torch.ones(3, 6)[:, ::2]`` and dropped its
    write, where per_sample (and eager torch) write the caller's tensor, as docs/semantics.md says."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)

    def scales_its_batch(x, y):
        with torch.no_grad():
            x.mul_(2)
        return F.cross_entropy(model(x), y)

    step = psg.compile_step(scales_its_batch, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                            expected_batch_size=4.0, backend="eager", max_physical_batch_size=micro_batches)
    for _ in range(2):  # the eager first step, then the program's
        storage = torch.ones(3, 6)
        x = storage[:, ::2]
        step(x, torch.tensor([0, 1, 0]))
        assert torch.equal(x, torch.full((3, 3), 2.0)) and torch.equal(storage[:, 1::2], torch.ones(3, 3))


@pytest.mark.parametrize("micro_batches", [None, 2], ids=["whole", "micro_batches"])
def test_a_failed_step_leaves_the_arguments_the_loss_writes_as_they_were(micro_batches):
    """Red team Q1: with micro-batches, a step whose second micro-batch fails (a label out of range) was rolled
    back, but the caller's ``x`` kept the first micro-batch's write: half of it doubled. A failed step writes
    nothing of the caller's; a step that succeeds writes every row, as the whole batch does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def scales_its_batch(x, y):
        x.mul_(2)
        return F.cross_entropy(model(x), y)

    step = psg.compile_step(scales_its_batch, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                            noise_multiplier=1.0, expected_batch_size=4.0, backend="eager",
                            max_physical_batch_size=micro_batches, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the eager first step, then the program's
        x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
        before, weights, taken = x.clone(), [p.detach().clone() for p in model.parameters()], step.steps_taken
        y[3] = 99
        with pytest.raises(psg.BatchInputError):
            step(x, y)
        assert torch.equal(x, before) and step.steps_taken == taken
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
        y[3] = 0
        step(x, y)
        assert torch.equal(x, 2 * before) and step.steps_taken == taken + 1


def test_micro_batches_off_the_first_dimension_write_the_callers_rows():
    """Red team Q1: a batch along dimension 1 is cut into micro-batches that are copies, and the loss's write
    into them was dropped (x unchanged, where the whole batch doubles it)."""
    model = nn.Linear(4, 3)

    def scales_its_batch(xt, y):
        xt.mul_(2)
        return F.cross_entropy(model(xt.t()), y)

    step = psg.compile_step(scales_its_batch, model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0,
                            expected_batch_size=6.0, backend="eager", in_dims=(1, 0), max_physical_batch_size=4)
    for _ in range(2):
        x = torch.randn(4, 6)
        before = x.clone()
        step(x, torch.randint(0, 3, (6,)))
        assert torch.equal(x, 2 * before)


class _AliasedBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("alias", self.lin.bias.data)  # the bias's own memory

    def forward(self, x):
        with torch.no_grad():
            self.alias.copy_(x[:, :3].mean(0))
        return self.lin(x)


def test_a_public_buffer_sharing_a_parameters_memory_is_refused_when_the_step_is_built():
    """``public_buffers`` cannot make a parameter public: a buffer registered from a parameter's ``.data`` is
    refused by name, with the parameter it aliases and the fix, when the step is built (the capture failed
    with torch's "differentiated Tensors" message, called a compiled_psg bug)."""
    model = _AliasedBias()
    with pytest.raises(psg.DPConfigError, match=r"buffer 'alias', which shares its memory with parameter "
                                                r"'lin.bias'.*Fix: register a copy, register_buffer\('alias', "
                                                r"param.detach\(\).clone\(\)\), or leave 'alias' out"):
        psg.compile_step(lambda x, y: F.cross_entropy(model(x), y), model,
                         torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0, backend="eager",
                         public_buffers=["alias"])
