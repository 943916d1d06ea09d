"""PRIVACY accounting: the first DP step applies the eager noisy update, THEN builds and compiles the fused
program (the first call carries the compile time). If that compile fails (CompileError) or is interrupted
(Ctrl-C during a long Inductor compile), the exception leaves PrivateTraining.step before the accountant counts
the step: the parameters moved by a noisy update that epsilon() never sees (history [], epsilon 0).
The failure is simulated by making the compile raise CompileError, the library's own error for it."""
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import compiled_psg as psg
from compiled_psg._compile import run as run_mod

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
private = psg.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5), DataLoader(data, batch_size=16),
                           lambda x, y: F.cross_entropy(model(x), y), noise_multiplier=1.0, backend="eager")
before = [p.detach().clone() for p in model.parameters()]
original = run_mod.CompiledPerSample.prepare
def failing_prepare(self, *a, **k):
    raise psg.CompileError("simulated: Inductor failed on the step program")
run_mod.CompiledPerSample.prepare = failing_prepare
x, y = next(iter(private.data_loader))
try:
    private.step(x, y)
except psg.PerSampleError as e:
    print(f"step raised {type(e).__name__}: {e}")
finally:
    run_mod.CompiledPerSample.prepare = original
moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), before))
print(f"[update applied, accounted?] parameters moved {moved:.3g}; accountant history {private.accountant.history}, "
      f"epsilon {private.epsilon():.3g} -> {'OK' if private.steps == 1 else 'WRONG (unaccounted noisy update)'}")
