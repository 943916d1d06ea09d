import torch, torch.nn as nn
import compiled_psg as psg
from tests.reference import reference_per_sample
torch.manual_seed(0)
B, T, F_in, F_out, C = 4, 2, 8, 4, 1.0
import sys; dtype, scale = torch.float32, float(sys.argv[1])
lin = nn.Linear(F_in, F_out, bias=False).to(dtype)
base = torch.randn(B, 1, F_in, dtype=dtype) * scale
x = torch.cat([base + torch.randn(B, 1, F_in, dtype=dtype), base], 1)
v1 = torch.randn(B, 1, F_out, dtype=dtype) * 1e3
v = torch.cat([v1, -v1], 1)
loss = lambda x, v: (lin(x) * v).sum()
for clip in ("flat", "automatic"):
    for k in range(B):
        xx, vv = x[k:k+1].expand(2, -1, -1).contiguous(), v[k:k+1].expand(2, -1, -1).contiguous()
        s = psg.per_sample(lin, backend="eager", reduce=psg.clip_sum(C))(loss)(xx, vv)["weight"] if clip == "flat" else None
        before = lin.weight.detach().clone()
        st = psg.compile_step(loss, lin, torch.optim.SGD(lin.parameters(), lr=1.0), max_grad_norm=C, clipping=clip,
                              noise_multiplier=0.0, loss_reduction="sum", backend="eager")
        st(xx, vv)
        upd = (before.double() - lin.weight.detach().double())
        with torch.no_grad(): lin.weight.copy_(before)
        print(clip, k, "update norm", f"{upd.norm().item():.9f}", "clip_sum norm", None if s is None else f"{s.double().norm().item():.9f}",
              "last_norms", st.last_norms.tolist())
