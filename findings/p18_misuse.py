import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, IterableDataset
import compiled_psg as psg
torch.manual_seed(0)
def model(): return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
data = TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
def tryit(label, fn):
    try:
        fn(); print(f"[{label}] no error")
    except psg.PerSampleError as e:
        print(f"[{label}] OURS {type(e).__name__}: {str(e)[:110]}")
    except Exception as e:
        print(f"[{label}] RAW {type(e).__name__}: {str(e)[:150]}")
class It(IterableDataset):
    def __iter__(self): return iter([(torch.randn(4), 0)] * 8)
m = model()
tryit("make_private IterableDataset", lambda: psg.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(It(), batch_size=4), lambda x, y: F.cross_entropy(m(x), y), noise_multiplier=1.0, backend="eager"))
m2 = model(); other = nn.Linear(2, 2)
tryit("optimizer over other params", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m2(x), y), m2, torch.optim.SGD(other.parameters(), lr=0.1), backend="eager"))
m3 = model()
tryit("sample_rate > 1", lambda: psg.make_private(m3, torch.optim.SGD(m3.parameters(), lr=0.1), DataLoader(data, batch_size=8), lambda x, y: F.cross_entropy(m3(x), y), noise_multiplier=1.0, sample_rate=2.0, backend="eager"))
tryit("noise 0 in make_private", lambda: psg.make_private(m3, torch.optim.SGD(m3.parameters(), lr=0.1), DataLoader(data, batch_size=8), lambda x, y: F.cross_entropy(m3(x), y), noise_multiplier=0.0, backend="eager"))
tryit("max_grad_norm=None make_private", lambda: psg.make_private(m3, torch.optim.SGD(m3.parameters(), lr=0.1), DataLoader(data, batch_size=8), lambda x, y: F.cross_entropy(m3(x), y), noise_multiplier=1.0, max_grad_norm=None, backend="eager"))
tryit("target_epsilon negative", lambda: psg.make_private(m3, torch.optim.SGD(m3.parameters(), lr=0.1), DataLoader(data, batch_size=8), lambda x, y: F.cross_entropy(m3(x), y), target_epsilon=-1, epochs=1, backend="eager"))
tryit("target_delta 0", lambda: psg.make_private(m3, torch.optim.SGD(m3.parameters(), lr=0.1), DataLoader(data, batch_size=8), lambda x, y: F.cross_entropy(m3(x), y), target_epsilon=1.0, target_delta=0.0, epochs=1, backend="eager"))
tryit("accountant bogus", lambda: psg.make_private(m3, torch.optim.SGD(m3.parameters(), lr=0.1), DataLoader(data, batch_size=8), lambda x, y: F.cross_entropy(m3(x), y), noise_multiplier=1.0, accountant="xx", backend="eager"))
tryit("clipping bogus", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), clipping="foo", max_grad_norm=1.0, backend="eager"))
tryit("expected_batch_size 0", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), expected_batch_size=0, backend="eager"))
tryit("per_layer bounds len mismatch", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), clipping="per_layer", max_grad_norm=[1.0, 2.0], backend="eager"))
tryit("max_grad_norm nan", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), max_grad_norm=float("nan"), backend="eager"))
tryit("noise nan", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=float("nan"), backend="eager"))
tryit("noise inf", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), max_grad_norm=1.0, noise_multiplier=float("inf"), backend="eager"))
tryit("expected nan", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), expected_batch_size=float("nan"), backend="eager"))
tryit("automatic_gamma inf", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), clipping="automatic", max_grad_norm=1.0, automatic_gamma=float("inf"), backend="eager"))
tryit("unclipped_num_std nan", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), clipping="adaptive", max_grad_norm=1.0, noise_multiplier=1.0, unclipped_num_std=float("nan"), backend="eager"))
tryit("clip_sum(nan)", lambda: psg.clip_sum(float("nan")))
tryit("clip_sum(inf) noise", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), reduce=psg.clip_sum(float("inf")), noise_multiplier=1.0, backend="eager"))
tryit("max_clipbound inf, min nan", lambda: psg.compile_step(lambda x, y: F.cross_entropy(m3(x), y), m3, torch.optim.SGD(m3.parameters(), lr=0.1), clipping="adaptive", max_grad_norm=1.0, min_clipbound=float("nan"), backend="eager"))
