"""``OptimizerBinding``: which tensors a step trains, their names in the model, and what it leaves in ``p.grad``.

The optimizer's parameters that require grad are the trained ones; each must be a parameter of the model (the
per-sample graph names its gradients by the model's parameter names). The binding is refreshed before every
step and changes when the optimizer's parameters or their ``requires_grad`` do (``add_param_group``, freezing):
the step then drops its programs, which were built for the old set.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .._errors import DPConfigError
from . import update_graph


class OptimizerBinding:
    """``params[j]`` (the optimizer's ``trained[j]``-th flat parameter) is the model's ``names[j]``;
    ``dot_grads[j]`` is the tensor installed as its ``.grad`` (written with the applied gradient, as
    ``optimizer.step()`` leaves it)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self._dot_grads_by_param: dict[int, torch.Tensor] = {}
        self._key: tuple = ()
        self.trained: list[int] = []
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self.dot_grads: list[torch.Tensor] = []
        self.refresh()

    def refresh(self) -> bool:
        """Re-read the optimizer's parameters; True when the trained set changed since the last call."""
        flat = update_graph.flat_params(self.optimizer)
        # the model's parameters too: one replaced (model.fc.weight = nn.Parameter(...)) leaves the optimizer
        # holding a tensor the model no longer reads, which the check below refuses
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # dtype and device too: model.double() or .to(device) changes them in place, under the optimizer's state
        # and its memory: one tied to another through .data after the step was built shares it
        key = (tuple((id(p), p.requires_grad, p.dtype, p.device, _address(p)) for p in flat),
               tuple(id(p) for _, p in named))
        if key == self._key:
            return False
        refuse_shared_parameters(self.model)
        trainable = {id(p): n for n, p in named}
        trained = [j for j, p in enumerate(flat) if p.requires_grad]
        params = [flat[j] for j in trained]
        strangers = [tuple(p.shape) for p in params if id(p) not in trainable]
        if strangers:
            raise DPConfigError(f"the optimizer updates tensors of shapes {strangers} that are not parameters of "
                                "the model (a parameter replaced since the optimizer was built is one). Fix: build "
                                "the optimizer on model.parameters(), and a new step with it; to change a "
                                "parameter's values, write them in place (with torch.no_grad(): p.copy_(new))")
        names = [trainable[id(p)] for p in params]
        self._refuse_state_of_another_dtype(params, names)
        self.trained, self.params, self.names = trained, params, names
        for p in flat:  # a parameter frozen since: drop the .grad the step left, as zero_grad() would
            if not p.requires_grad and p.grad is not None and p.grad is self._dot_grads_by_param.get(id(p)):
                p.grad = None
        # kept per parameter across refreshes: a parameter frozen and unfrozen gets its buffer back (a new one where
        # the parameter's dtype or device changed)
        for p in params:
            buffer = self._dot_grads_by_param.get(id(p))
            if buffer is None or buffer.dtype != p.dtype or buffer.device != p.device:
                self._dot_grads_by_param[id(p)] = torch.zeros_like(p)
        self.dot_grads = [self._dot_grads_by_param[id(p)] for p in params]
        self._key = key
        return True

    def _refuse_state_of_another_dtype(self, params: list[torch.Tensor], names: list[str]) -> None:
        """The optimizer's per-parameter state (Adam's moments: tensors of the parameter's shape) has the
        parameter's dtype and device, as ``optimizer.step()`` needs; else a ``DPConfigError`` naming both, before
        anything changes (``model.double()`` after steps leaves Adam's float32 moments under float64 weights)."""
        for name, p in zip(names, params, strict=True):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and (
                        value.dtype != p.dtype or value.device != p.device):
                    raise DPConfigError(
                        f"the parameter {name} is {p.dtype} on {p.device}, but the optimizer's state for it "
                        f"({key!r}) is {value.dtype} on {value.device}: the parameters' dtype or device changed "
                        "after the optimizer took steps (model.double(), model.to(...)), and the optimizer cannot "
                        "update them with that state. No step was taken. Fix: change the model's dtype or device "
                        "before building the optimizer and the step, or build a new optimizer and step after it")

    def install(self) -> None:
        """Make every trained parameter's ``.grad`` the step's buffer (``zero_grad`` may have set it to None)."""
        for p, buffer in zip(self.params, self.dot_grads, strict=True):
            if p.grad is not buffer:
                p.grad = buffer


#: the group settings torch's optimizers pass to tensor ops as scalars of the parameters' dtype (others, such as
#: ASGD's ``t0=1e6``, are step counts compared in Python, which a float16 model may well hold)
_SCALAR_SETTINGS = ("lr", "weight_decay", "momentum", "dampening")


def check_optimizer_scalars(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before the step, a learning rate (weight decay, momentum, dampening) of a parameter group that its
    parameters' dtype cannot hold (``lr=1e308`` with float32 weights): torch's step would fail halfway with its
    own error ("value cannot be converted to type float without overflow")."""
    for k, group in enumerate(optimizer.param_groups):
        dtypes = [p.dtype for p in group["params"] if p.is_floating_point()]
        if not dtypes:
            continue
        largest = min(torch.finfo(d).max for d in dtypes)
        for name, value in ((n, group.get(n)) for n in _SCALAR_SETTINGS):
            if type(value) in (int, float) and math.isfinite(value) and abs(value) > largest:
                raise DPConfigError(
                    f"param_groups[{k}][{name!r}] of the {type(optimizer).__name__} is {value:g}, beyond the "
                    f"largest {min(dtypes, key=lambda d: torch.finfo(d).max)} number ({largest:g}) its parameters "
                    f"hold: the optimizer's step cannot use it. Fix: set {name} within the parameters' range")


def refuse_shared_parameters(model: nn.Module) -> None:
    """Two trained parameters in one memory (``b.weight.data = a.weight.data``, a parameter made of a view of
    another's ``.data``): torch's optimizer applies both updates to it in turn, while the fused program writes
    each parameter's new value computed from the old memory, and one write overwrites the other (red team M: 0.046
    off torch's update after one step; red team O: tied after the step was built, checked where the binding
    refreshes). One Parameter object used twice (``b.weight = a.weight``) is one parameter, with the gradient of
    both uses."""
    from .._api import memories_overlap, memory_span

    seen: list[tuple[str, tuple]] = []
    for name, p in model.named_parameters():
        span = memory_span(p) if p.requires_grad else None
        if span is None:
            continue
        other = next((n for n, s in seen if memories_overlap(span, s)), None)
        if other is not None:
            raise DPConfigError(
                f"the parameters {other!r} and {name!r} share memory (tied through .data, or one a view of the "
                "other's data): a DP step updates each on its own, so one update would overwrite the other. Fix: "
                f"tie them as one parameter (set the module attribute of {name!r} to the Parameter {other!r}), "
                "whose gradient sums both uses, or give each its own memory (.clone())")
        seen.append((name, span))


def _address(p: torch.Tensor) -> int | None:
    """Where ``p``'s data starts; None for a tensor without storage of its own (a sharded DTensor)."""
    try:
        return p.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
