"""Reports a person reads: module paths as the model names them, repeated sites grouped, errors by class."""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_psg as psg
from compiled_psg._analyze.source import group_sites, readable_module_path
from compiled_psg._jobs.explain import report_for


@pytest.mark.parametrize("path, name", [
    ("L['loss_fn'].__closure__[0].cell_contents.conv1.1", "conv1.1"),
    ("L['loss_fn'].__closure__[0].cell_contents._modules['conv1']._modules['1']", "conv1.1"),
    ("L['fn'].__closure__[1].cell_contents.__closure__[0].cell_contents.model.layers[11].mlp", "model.layers.11.mlp"),
    ("G['model'].conv1[1]", "conv1.1"),
    ("getattr(getattr(L['self'].layers, '0'), 'mlp')", "layers.0.mlp"),
    ("L['self']", ""),
    ("L['self'].__dict__['_modules']['stem']._modules['1']", "stem.1"),
    ("L['fn'].__closure__[0].cell_contents.__dict__['_modules']['layers'][2]", "layers.2"),
])
def test_readable_module_path(path, name):
    assert readable_module_path(path) == name


class Deep(nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(depth)])

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _refusal(depth: int):
    model = Deep(depth).double()

    def loss(x):  # the model is a closure variable: Dynamo names it __closure__[0].cell_contents
        return model(x).sum()

    with pytest.raises(psg.SampleMixingError) as info:
        psg.per_sample(model, backend="eager")(loss)(torch.randn(5, 4, dtype=torch.float64))
    return info.value


def test_mixing_report_names_modules_and_groups_repeats():
    err = _refusal(depth=6)
    text = str(err.report)
    assert "__closure__" not in text and "cell_contents" not in text, text
    assert "[module stem.1 (BatchNorm1d)]" in text, text
    assert "[module layers.N.1 (BatchNorm1d)] (x6)" in text, text
    assert len(text.splitlines()) == 3, text  # the title, the stem, one line for the six repeated blocks
    message = str(err)  # the error itself groups them too: one line per op, source line and module
    assert "[module layers.N.1 (BatchNorm1d)] (x6)" in message and len(message.splitlines()) == 3, message


def test_hardswish_and_rsub_have_batch_semantics():
    """Ops torch does not tag pointwise (MobileNetV3's hardswish) are elementwise op facts, not refusals."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Hardswish(), nn.Linear(6, 3)).double()

    def loss(x):
        return (1 - model(x)).pow(2).sum()

    x = torch.randn(5, 4, dtype=torch.float64)
    got = psg.per_sample(model, backend="eager")(loss)(x)
    for i in range(5):
        want = torch.autograd.grad(loss(x[i:i + 1]), list(model.parameters()))
        for (name, _), w in zip(model.named_parameters(), want, strict=True):
            torch.testing.assert_close(got[name][i], w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("build", ["complex", "polar"])
def test_complex_construction_has_batch_semantics(build):
    """``torch.complex`` and ``torch.polar`` build each element from the same elements of their inputs (torch tags
    neither pointwise): exact, not refused."""
    p = torch.randn(4, dtype=torch.float64, requires_grad=True)
    make = {"complex": lambda x: torch.complex(x * p, x.sin()), "polar": lambda x: torch.polar(x * p + 2, x)}[build]

    def loss(x):
        return make(x).abs().pow(3).sum() + make(x).angle().sum()

    x = torch.randn(3, 4, dtype=torch.float64)
    got = psg.per_sample({"p": p}, backend="eager")(loss)(x)["p"]
    want = torch.stack([torch.autograd.grad(loss(x[i:i + 1]), p)[0] for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_group_sites_keeps_distinct_sites():
    err = _refusal(depth=2)
    sites = err.report.mixing
    assert len(sites) == 3
    lines = group_sites(sites)
    assert len(lines) == 2 and "(x2)" in lines[1]
    # a single site is printed as it is
    assert group_sites(sites[:1]) == [str(sites[0])]


def test_explain_on_undecorated_function_names_the_fix():
    model = nn.Linear(3, 2)

    def loss(x):
        return model(x).sum()

    with pytest.raises(psg.BatchInputError, match=r"decorate .*@psg\.per_sample"):
        psg.explain(loss, torch.randn(4, 3))


def test_reduction_argument_errors_are_batch_input_errors():
    with pytest.raises(psg.BatchInputError, match="max_norm must be positive"):
        psg.clip_sum(0.0)
    with pytest.raises(psg.BatchInputError, match="empty_result"):
        psg.custom(lambda n, g: g.sum()).empty({})

    class NoEmit(psg.Reduction):
        pass

    with pytest.raises(psg.BatchInputError, match="must define emit"):
        NoEmit().emit(None)
    with pytest.raises(psg.BatchInputError, match="no example named 'nope'"):
        report_for("nope")


def test_save_and_print_graphs_name_a_destination_they_cannot_write(tmp_path, monkeypatch):
    """A file where the folder goes, a folder that cannot be made, a path that is not one, a stream that is not
    one or is closed: each raised Python's own error (FileExistsError, AttributeError: 'int' object has no
    attribute 'write', ...). Each is a BatchInputError naming the destination and the fix."""
    model = nn.Linear(3, 2)
    fn = psg.per_sample(model)(lambda x, y: F.cross_entropy(model(x), y))
    report = psg.explain(fn, torch.randn(4, 3), torch.randint(0, 2, (4,)))
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(psg.BatchInputError, match="that path is a file.*Fix: pass the path of a folder"):
        report.save(a_file)
    assert a_file.read_text() == "mine"
    for folder in (a_file / "below", "/proc/no/folder"):
        with pytest.raises(psg.BatchInputError, match="could not write into the folder .*Fix: pass a folder"):
            report.save(folder, drawings=False)
    with pytest.raises(psg.BatchInputError, match="takes the path of a folder .* got int 3"):
        report.save(3)
    assert report.save(tmp_path / "new" / "folder", drawings=False)[0].read_text() == str(report) + "\n"
    closed = io.StringIO()
    closed.close()
    for stream, message in ((3, "got int 3"), ("graphs.txt", "got str 'graphs.txt'"),
                            (closed, "I/O operation on closed file")):
        with pytest.raises(psg.BatchInputError, match=f"print_graphs.*{message}.*Fix: pass an open text stream"):
            report.print_graphs(file=stream)
    printed = io.StringIO()
    report.print_graphs(file=printed)
    assert printed.getvalue() == (f"# ===== before =====\n{report.graph_text('before')}\n"
                                  f"# ===== after =====\n{report.graph_text('after')}\n")
    monkeypatch.setenv("COMPILED_PSG_DUMP", str(a_file))
    with pytest.raises(psg.BatchInputError, match="COMPILED_PSG_DUMP=.*a_file.*could not write"):
        psg.explain(psg.per_sample(model)(lambda x, y: F.cross_entropy(model(x), y)), torch.randn(4, 3),
                    torch.randint(0, 2, (4,)))


def test_explain_of_a_per_sample_grad_function_is_that_of_the_per_sample_function():
    """explain refused what per_sample_grad makes ("expects a function decorated with @psg.per_sample"). It takes
    it with its arguments as it takes them (the parameter dict among them): the report is that of the equivalent
    @per_sample function, and the call that follows reuses its capture."""
    torch.manual_seed(0)
    params = {"w": torch.randn(2, 3), "b": torch.randn(2)}
    loss = lambda x, p, y: F.cross_entropy(x @ p["w"].T + p["b"], y)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    grad_fn = psg.per_sample_grad(loss, argnums=1)
    report = psg.explain(grad_fn, x, params, y)
    leaves = {k: v.requires_grad_() for k, v in params.items()}
    same = psg.explain(psg.per_sample(leaves)(lambda x, y: loss(x, leaves, y)), x, y)
    assert str(report) == str(same) and [r.name for r in report.rewrites] == ["w", "b"]
    for which in ("captured", "before", "after"):
        assert report.graph_text(which) == same.graph_text(which)
    assert grad_fn(x, params, y)["w"].shape == (4, 2, 3) and grad_fn.per_sample_function.captures == 1
    with pytest.raises(psg.BatchInputError, match="argument 1 must be a dict of parameters, got Tensor"):
        psg.explain(grad_fn, x, y, params)


def test_explain_of_a_dp_step_shows_its_clip_choices_and_the_step_reuses_the_capture():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = psg.compile_step(lambda x, y: nn.functional.cross_entropy(model(x), y), model, opt,
                            max_grad_norm=1.0, noise_multiplier=0.0, backend="eager")
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    before = [p.detach().clone() for p in model.parameters()]
    report = psg.explain(step, x, y)
    assert [r.name for r in report.rewrites] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for r in report.rewrites:  # each parameter: the clip norm's plan and the clipped sum's
        assert sorted(c.quantity for c in r.choices) == ["sq_norm", "weighted_sum"], r.choices
    assert "0.weight" in str(report) and "weighted_sum: book-keeping" in str(report)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # runs nothing
    step(x, y)
    assert step.captures == 1  # the step used the capture explain made


def test_explain_of_a_dp_step_with_a_refused_loss_carries_the_report():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = psg.compile_step(lambda x: model(x).sum(), model, opt, max_grad_norm=1.0, noise_multiplier=0.0,
                            backend="eager")
    with pytest.raises(psg.SampleMixingError) as info:
        psg.explain(step, torch.randn(5, 4))
    assert "BatchNorm1d" in str(info.value.report)


def test_explain_refuses_what_the_step_refuses_an_empty_batch_and_autocast():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = psg.compile_step(lambda x: model(x).sum(), model, opt, max_grad_norm=1.0, noise_multiplier=0.0,
                            backend="eager")
    fn = psg.per_sample(model, backend="eager")(lambda x: model(x).sum())
    for target in (step, fn):
        with pytest.raises(psg.BatchInputError, match="empty batch"):
            psg.explain(target, torch.randn(0, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(psg.DPConfigError, match="autocast"):
        psg.explain(step, torch.randn(4, 3))
    assert step.captures == 0  # neither refusal captured anything


def test_a_frame_without_its_code_line_does_not_swallow_the_next_frame():
    """linecache finds no code for a frame whose file changed since import: the user's frame after it is still
    the one named."""
    import torch.fx as fx

    from compiled_psg._analyze.source import source_line

    graph = fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = ('  File "/site/compiled_psg/_capture/dynamo.py", line 613, in joint\n'
                                '  File "/home/me/train.py", line 144, in loss\n    return F.cross_entropy(x)\n')
    assert source_line(node) == "/home/me/train.py:144 in loss: return F.cross_entropy(x)"


class _Norms(nn.Module):
    """Three BatchNorms of other names run by one line of code, then a repeated block whose norms run another."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = (nn.BatchNorm1d(4) for _ in range(3))
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(3)])

    def forward(self, x):
        for norm in (self.first, self.second, self.third):
            x = norm(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_sites_are_grouped_by_op_and_source_line_and_a_shared_reason_is_said_once():
    """A ResNet's BatchNorms (bn1, bn2, downsample.1 in each block) gave one line per module name pattern, each
    repeating the same reason and Fix (13 lines, 5 KB, for 4 lines of code). One line per op and source line,
    with the count and the modules in brief; the reason and Fix once."""
    model = _Norms().double()
    with pytest.raises(psg.SampleMixingError) as info:
        psg.per_sample(model, backend="eager")(lambda x: model(x).sum())(torch.randn(5, 4, dtype=torch.float64))
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 2, lines
    assert re.search(r"\[module (model\.)?first, (model\.)?second, (model\.)?third \(BatchNorm1d\)\] \(x3\): "
                     r"BatchNorm in training mode .* Fix: call model\.eval\(\)", lines[0]), lines
    assert re.search(r"\[module (model\.)?blocks\.N\.1 \(BatchNorm1d\)\] \(x3\): the same reason and Fix as above$",
                     lines[1]), lines
