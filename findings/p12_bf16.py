import copy, torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
def data(n):
    g = torch.Generator().manual_seed(n); return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)
for label in ("bf16 params", "autocast"):
  for clip, kw in [("flat", dict(max_grad_norm=0.3)), ("per_layer", dict(clipping="per_layer", max_grad_norm=0.3)),
                   ("automatic", dict(clipping="automatic", max_grad_norm=0.3)),
                   ("adaptive", dict(clipping="adaptive", max_grad_norm=0.3, unclipped_num_std=2.0))]:
    res = []
    for micro in (None, 3):
        m = copy.deepcopy(base)
        if label == "bf16 params": m = m.to(torch.bfloat16)
        def loss(x, y, m=m):
            if label == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = m(x)
                return F.cross_entropy(out.float(), y)
            return F.cross_entropy(m(x.to(torch.bfloat16)).float(), y)
        st = psg.compile_step(loss, m, torch.optim.SGD(m.parameters(), lr=0.5), noise_multiplier=0.5,
                              expected_batch_size=8, backend="eager", generator=torch.Generator().manual_seed(2),
                              max_physical_batch_size=micro, **kw)
        try:
            norms = []
            for n in (8, 7, 1, 5):
                st(*data(n)); norms.append(st.last_norms.clone())
            res.append((m, norms))
        except Exception as e:
            print(f"[{label} {clip} micro={micro}] {type(e).__name__}: {str(e)[:200]}"); break
    if len(res) == 2:
        err = max((p.float() - q.float()).abs().max().item() for p, q in zip(res[0][0].parameters(), res[1][0].parameters()))
        nerr = max((a - b).abs().max().item() for a, b in zip(res[0][1], res[1][1]))
        print(f"[{label} {clip}] whole vs micro param err {err:.3g}, norms err {nerr:.3g}, norms dtype {res[0][1][0].dtype}")
