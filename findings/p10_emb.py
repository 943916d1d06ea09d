import torch, torch.nn as nn
import compiled_psg as psg
from tests.reference import reference_per_sample, ref_clip_sum
torch.manual_seed(0)
B, T, D, C = 4, 2, 8, 1.0
for mag in (1e4, 1e6):
    emb = nn.Embedding(5, D)
    ids = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]])
    v1 = torch.randn(B, 1, D) * mag
    v = torch.cat([v1 + torch.randn(B, 1, D) * 1e-2 * (mag / 1e4), -v1], 1)
    loss = lambda i, v: (emb(i) * v).sum()
    worst, worst_loop = 0.0, 0.0
    for k in range(B):
        ii, vv = ids[k:k+1].repeat(2, 1), v[k:k+1].repeat(2, 1, 1)
        s = psg.per_sample(emb, backend="eager", reduce=psg.clip_sum(C))(loss)(ii, vv)["weight"]
        worst = max(worst, s.double().norm().item() / 2)
        r = ref_clip_sum(reference_per_sample(loss, dict(emb.named_parameters()), (ii, vv)), C)["weight"]
        worst_loop = max(worst_loop, r.double().norm().item() / 2)
    print(f"[embedding grads {mag:.0e}] ours {worst:.6f} loop {worst_loop:.6f} bound {C}")
