import copy, torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
from tests.reference import reference_per_sample, ref_clip_sum
exec(open("p5_reduce.py").read().split("def loss_tied")[0])
def loss_tied(m):
    return lambda ids, y: F.cross_entropy(m(ids).flatten(0, 1), y.flatten())
torch.manual_seed(0)
C, lr, E = 0.05, 0.5, 4.0
for micro in (None, 2):
  for backend in ("eager",):
    m = Tied().double(); m0 = copy.deepcopy(m)
    st = psg.compile_step(loss_tied(m), m, torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr),
                          max_grad_norm=C, expected_batch_size=E, backend=backend, max_physical_batch_size=micro)
    errs = []
    for B in (5, 3, 1, 2):
        ids, y = torch.randint(0, 7, (B, 3)), torch.randint(0, 7, (B, 3))
        pd = {n: p for n, p in m0.named_parameters() if p.requires_grad}
        ref = ref_clip_sum(reference_per_sample(loss_tied(m0), pd, (ids, y)), C)
        with torch.no_grad():
            for n, p in pd.items(): p -= lr * ref[n] / E
        st(ids, y)
        errs.append(max((a - b).abs().max().item() for a, b in zip(m.parameters(), m0.parameters())))
    print(f"[step tied micro={micro} {backend}] {'OK' if max(errs) < 1e-12 else 'WRONG'} {errs}")
# in_dims=1 + micro
lin = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double(); lin0 = copy.deepcopy(lin)
l1 = lambda mm: (lambda x, y: ((mm(x.T) - y.T) ** 2).sum(1).mean())
st = psg.compile_step(l1(lin), lin, torch.optim.SGD(lin.parameters(), lr=lr), max_grad_norm=C, backend="eager",
                      in_dims=1, max_physical_batch_size=2)
errs = []
for B in (5, 3, 1):
    xt, yt = torch.randn(4, B, dtype=torch.float64), torch.randn(2, B, dtype=torch.float64)
    pd = dict(lin0.named_parameters())
    ref = ref_clip_sum(reference_per_sample(l1(lin0), pd, (xt, yt), 1), C)
    with torch.no_grad():
        for n, p in pd.items(): p -= lr * ref[n] / B
    try:
        st(xt, yt)
    except Exception as e:
        print("RAISE", type(e).__name__, str(e)[:300]); break
    errs.append(max((a - b).abs().max().item() for a, b in zip(lin.parameters(), lin0.parameters())))
print(f"[step in_dims=1 micro] {'OK' if errs and max(errs) < 1e-12 else 'WRONG'} {errs}")
