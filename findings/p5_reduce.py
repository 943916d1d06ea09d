import torch, torch.nn as nn, torch.nn.functional as F, itertools
import compiled_psg as psg
from tests.reference import reference_per_sample, ref_norms, ref_clip_sum, ref_sum_squares, ref_variance, ref_gram

class Tied(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(7, 4); s.lin = nn.Linear(4, 4); s.head = nn.Linear(4, 7, bias=False)
        s.head.weight = s.emb.weight  # tied
        s.unused = nn.Linear(3, 3); s.frozen = nn.Linear(4, 4); s.frozen.requires_grad_(False)
    def forward(s, ids):
        h = s.emb(ids)                       # [B, T, 4]
        h = torch.tanh(s.lin(h)) + s.lin(h)  # lin used twice
        h = s.frozen(h)
        return s.head(h)                     # [B, T, 7]

def loss_tied(m):
    return lambda ids, y: F.cross_entropy(m(ids).flatten(0, 1), y.flatten(), reduction="sum")

REDS = {"norms": (psg.norms(), lambda g: ref_norms(g)),
        "norms_pp": (psg.norms(per_parameter=True), lambda g: ref_norms(g, True)),
        "clip_sum": (psg.clip_sum(0.5), lambda g: ref_clip_sum(g, 0.5)),
        "sum_squares": (psg.sum_squares(), ref_sum_squares),
        "variance": (psg.variance(), ref_variance),
        "gram": (psg.gram(), ref_gram),
        "custom": (psg.custom(lambda n, g: g.abs().sum(0)), lambda g: {n: v.abs().sum(0) for n, v in g.items()}),
        "none": (None, lambda g: g)}

def cmp(a, b):
    if isinstance(b, dict):
        if set(a) != set(b): return f"keys {sorted(set(a) ^ set(b))}"
        return max(cmp(a[k], b[k]) for k in b)
    if a.shape != b.shape: return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item() if a.numel() else 0.0

def sweep(label, model, loss, args, in_dims=0):
    pd = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref = reference_per_sample(loss, pd, args, in_dims)
    for rn, (red, rf) in REDS.items():
        try:
            got = psg.per_sample(model, in_dims=in_dims, reduce=red, backend="eager")(loss)(*args)
            e = cmp(got, rf(ref))
            tag = "OK" if isinstance(e, float) and e < 1e-9 else "WRONG"
            if tag != "OK": print(f"[{label} {rn}] {tag} {e}")
        except psg.PerSampleError as ex:
            print(f"[{label} {rn}] REFUSED {type(ex).__name__}: {str(ex)[:150]}")
        except Exception as ex:
            print(f"[{label} {rn}] RAW {type(ex).__name__}: {str(ex)[:200]}")
    print(f"[{label}] done")

torch.manual_seed(0)
m = Tied().double()
for B in (1, 2, 5):
    ids, y = torch.randint(0, 7, (B, 3)), torch.randint(0, 7, (B, 3))
    sweep(f"tied B={B}", m, loss_tied(m), (ids, y))
# in_dims=1, non-contiguous
lin = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
xt = torch.randn(4, 5, dtype=torch.float64)        # batch on dim 1
yt = torch.randn(2, 5, dtype=torch.float64)
l1 = lambda x, y: ((lin(x.T) - y.T) ** 2).sum()
sweep("in_dims=1", lin, l1, (xt, yt), in_dims=1)
xnc = torch.randn(5, 8, dtype=torch.float64)[:, ::2]   # non-contiguous
ync = torch.randn(2, 5, dtype=torch.float64).T
l2 = lambda x, y: ((lin(x) - y) ** 2).mean()
sweep("non-contiguous", lin, l2, (xnc, ync))
sweep("in_dims (0,None)", lin, lambda x, t: ((lin(x) - t) ** 2).sum(), (xnc, torch.randn(2, dtype=torch.float64)), in_dims=(0, None))
sweep("expanded input", lin, l2, (torch.randn(1, 4, dtype=torch.float64).expand(5, 4), ync))
