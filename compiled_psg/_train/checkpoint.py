"""Saving and resuming a DP step: its settings, ``steps_taken``, the model, the optimizer and the noise generator."""

from __future__ import annotations

from .._errors import DPConfigError


def step_state(step) -> dict:
    """What resuming the training needs: the settings (``max_grad_norm``, ``noise_multiplier``,
    ``expected_batch_size``), ``steps_taken``, the model's and the optimizer's ``state_dict`` and the noise
    generator's state (when ``generator=`` was given). Tensors are shared with the live objects, as in
    ``nn.Module.state_dict``: ``torch.save`` it. Torch's global generator is the user's to save
    (``torch.get_rng_state``), and ``secure_rng=True`` (``os.urandom``) cannot be resumed by design: its
    draws are not reproducible."""
    return {"config": {"max_grad_norm": step.max_grad_norm, "noise_multiplier": step.noise_multiplier,
                       "expected_batch_size": step.expected_batch_size},
            "steps_taken": step.steps_taken,
            "model": step.model.state_dict(),
            "optimizer": step.optimizer.state_dict(),
            "generator": None if step.noise.generator is None else step.noise.generator.get_state()}


def load_step_state(step, state: dict) -> None:
    """Restore what ``state_dict`` saved, into a step built the same way (same model class, optimizer and
    arguments). The next step continues exactly where the saved run stopped (same noise with a seeded
    ``generator``)."""
    if (state["generator"] is not None) != (step.noise.generator is not None):
        raise DPConfigError("the saved step and this one disagree on generator=: build the step with a "
                            "torch.Generator exactly when the saved one had one")
    step.config = step.config.replace(**state["config"])
    step.model.load_state_dict(state["model"])
    step.optimizer.load_state_dict(state["optimizer"])
    if step.noise.generator is not None:
        step.noise.generator.set_state(state["generator"])
    step.steps_taken = int(state["steps_taken"])
    # The first step runs eagerly so that the optimizer creates its state, which the program reads. A run
    # that has stepped has that state (none at all for a stateless optimizer, plain SGD): resume on the
    # program, as the uninterrupted run would.
    step.state_ready = step.steps_taken > 0 or bool(step.optimizer.state)
