"""A DP step as a transaction: its update, its accounting and its noise generator's advance happen together, or
nothing of the step happens.

``Snapshot.of_step`` runs after the step's checks and before anything changes. It copies the model's buffers (the
loss may write them), the state of every generator the step may draw from (the step's ``generator=``, and
torch's global CPU generator and the parameters' CUDA generators, which the model's dropout draws from) and the
step's own fields. The parameters, their
``.grad`` (a failed step's noisy gradient must not stay readable while its noise is drawn again) and the
optimizer's state are copied only where a step writes them in Python: the eager update (the first step, an
empty batch, an update that could not be captured) calls ``cover_update`` just before ``optimizer.step()``, after
the per-sample graph has freed its activations. The fused program writes nothing of the user's: it returns the
new values, and ``fuse.commit`` writes them in one call after it has run whole, so a failure inside it leaves
parameters and state as they were and no copy of them is needed, at the step's peak or anywhere. The commit is
the point of no return: from just before its one call, a failure (an interrupt after it) counts the step and
restores nothing, so its noise is never drawn again. Counting is the step's own (``DPStep._count_release``):
``steps_taken`` and every accountant listening (``PrivateTraining``) record the step together, on the step's
success or at its failure after the commit, never from a caller after it returns.

If the step raises anywhere (a refused batch, an out-of-memory error in the program, the compile at the end of
the first step, an interrupt), ``Snapshot.restore`` writes back what it holds, in place, since the compiled
program holds the very tensors, and drops optimizer state the step created. The step counts nothing: the
accountant records only the noise of completed steps, which is the noise that reached the parameters.

Two exceptions keep a failed step's noise from being drawn again:

- An eager update whose ``optimizer.step()`` runs code of the user's (step hooks, the optimizer's or torch's
  global ones; a ``step`` that is not torch's own: a subclass's, another library's) shows the noisy gradient and
  the updated parameters to that code. From just before that call (``before_optimizer_step``) the step is
  released: a failure still restores the parameters, ``.grad``, the optimizer's state and the buffers (the
  training goes on from before the call), but the step is counted and no generator is set back. The fused program
  runs no code of the user's: its update reaches the user only through the commit.
- A generator is set back only where nothing else drew from it since the step's own draws: another step's draw of
  released noise from a shared generator (torch's global one, in another thread; a user's generator given to two
  steps) is never rewound (``_generators.Rewind``). The step's own draws are then skipped; they were never
  released.

``transactional=False`` skips the copies: a step that fails after its noise was drawn is then counted (the noise
may have reached some parameters) and leaves the parameters as the failure left them. Noise from
``secure_rng=True`` (``os.urandom``) is not restored: a failed step's draw was never released, and the next
step draws fresh noise. Under ``torch.distributed`` the transaction is each rank's own: a failure on one rank
leaves the others to time out in their collective.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from .._generators import Rewind


def _generators(generator: torch.Generator | None, params: list[torch.Tensor]) -> list[torch.Generator]:
    """Every generator the step may advance: its noise's, and torch's global ones, which the model's own random
    ops (dropout) draw from whatever ``generator`` is."""
    generators = [] if generator is None else [generator]
    generators.append(torch.default_generator)
    for index in sorted({p.device.index or 0 for p in params if p.device.type == "cuda"}):
        generators.append(torch.cuda.default_generators[index])
    return generators


def runs_user_code(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` may run code of the user's, which could read the noisy ``.grad`` or the
    updated parameters: step hooks (the optimizer's or torch's global ones), a ``step`` set on the instance, a
    ``step`` that is not torch's own (a subclass's, another library's), or a setting of a type of the user's
    (``lr=LR(0.1)`` with ``class LR(float)``: torch's step computes ``-lr`` after updating the first parameters, and
    ``LR.__neg__`` runs there; numpy's float64 counts too, which costs a failed step its rollback only)."""
    from .update_graph import has_step_hooks, raw_step

    if has_step_hooks(optimizer) or "step" in vars(optimizer):
        return True
    if not getattr(raw_step(optimizer), "__module__", "").startswith("torch."):
        return True
    return any(not _plain(value) for group in optimizer.param_groups for key, value in group.items()
               if key != "params")


_PLAIN_TYPES = (int, float, bool, str, type(None), torch.Tensor, torch.dtype, torch.device)


def _plain(value) -> bool:
    """A setting whose operations run no code of the user's: exactly one of torch's or Python's own types (not a
    subclass, whose methods are the user's), or a tuple or list of such (Adam's betas)."""
    if type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    return type(value) in _PLAIN_TYPES


def _copied(value):
    """A copy of an optimizer setting that a failed update may change in place (a tensor, a list of floats)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return copy.deepcopy(value) if isinstance(value, (list, dict, tuple)) else value


@dataclass
class Snapshot:
    buffers: list[tuple[torch.Tensor, torch.Tensor]]  # (live, copy)
    optimizer: torch.optim.Optimizer
    generators: Rewind
    had_state: frozenset[int]  # ids of the parameters that had optimizer state: a failed step drops the others'
    params: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (live, copy), from ``cover_update``
    # from ``cover_update``: which tensor each parameter's .grad was, and a copy of every gradient buffer (theirs
    # and the step's own): a failed step's noisy gradient must not stay readable once its noise may be drawn again
    grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
    grad_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    optimizer_state: dict | None = None  # param -> {key: copy or value}, from ``cover_update``
    param_groups: list[dict] | None = None  # each group's settings but its parameters, from ``cover_update``
    step_fields: tuple = ()  # the step's own fields a failed step must not change (``of_step``)
    # False from the fused program's commit on: the update may be in the parameters, with no copy to undo it
    restorable: bool = True
    # True from the moment code of the user's may see the noisy gradient or the update (``before_optimizer_step``):
    # the step is released, counted even if it fails, and its generators are not set back
    released: bool = False

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
             generator: torch.Generator | None, drawn: collections.Counter | None = None) -> Snapshot:
        """What a step may change before its update: buffers, generators and which tensor each ``.grad`` is (the
        fused path installs the step's gradient buffers before its program; ``cover_update`` adds the rest).
        ``drawn``: the tally of the step's own noise draws (``NoiseSource.drawn``)."""
        with torch.no_grad():
            buffers = [(b, b.clone()) for b in model.buffers()]
        return cls(buffers, optimizer, Rewind(_generators(generator, params), drawn),
                   frozenset(id(p) for p in optimizer.state), grads=[(p, p.grad) for p in params])

    def drawing(self):
        """Around each part of the step that draws from a generator (``_generators.Rewind.drawing``)."""
        return self.generators.drawing()

    def before_optimizer_step(self) -> None:
        """Just before ``optimizer.step()`` of an update in Python: where it runs code of the user's
        (``runs_user_code``), the step is released from here on."""
        if runs_user_code(self.optimizer):
            self.released = True

    def cover_update(self, binding) -> None:
        """Copy the trained parameters, their ``.grad``, the step's own ``.grad`` buffers (``binding.dot_grads``,
        which the next step installs as ``.grad``) and the optimizer's state, just before an update in Python
        writes them."""
        if self.params is not None:
            return
        params = binding.params
        with torch.no_grad():
            self.params = [(p, p.detach().clone()) for p in params]
            if self.grads is None:
                self.grads = [(p, p.grad) for p in params]
            buffers = {id(t): t for t in [*(p.grad for p in params if p.grad is not None), *binding.dot_grads]}
            self.grad_values = [(t, t.clone()) for t in buffers.values()]
            self.optimizer_state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                                    for p, s in self.optimizer.state.items()}
            # settings the optimizer keeps beside its parameters (Prodigy's d and k, a learning rate it adapts)
            self.param_groups = [{k: _copied(v) for k, v in group.items() if k != "params"}
                                 for group in self.optimizer.param_groups]

    @classmethod
    def of_step(cls, step) -> Snapshot | None:
        """What a failed call of a ``DPStep`` must restore; None where the step is not transactional."""
        if not step.transactional:
            return None
        snapshot = cls.take(step.model, step.optimizer, step.binding.params, step.noise.generator, step.noise.drawn)
        snapshot.step_fields = (step.state_ready, step.last_batch_size, step.last_norms)
        return snapshot

    def restore_step(self, step) -> None:
        """``restore``, and the step's own fields."""
        self.restore()
        step.state_ready, step.last_batch_size, step.last_norms = self.step_fields
        step.released_config = None

    def restore(self) -> None:
        """Everything as ``take`` (and ``cover_update``) found it, in place; the generators where nothing else drew
        from them since (``_generators.Rewind``), and not once the step is ``released``."""
        with torch.no_grad():
            for live, copy in self.buffers + (self.params or []) + (self.grad_values or []):
                live.copy_(copy)
            for p, grad in self.grads or []:
                p.grad = grad
            for p in list(self.optimizer.state):
                if id(p) not in self.had_state:  # created by the failed step (the first step's lazy state)
                    del self.optimizer.state[p]
            for p, saved in (self.optimizer_state or {}).items():
                _put_back(self.optimizer.state[p], saved)
            for group, saved in zip(self.optimizer.param_groups, self.param_groups or [], strict=False):
                _put_back(group, saved, keep=("params",))
        if not self.released:
            self.generators.restore()


def _put_back(live: dict, saved: dict, keep: tuple = ()) -> None:
    """Make ``live`` hold ``saved`` again (keys in ``keep`` aside): a tensor of the same shape in place (the
    compiled program holds it), anything else by assignment; keys the failed step added are dropped."""
    for key in [k for k in live if k not in keep and k not in saved]:
        del live[key]
    for key, value in saved.items():
        if isinstance(value, torch.Tensor) and isinstance(live.get(key), torch.Tensor) \
                and live[key].shape == value.shape:
            live[key].copy_(value)
        else:
            live[key] = value
