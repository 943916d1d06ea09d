"""A stateful property test of the DP training API (hypothesis ``RuleBasedStateMachine``).

The machine interleaves steps (empty batches included), steps refused before they start (autocast), steps that
fail after their update was computed (the eager first step's ``optimizer.step()``, or the fused program run whole
but not committed), steps interrupted after the fused program's commit (counted, kept), changes of the
noise multiplier and the clipping bound, and saving and loading into a fresh ``PrivateTraining``, on runs with
and without micro-batches. After every rule:

- epsilon equals an independent ``dp_accounting`` RDP composition of the noise multipliers of the completed steps;
- the parameters equal a plain DP-SGD reference (the per-sample gradients by the loop, clipped, summed, the
  step's own noise added, divided by the expected batch size, SGD with momentum), fed the noise the step drew;
- the model's buffer, which no step may write, holds its initial value.

Bounded in CI; ``-m deep`` runs more and longer examples.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.utils.data import DataLoader, TensorDataset

from compiled_psg import DPConfigError, make_private
from compiled_psg._train import paths
from compiled_psg._train.accounting import _quiet_absl
from compiled_psg._train.eager import NoiseSource

N, BATCH, LR, MOMENTUM, DELTA = 12, 4, 0.1, 0.9, 1e-5
SAMPLE_RATE = BATCH / N
EXPECTED = SAMPLE_RATE * N
_g = torch.Generator().manual_seed(0)
X, Y = torch.randn(N, 3, generator=_g, dtype=torch.float64), torch.randint(0, 2, (N,), generator=_g)


class _Injected(Exception):
    pass


def _epsilon(sigmas: list[float]) -> float:
    """RDP epsilon of the Poisson-sampled Gaussian steps, composed here from dp_accounting alone."""
    if not sigmas:
        return 0.0
    import dp_accounting
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant()
    for sigma in sigmas:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(SAMPLE_RATE, dp_accounting.GaussianDpEvent(sigma)))
    with _quiet_absl():  # its orders that do not converge at small alpha are logged, and excluded
        return float(accountant.get_epsilon(DELTA))


class DPTraining(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.noises: list[list[torch.Tensor]] = []

    def _build(self, micro_batches: int | None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        model.register_buffer("constant", torch.arange(3.0, dtype=torch.float64))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        loader = DataLoader(TensorDataset(X, Y), batch_size=BATCH)
        private = make_private(model, optimizer, loader, lambda x, y: F.cross_entropy(model(x), y),
                               noise_multiplier=1.0, max_grad_norm=1.0, backend="eager",
                               generator=torch.Generator().manual_seed(7), max_physical_batch_size=micro_batches)
        return model, private

    @initialize(micro_batches=st.sampled_from([None, 2]))
    def start(self, micro_batches):
        self.micro_batches = micro_batches
        self.model, self.private = self._build(micro_batches)
        self.reference = [p.detach().clone() for p in self.model.parameters()]
        self.momentum: list[torch.Tensor] | None = None
        self.sigmas: list[float] = []
        self.sigma, self.bound = 1.0, 1.0
        real = NoiseSource.draw_many
        noises = self.noises

        def recording(source, config, likes):
            drawn = real(source, config, likes)
            noises.append([n.clone() for n in drawn])
            return drawn

        self._real_draw = real
        self._real_commit = paths.commit
        NoiseSource.draw_many = recording

    def teardown(self):
        if hasattr(self, "_real_draw"):
            NoiseSource.draw_many = self._real_draw

    # ----- the reference ---------------------------------------------------------------------------------
    def _reference_step(self, index: list[int], noise: list[torch.Tensor] | None) -> None:
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        with torch.no_grad():
            for p, r in zip(model.parameters(), self.reference, strict=True):
                p.copy_(r)
        total = [torch.zeros_like(r) for r in self.reference]
        for i in index:
            grads = torch.autograd.grad(F.cross_entropy(model(X[i:i + 1]), Y[i:i + 1]), list(model.parameters()))
            norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
            factor = torch.clamp(self.bound / norm, max=1.0)
            total = [t + factor * g for t, g in zip(total, grads, strict=True)]
        if noise is not None:
            total = [t + n for t, n in zip(total, noise, strict=True)]
        grads = [t / EXPECTED for t in total]
        if self.momentum is None:
            self.momentum = [g.clone() for g in grads]
        else:
            self.momentum = [MOMENTUM * m + g for m, g in zip(self.momentum, grads, strict=True)]
        self.reference = [r - LR * m for r, m in zip(self.reference, self.momentum, strict=True)]

    # ----- rules ------------------------------------------------------------------------------------------
    @rule(index=st.lists(st.integers(0, N - 1), min_size=0, max_size=BATCH))
    def step(self, index):
        self.noises.clear()
        self.private.step(X[index], Y[index])
        self._reference_step(index, self.noises[-1] if self.noises else None)
        self.sigmas.append(self.sigma)

    @rule(index=st.lists(st.integers(0, N - 1), min_size=0, max_size=BATCH))
    def step_failing_after_its_update(self, index):
        """The update is computed (the eager update on a first step or an empty batch has written it, with torch's
        ``optimizer.step()``, which runs no code of the user's; the fused program has run whole), then the step
        raises before committing it: nothing may remain."""
        real_update = paths.eager_update

        def update(*args, **kwargs):
            real_update(*args, **kwargs)
            raise _Injected("the eager update")

        def commit(*args, **kwargs):
            raise _Injected("the fused program's commit")

        paths.eager_update, paths.commit = update, commit
        try:
            with pytest.raises(_Injected):
                self.private.step(X[index], Y[index])
        finally:
            paths.eager_update, paths.commit = real_update, self._real_commit

    @rule(index=st.lists(st.integers(0, N - 1), min_size=0, max_size=BATCH))
    def step_interrupted_after_its_commit(self, index):
        """An interrupt just after the fused program's commit: the update is in the parameters, so the step
        counts (and its noise is not drawn again). On the eager path, which has no commit, the step completes."""
        real = self._real_commit

        def commit(*args, **kwargs):
            real(*args, **kwargs)
            raise _Injected("after the commit")

        self.noises.clear()
        paths.commit = commit
        try:
            self.private.step(X[index], Y[index])
        except _Injected:
            pass
        finally:
            paths.commit = real
        self._reference_step(index, self.noises[-1] if self.noises else None)
        self.sigmas.append(self.sigma)

    @rule(index=st.lists(st.integers(0, N - 1), min_size=1, max_size=BATCH))
    def step_refused(self, index):
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(DPConfigError, match="autocast"):
            self.private.step(X[index], Y[index])

    @rule(sigma=st.sampled_from([0.7, 1.0, 2.5]))
    def set_noise(self, sigma):
        self.private.noise_multiplier = sigma
        self.sigma = sigma

    @rule(bound=st.sampled_from([0.05, 1.0, 10.0]))
    def set_bound(self, bound):
        self.private.max_grad_norm = bound
        self.bound = bound

    @precondition(lambda self: self.sigmas)
    @rule()
    def save_and_load(self):
        buffer = io.BytesIO()
        torch.save(self.private.state_dict(), buffer)
        buffer.seek(0)
        self.model, self.private = self._build(self.micro_batches)
        self.private.load_state_dict(torch.load(buffer, weights_only=False))
        self.private.noise_multiplier, self.private.max_grad_norm = self.sigma, self.bound

    # ----- invariants -------------------------------------------------------------------------------------
    @invariant()
    def parameters_equal_the_reference(self):
        if not hasattr(self, "private"):
            return
        for p, r in zip(self.model.parameters(), self.reference, strict=True):
            torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)

    @invariant()
    def epsilon_composes_the_completed_steps(self):
        if not hasattr(self, "private"):
            return
        assert self.private.dp_step.steps_taken == len(self.sigmas)
        got, want = self.private.epsilon(DELTA), _epsilon(self.sigmas)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)

    @invariant()
    def no_step_writes_the_buffer(self):
        if hasattr(self, "model"):
            assert torch.equal(self.model.constant, torch.arange(3.0, dtype=torch.float64))


@pytest.mark.parametrize("micro_batches", [None, pytest.param(2, marks=pytest.mark.long)])
def test_every_rule_in_one_fixed_run(micro_batches):
    """Each rule at least once, in an order that crosses each with the fused and the eager path; the invariants
    after every rule, as the machine checks them."""
    machine = DPTraining()
    machine.start(micro_batches)
    checks = (machine.parameters_equal_the_reference, machine.epsilon_composes_the_completed_steps,
              machine.no_step_writes_the_buffer)
    try:
        for rule_, args in [(machine.step_failing_after_its_update, ([0, 1],)), (machine.step, ([0, 1, 2],)),
                            (machine.step_failing_after_its_update, ([3, 4, 5],)), (machine.step, ([3, 4, 5],)),
                            (machine.step_interrupted_after_its_commit, ([4, 5],)),
                            (machine.step_refused, ([6],)), (machine.set_noise, (2.5,)), (machine.step, ([],)),
                            (machine.step_failing_after_its_update, ([],)), (machine.set_bound, (0.05,)),
                            (machine.step, ([7, 8, 9, 9],)), (machine.save_and_load, ()),
                            (machine.step_interrupted_after_its_commit, ([9],)),
                            (machine.step_failing_after_its_update, ([10],)), (machine.step, ([10, 11],))]:
            rule_(*args)
            for check in checks:
                check()
        assert machine.private.dp_step.steps_taken == 7
    finally:
        machine.teardown()


_COMMON = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
TestDPTraining = pytest.mark.long(DPTraining.TestCase)
TestDPTraining.settings = settings(max_examples=6, stateful_step_count=10, **_COMMON)


class DeepDPTraining(DPTraining):
    pass


TestDeepDPTraining = pytest.mark.deep(DeepDPTraining.TestCase)
TestDeepDPTraining.settings = settings(max_examples=60, stateful_step_count=25, **_COMMON)
