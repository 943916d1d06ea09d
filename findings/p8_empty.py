import copy, torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
for label, kw in [("flat", dict(max_grad_norm=0.3)), ("per_layer", dict(clipping="per_layer", max_grad_norm=[0.1, 0.2, 0.3, 0.4])),
                  ("automatic", dict(clipping="automatic", max_grad_norm=0.5)),
                  ("adaptive", dict(clipping="adaptive", max_grad_norm=0.3, unclipped_num_std=2.0))]:
  for micro in (None, 2):
    for order in ("empty first", "empty later"):
        m = copy.deepcopy(model)
        st = psg.compile_step(lambda x, y: F.cross_entropy(m(x), y), m, torch.optim.SGD(m.parameters(), lr=1.0),
                              noise_multiplier=0.5, expected_batch_size=4, backend="eager", max_physical_batch_size=micro,
                              generator=torch.Generator().manual_seed(1), **kw)
        seq = [0, 5, 3] if order == "empty first" else [5, 3, 0, 4]
        try:
            for B in seq:
                before = [p.detach().clone() for p in m.parameters()]
                g = torch.Generator().manual_seed(1); g.set_state(st.generator.get_state())
                st(torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 3, (B,)))
                if B == 0:
                    std = st.last_config.noise_std
                    expect = [torch.randn(p.shape, generator=g, dtype=torch.float64) * std / 4 for p in m.parameters()]
                    err = max((b - p - e).abs().max().item() for b, p, e in zip(before, m.parameters(), expect))
            print(f"[{label} micro={micro} {order}] empty-batch update vs noise/E err {err:.3g}, steps {st.steps_taken}")
        except Exception as e:
            print(f"[{label} micro={micro} {order}] {type(e).__name__}: {str(e)[:250]}")
