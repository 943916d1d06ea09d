import torch, torch.nn as nn
import compiled_psg as psg
torch.manual_seed(0)
B, T, F_in, F_out, C = 4, 2, 8, 4, 1.0
for dtype, scale in ((torch.float32, 1e4), (torch.float64, 1e8)):
    lin = nn.Linear(F_in, F_out, bias=False).to(dtype)
    base = torch.randn(B, 1, F_in, dtype=dtype) * scale
    x = torch.cat([base + torch.randn(B, 1, F_in, dtype=dtype), base], 1)
    v1 = torch.randn(B, 1, F_out, dtype=dtype) * (1e3 if dtype == torch.float32 else 1)
    v = torch.cat([v1, -v1], 1)
    loss = lambda x, v: (lin(x) * v).sum()
    for clip in ("automatic", "flat", "per_layer", "adaptive"):
        kw = dict(unclipped_num_std=1.0) if clip == "adaptive" else {}
        for k in range(B):  # remove-one: each sample's contribution alone
            before = lin.weight.detach().clone()
            st = psg.compile_step(loss, lin, torch.optim.SGD(lin.parameters(), lr=1.0), max_grad_norm=C, clipping=clip,
                                  noise_multiplier=0.0, loss_reduction="sum", backend="eager", **kw)
            st(x[k:k+1].expand(2, -1, -1).contiguous(), v[k:k+1].expand(2, -1, -1).contiguous())
            n = (lin.weight.detach() - before).norm().item()
            with torch.no_grad(): lin.weight.copy_(before)
            if n > 2 * C * (1 + 1e-5):
                print(f"[{dtype} {clip}] sample {k} twice: update norm {n:.4g} > 2C")
        print(f"[{dtype} {clip}] done")
