"""A DP step as a transaction: its update, its accounting and its noise generator's advance happen together, or
nothing of the step happens.

``Snapshot.take`` runs after the step's checks and before anything changes. It copies what a step may write:
the trained parameters, the optimizer's state (tensors copied, other values kept), the model's buffers and the
state of every generator the noise may draw from (the step's ``generator=``, else torch's global CPU generator
and the parameters' CUDA generators). If the step then raises anywhere (an out-of-memory error in the middle of
the update, the compile at the end of the first step, an interrupt), ``Snapshot.restore`` writes all of it back
in place, since the compiled program holds the very tensors, and drops optimizer state the step created. The
step counts nothing: the accountant records only the noise of completed steps, which is the noise that reached
the parameters.

The copy costs the memory of the parameters, the optimizer state and the buffers, and one pass over them per
step; ``transactional=False`` skips it, and then a step that fails after its noise was drawn is counted (the
noise may have reached some parameters) and leaves the parameters as the failure left them. Noise from
``secure_rng=True`` (``os.urandom``) is not restored: a failed step's draw was never released, and the next
step draws fresh noise. Under ``torch.distributed`` the transaction is each rank's own: a failure on one rank
leaves the others to time out in their collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


def _generator_states(generator: torch.Generator | None, params: list[torch.Tensor]) -> list[tuple]:
    """``(generator, state)`` for every generator the step's noise may advance."""
    if generator is not None:
        return [(generator, generator.get_state())]
    states: list[tuple] = [(torch.default_generator, torch.default_generator.get_state())]
    for index in sorted({p.device.index or 0 for p in params if p.device.type == "cuda"}):
        cuda = torch.cuda.default_generators[index]
        states.append((cuda, cuda.get_state()))
    return states


@dataclass
class Snapshot:
    params: list[tuple[torch.Tensor, torch.Tensor]]  # (live, copy)
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    optimizer: torch.optim.Optimizer
    optimizer_state: dict  # param -> {key: copy or value}
    generators: list[tuple]
    step_fields: tuple = ()  # the step's own fields a failed step must not change (``of_step``)

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
             generator: torch.Generator | None) -> Snapshot:
        with torch.no_grad():
            copies = [(p, p.detach().clone()) for p in params]
            buffers = [(b, b.clone()) for b in model.buffers()]
            state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                     for p, s in optimizer.state.items()}
        return cls(copies, buffers, optimizer, state, _generator_states(generator, params))

    @classmethod
    def of_step(cls, step) -> Snapshot | None:
        """What a failed call of a ``DPStep`` must restore; None where the step is not transactional."""
        if not step.transactional:
            return None
        snapshot = cls.take(step.model, step.optimizer, step.binding.params, step.noise.generator)
        snapshot.step_fields = (step.state_ready, step.last_batch_size, step.last_norms)
        return snapshot

    def restore_step(self, step) -> None:
        """``restore``, and the step's own fields; nothing of the failed call is released."""
        self.restore()
        step.state_ready, step.last_batch_size, step.last_norms = self.step_fields
        step.released_config = None

    def restore(self) -> None:
        """Everything as ``take`` found it, in place."""
        with torch.no_grad():
            for live, copy in self.params + self.buffers:
                live.copy_(copy)
            for p in list(self.optimizer.state):
                if p not in self.optimizer_state:  # created by the failed step (the first step's lazy state)
                    del self.optimizer.state[p]
            for p, saved in self.optimizer_state.items():
                live = self.optimizer.state[p]
                for key in list(live):
                    if key not in saved:
                        del live[key]
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and isinstance(live.get(key), torch.Tensor) \
                            and live[key].shape == value.shape:
                        live[key].copy_(value)
                    else:
                        live[key] = value
        for generator, state in self.generators:
            generator.set_state(state)
