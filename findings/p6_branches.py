import math, operator, torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
ce = lambda x, y: F.cross_entropy(m(x), y)
def match_stmt(x, y):
    match len(x):
        case 1: return 2 * ce(x, y)
        case _: return ce(x, y)
def dict_lookup(x, y):
    return ce(x, y) * {1: 2.0}.get(len(x), 1.0)
def range_in(x, y):
    return ce(x, y) * (2.0 if len(x) in range(1, 2) else 1.0)
def min_shape(x, y):
    return ce(x, y) * min(x.shape)
def sorted_shape(x, y):
    return ce(x, y) * sorted(x.shape)[0]
def op_eq(x, y):
    return ce(x, y) * (2.0 if operator.eq(len(x), 1) else 1.0)
def isclose(x, y):
    return ce(x, y) * (2.0 if math.isclose(len(x), 1) else 1.0)
def numel_div(x, y):
    return ce(x, y) * (2.0 if x.numel() // x.shape[1] == 1 else 1.0)
def check_ge2(x, y):
    torch._check(x.shape[0] >= 2)
    return ce(x, y)
def sym_max_branch(x, y):
    return ce(x, y) * (2.0 if max(len(x), 2) == 2 else 1.0)
def str_len(x, y):
    return ce(x, y) * len(str(len(x)))
def bool_tensor_size(x, y):
    return ce(x, y) * torch.tensor(x.shape).prod().to(torch.float64)
def shape_tuple_eq(x, y):
    return ce(x, y) * (2.0 if tuple(x.shape)[:1] == (1,) else 1.0)
def expand_as_branch(x, y):
    return ce(x, y) * (2.0 if x.expand(len(x), 4).shape[0] != 1 else 1.0)
def chunk_count(x, y):
    return sum(ce(c, yc) for c, yc in zip(x.chunk(2), y.chunk(2)))
def split_count(x, y):
    return sum(ce(c, yc) for c, yc in zip(x.split(2), y.split(2)))
def unbind_sum(x, y):
    return sum(F.cross_entropy(m(r[None]), yr[None]) for r, yr in zip(x.unbind(0), y.unbind(0)))
def enumerate_rows(x, y):
    return sum(F.cross_entropy(m(x[i:i+1]), y[i:i+1]) for i in range(len(x)))
for name, f in list(globals().items()):
    if callable(f) and getattr(f, "__module__", None) == "__main__" and name not in ("check", "ce") and not isinstance(f, type):
        check(name, f, m, (x, y))
