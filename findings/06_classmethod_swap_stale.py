"""Stale capture: a module's classmethod replaced after the capture (`M.scale = classmethod(...)`) was not checked
(global_guards._methods skipped classmethods, since each read gives a new bound method): the old graph ran,
silently. Staticmethods, properties and plain methods were already checked."""
import torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    @classmethod
    def scale(cls):
        return 2.0

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) * self.scale())


m = M().double()
loss = lambda x, y: F.cross_entropy(m(x), y)  # noqa: E731
f = psg.per_sample(m, backend="eager")(loss)
f(x, y)
M.scale = classmethod(lambda cls: 3.0)
got = f(x, y)
ref = reference_per_sample(loss, dict(m.named_parameters()), (x, y))
err = max((got[n] - ref[n]).abs().max().item() for n in ref)
print(f"[classmethod replaced after capture] {'OK' if err < 1e-9 else 'WRONG'} max err {err:.3g} "
      f"(captures {f.captures})")
