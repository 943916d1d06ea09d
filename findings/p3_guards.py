import torch, torch.nn as nn, torch.nn.functional as F, traceback
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

def fresh():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()

def run(name, mutate, loss_of=lambda m: (lambda x, y: F.cross_entropy(m(x), y)), args=(x, y)):
    m = fresh()
    f = psg.per_sample(m, backend="eager")(loss_of(m))
    f(*args)
    try:
        mutate(m)
        got = f(*args)
    except psg.PerSampleError as e:
        print(f"[{name}] REFUSED {type(e).__name__}: {str(e)[:150]}"); return
    except Exception as e:
        print(f"[{name}] RAW {type(e).__name__}: {str(e)[:200]}"); return
    pd = {n: p for n, p in m.named_parameters() if p.requires_grad}
    ref = reference_per_sample(loss_of(m), pd, args)
    extra = set(got) - set(ref); missing = set(ref) - set(got)
    if missing:
        print(f"[{name}] WRONG keys: missing {missing}, extra {extra}"); return
    err = max((got[n] - ref[n]).abs().max().item() for n in ref)
    shape_bad = [n for n in ref if got[n].shape != ref[n].shape]
    print(f"[{name}] {'OK' if err < 1e-9 and not shape_bad else 'WRONG'} err {err:.3g} extra keys {extra} shape_bad {shape_bad}")

def swap_act(m): m[1] = nn.ReLU()
def new_param(m): m[0].weight = nn.Parameter(torch.randn(8, 4, dtype=torch.float64))
def data_assign(m): m[0].weight.data = torch.randn(8, 4, dtype=torch.float64)
def data_shape(m):
    m[0].weight.data = torch.randn(6, 4, dtype=torch.float64); m[0].bias.data = torch.randn(6, dtype=torch.float64)
    m[2].weight.data = torch.randn(3, 6, dtype=torch.float64)
def freeze(m): m[0].weight.requires_grad_(False)
def to_float(m): m.float()
def add_module_hook(m): m[1].register_forward_hook(lambda mod, i, o: o * 3)
def add_pre_hook(m): m[0].register_forward_pre_hook(lambda mod, i: (i[0] * 2,))
def set_attr(m): m[1].forward = lambda t: torch.sin(t)
def param_inplace(m):
    with torch.no_grad(): m[0].weight.mul_(3)
def eval_mode(m): m.eval()
def replace_seq(m): m.append(nn.Tanh())
def del_bias(m): m[2].bias = None
def register_param(m): m[2].register_parameter("bias", nn.Parameter(torch.ones(3, dtype=torch.float64)))
for name, mut in [("swap activation module", swap_act), ("new Parameter object", new_param),
                  (".data assigned", data_assign), (".data assigned new shape", data_shape),
                  ("requires_grad_(False)", freeze), ("model.float()", to_float), ("forward hook added", add_module_hook),
                  ("forward pre hook", add_pre_hook), ("instance forward attr", set_attr),
                  ("param in-place", param_inplace), ("append module", replace_seq), ("bias=None", del_bias),
                  ("re-register bias", register_param)]:
    run(name, mut)
