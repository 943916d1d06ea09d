"""Every module with parameters in torch's ``module_db`` against the naive-loop reference.

Each case is one ModuleInfo sample: a batched sample as given, or an unbatched one given a batch dimension
(``B`` copies with fresh random values for float inputs, the same masks and indices). Parameters are set to
small random values (with the default inits many gradients vanish: ``sum(LayerNorm(x))`` is constant). The loss
is the sum of every float output times a fixed random projection that is the same for every sample.

A case passes (float64, ``backend="eager"``), or it raises a ``PerSampleError``: then ``vmap(grad)`` must fail
on it too, and the refusal must be listed in ``REFUSED`` below. Known engine bugs (cases that ``vmap(grad)``
handles but compiled_psg does not yet) are strict xfails listed in ``KNOWN_BUGS``: fixing one turns it into an
XPASS failure, so the entry is removed with the fix. Any other exception fails.

The long tail (every sample past the first of a module) is marked ``slow`` and ``sweep_tail``, which
pyproject's addopts deselects: ``PYTHONPATH=$PWD python -m pytest tests/test_module_db.py -m sweep_tail -n 2``
runs it.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from reference import reference_per_sample, sample
from torch.testing._internal.common_modules import module_db

import compiled_psg as psg
from compiled_psg._errors import PerSampleError, SampleMixingError

# torch's own warnings from the eager probes and the reference loop, not from compiled_psg: chunking options the
# chunked path does not support, and the nested-tensor fast path of TransformerEncoder in eval-mode probes
pytestmark = [pytest.mark.filterwarnings("ignore:linear_cross_entropy. ``options`` ignored:UserWarning"),
              pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype:UserWarning")]

DTYPE = torch.float64
TOL = dict(rtol=1e-7, atol=1e-9)
FAST_PER_MODULE = 1  # samples per module in the default run (train mode; BatchNorm both); the rest are slow
UNBATCHED_B = 3

_SEQ_MODULES = (nn.RNNBase, nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
                nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_CELLS = (nn.RNNCellBase,)
_SEQ_ARGS = {"input", "src", "tgt", "memory", "query", "key", "value"}

# Refusals that are right: the loss really mixes samples, and vmap(grad) fails on the case too.
# (module name, regex on the case id, error class, why)
REFUSED = [
    ("nn.BatchNorm1d", r"-train$", SampleMixingError, "batch statistics in train mode mix the samples"),
    ("nn.BatchNorm2d", r"-train$", SampleMixingError, "batch statistics in train mode mix the samples"),
    ("nn.BatchNorm3d", r"-train$", SampleMixingError, "batch statistics in train mode mix the samples"),
]

# Engine bugs outside this file's reach: vmap(grad) handles these (or the refusal has the wrong class), and
# compiled_psg does not yet (issue 11). (module name, regex on the case id, error class raised today, regex on
# its message, what fails)
KNOWN_BUGS: list[tuple[str, str, type, str, str]] = []


def _samples(mi, training: bool):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "enable_nested_tensor is True", UserWarning)
        return mi.module_inputs_func(mi, device="cpu", dtype=DTYPE, requires_grad=False, training=training)


def _construct(mi, s) -> nn.Module:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "enable_nested_tensor is True", UserWarning)
        return mi.module_cls(*s.constructor_input.args, **s.constructor_input.kwargs)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_")


@dataclass(frozen=True)
class SweepCase:
    module: str
    index: int
    training: bool
    id: str

    def info(self):
        return next(mi for mi in module_db if mi.name == self.module)


def _cases() -> list:
    params = []
    for mi in module_db:
        first = _samples(mi, True)
        if not first or not list(_construct(mi, first[0]).parameters()):
            continue
        modes = (True, False) if mi.train_and_eval_differ else (True,)
        for training in modes:
            samples = first if training else _samples(mi, training)
            for i, s in enumerate(samples):
                if s.forward_input is None or not list(_construct(mi, s).parameters()):
                    continue  # e.g. BatchNorm(affine=False): nothing to differentiate
                desc = _slug(s.desc) or "default"
                case = SweepCase(mi.name, i, training, f"{mi.name}-{i}-{desc}-{'train' if training else 'eval'}")
                fast = i < FAST_PER_MODULE and (training or mi.name.startswith("nn.BatchNorm"))
                marks = [] if fast else [pytest.mark.slow, pytest.mark.sweep_tail]
                params.append(pytest.param(case, id=case.id, marks=marks))
    return params


CASES = _cases()


# ---------------------------------------------------------------- building one case


def _is_unbatched(module: nn.Module, desc: str, first: torch.Tensor | None) -> bool:
    if "no_batch_dim" in desc:
        return True
    if first is None:
        return False
    if isinstance(module, (nn.RNNBase, nn.MultiheadAttention)):
        return first.dim() == 2
    if isinstance(module, _CELLS):
        return first.dim() == 1
    return first.dim() == 0  # PReLU's scalar sample


def _batch_dim(module: nn.Module, name: str, leaf: torch.Tensor, unbatched: bool):
    """Where the batch sits in argument ``name``: an int, None (shared), or "heads" (a per-head mask that the
    loss repeats for every sample: MultiheadAttention merges batch and heads)."""
    if isinstance(module, _SEQ_MODULES):
        if name.endswith("key_padding_mask"):
            return 0
        if name.endswith("mask"):
            if leaf.dim() == 2:
                return None
            if unbatched and leaf.dim() == 3:
                return "heads"
            raise NotImplementedError(f"{name} of shape {tuple(leaf.shape)}: batch merged with heads")
        if name in ("hx", "h_0"):
            return 1
        if name in _SEQ_ARGS:
            return 0 if _batch_first(module) else 1
    return 0


def _batch_first(module: nn.Module) -> bool:
    """Transformer layers keep ``batch_first`` on their attention submodule, not on themselves."""
    return next((m.batch_first for m in module.modules() if hasattr(m, "batch_first")), False)


def _flatten(value, path, out):
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif isinstance(value, (tuple, list)):
        for k, v in enumerate(value):
            _flatten(v, (*path, k), out)


def _rebuild(value, path, leaves):
    if isinstance(value, torch.Tensor):
        return leaves[path]
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(v, (*path, k), leaves) for k, v in enumerate(value))
    return value


def _float_leaves(out) -> list[torch.Tensor]:
    found: list = []
    _flatten(out, (), found)
    return [t for _, t in found if t.is_floating_point()]


@dataclass
class Built:
    module: nn.Module
    loss: object  # loss(*flat) -> scalar
    loss_with: object  # loss_with(call, *flat): the same loss with the module call given
    args: tuple
    in_dims: tuple
    unbatched: bool


def build(case: SweepCase) -> Built:
    mi = case.info()
    s = _samples(mi, case.training)[case.index]
    g = torch.Generator().manual_seed(1)
    module = _construct(mi, s)
    names = list(inspect.signature(module.forward).parameters)
    structure = {**{names[k]: a for k, a in enumerate(s.forward_input.args)}, **s.forward_input.kwargs}
    leaves: list = []
    for name, value in structure.items():
        _flatten(value, (name,), leaves)
    first = leaves[0][1] if leaves else None
    unbatched = _is_unbatched(module, s.desc, first)
    flat, dims = [], []
    for path, leaf in leaves:
        d = _batch_dim(module, path[0], leaf, unbatched)
        if unbatched and d not in (None, "heads"):
            if leaf.is_floating_point():
                rest = torch.randn((UNBATCHED_B - 1, *leaf.shape), generator=g, dtype=leaf.dtype)
                leaf = torch.cat([leaf.unsqueeze(0), rest]).movedim(0, d)
            else:
                leaf = torch.stack([leaf] * UNBATCHED_B, d)
        flat.append(leaf)
        dims.append(d)

    def forward(call, *xs):
        size = next(x.shape[d] for x, d in zip(xs, dims, strict=True) if isinstance(d, int))
        fixed = {p: (x.repeat(size, 1, 1) if d == "heads" else x)
                 for (p, _), x, d in zip(leaves, xs, dims, strict=True)}
        values = {name: _rebuild(v, (name,), fixed) for name, v in structure.items()}
        return call(*[values[n] for n in names[:len(s.forward_input.args)]],
                    **{n: values[n] for n in s.forward_input.kwargs})

    def loss_with(call, *xs):
        outs = _float_leaves(forward(call, *xs))
        return sum((o * p).sum() for o, p in zip(outs, projections, strict=True))

    module.to(DTYPE)
    flat = tuple(flat)
    dims_t = tuple(None if d == "heads" else d for d in dims)
    module.eval()  # the shape probes change no running statistics
    with torch.no_grad():
        full = _float_leaves(forward(module, *flat))  # also materializes Lazy modules
        empty = any(x.shape[d] == 0 for x, d in zip(flat, dims_t, strict=True) if d is not None)
        # an empty batch (LayerNorm's "empty" samples) has no sample to probe: its batch dims are the 0 sizes
        one = [f.new_zeros([1 if a == 0 else a for a in f.shape]) for f in full] if empty else \
            _float_leaves(forward(module, *sample(flat, dims_t, 0)))
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    module.train(case.training)
    # one projection per float output, broadcast over that output's batch dimension
    projections = [torch.randn([1 if a != b else a for a, b in zip(f.shape, o.shape, strict=True)], generator=g,
                               dtype=f.dtype) for f, o in zip(full, one, strict=True)]
    return Built(module, lambda *xs: loss_with(module, *xs), loss_with, flat, dims_t, unbatched)


def vmap_grad_works(built: Built) -> bool:
    """Whether ``torch.func.vmap(torch.func.grad(loss))`` runs on the case."""
    names = [n for n, _ in built.module.named_parameters()]
    dims = built.in_dims

    def one(params, *xs):
        xs = [x if d is None else x.unsqueeze(d) for x, d in zip(xs, dims, strict=True)]

        def call(*a, **k):
            return torch.func.functional_call(built.module, dict(zip(names, params, strict=True)), a, k)

        return built.loss_with(call, *xs)

    params = tuple(p.detach() for _, p in built.module.named_parameters())
    try:
        with warnings.catch_warnings():  # a warning (pytest makes them errors) is not a failure of vmap
            warnings.simplefilter("ignore")
            torch.func.vmap(torch.func.grad(one), in_dims=(None, *dims))(params, *built.args)
    except Exception:  # noqa: BLE001 - any failure means vmap cannot do it either
        return False
    return True


def _listed(table, case: SweepCase, err: Exception | None = None):
    return next((row for row in table if row[0] == case.module and re.search(row[1], case.id)
                 and (err is None or (isinstance(err, row[2]) and re.search(row[3], str(err))))), None)


def check(case: SweepCase, backend: str = "eager"):
    built = build(case)
    params = dict(built.module.named_parameters())
    state = {k: v.clone() for k, v in built.module.state_dict().items()}
    fn = psg.per_sample(built.module, in_dims=built.in_dims, backend=backend)(built.loss)
    try:
        got = fn(*built.args)
    except PerSampleError as err:
        bug = _listed(KNOWN_BUGS, case, err)
        if bug is not None:
            pytest.xfail(f"known engine bug: {bug[4]}")
        built.module.load_state_dict(state)
        if vmap_grad_works(built):
            raise AssertionError(f"{case.id}: refused although vmap(grad) succeeds: "
                                 f"{type(err).__name__}: {err}") from err
        row = _listed(REFUSED, case)
        assert row is not None, f"{case.id}: undocumented refusal {type(err).__name__}: {err}"
        assert isinstance(err, row[2]), f"{case.id}: refused with {type(err).__name__}, documented {row[2]}: {err}"
        return None
    built.module.load_state_dict(state)
    ref = reference_per_sample(built.loss, params, built.args, built.in_dims)
    assert set(got) == set(ref), f"{case.id}: names {sorted(got)} != {sorted(ref)}"
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, **TOL, msg=lambda m, n=name: f"{case.id} {n}: {m}")
    return got


@pytest.mark.parametrize("case", CASES)
def test_module_db_eager(case):
    check(case)


# ---------------------------------------------------------------- modules module_db leaves out


@pytest.mark.parametrize("mode, padding_idx, weights, by_freq", [
    ("sum", None, False, False), ("mean", None, False, False), ("max", None, False, False),
    ("sum", 0, True, False), ("mean", 0, False, True), ("max", 0, False, False), ("sum", None, False, True),
], ids=lambda v: str(v))
def test_embedding_bag(mode, padding_idx, weights, by_freq):
    """nn.EmbeddingBag on a 2-D input: one bag per sample (rules/embedding_bag.py)."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(7, 4, mode=mode, padding_idx=padding_idx, scale_grad_by_freq=by_freq).double()
    head = nn.Linear(4, 2).double()
    model = nn.ModuleDict({"bag": bag, "head": head})
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 7, (4, 6), generator=g)
    idx[1, :3] = idx[1, 3]  # repeated ids within a sample (the frequency scale counts them per sample)
    psw = torch.rand(4, 6, generator=g, dtype=torch.float64)

    def loss(idx, psw):
        out = bag(idx, per_sample_weights=psw if weights else None)
        return head(out).pow(2).sum()

    got = psg.per_sample(model, backend="eager")(loss)(idx, psw)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (idx, psw))
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert ref["bag.weight"].abs().sum() > 0
    if not weights:
        return
    norms = psg.per_sample(model, reduce=psg.norms(), backend="eager")(loss)(idx, psw)
    expected = torch.cat([r.flatten(1) for r in ref.values()], 1).norm(dim=1)
    torch.testing.assert_close(norms, expected, **TOL)


def test_conv_circular_after_another_layer():
    """A circular-padded conv after another layer (the retrace differentiates the functional copy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Conv1d(3, 2, 3, padding=1, padding_mode="circular"))
    model.double()

    def loss(x):
        return model(x).pow(2).sum()

    x = torch.randn(3, 2, 5, dtype=torch.float64)
    got = psg.per_sample(model, backend="eager")(loss)(x)
    ref = reference_per_sample(loss, dict(model.named_parameters()), (x,))
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, **TOL)


@pytest.mark.inductor
@pytest.mark.parametrize("case_id", ["nn.Conv2d-0-default-train", "nn.TransformerEncoderLayer-0-relu_activation-train"])
def test_module_db_inductor(case_id):
    case = next(p.values[0] for p in CASES if p.id == case_id)
    check(case, backend="inductor")


def test_attention_across_the_batch_dimension_is_refused():
    """Found by the sweep: with in_dims=1 on a batch_first MultiheadAttention, dim 1 is the sequence, so attention
    mixes the 'samples'. The old deny-list analysis returned wrong gradients here; the allow-list refuses it."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 2, batch_first=True).double()

    def loss(x):
        return mha(x, x, x, need_weights=False)[0].pow(2).sum()

    with pytest.raises(SampleMixingError):
        psg.per_sample(mha, in_dims=1, backend="eager")(loss)(torch.randn(2, 3, 4, dtype=torch.float64))
