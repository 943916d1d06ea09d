"""PRIVACY (clip bound): the clip factor of Linear on sequences [B, T, F] uses the certified float64 ghost norm
(an upper bound of the EXACT per-sample norm, wip-adv2 #08 fix), but the clipped sum itself is the float32
book-keeping contraction sum_n f_n A_n^T X_n, whose rounding error is not covered by the certificate. With
near-repeated tokens of large activations and opposite output gradients, the float32 sum of one sample's clipped
contribution has norm up to 1.15 C (activations 1e7; 1.0002 C at 1e4): one sample moves the noiseless update by
more than the sensitivity C the noise is calibrated to. The loop (float32 autograd per sample, clipped by its own
norm) stays <= C (1 + ulps). Same for clipping="automatic"/"per_layer"/"adaptive" (same sum)."""
import torch, torch.nn as nn
import compiled_psg as psg
torch.manual_seed(0)
B, T, F_in, F_out, C = 4, 2, 8, 4, 1.0
for scale in (1e4, 1e6, 1e7):
    lin = nn.Linear(F_in, F_out, bias=False)
    base = torch.randn(B, 1, F_in) * scale
    x = torch.cat([base + torch.randn(B, 1, F_in), base], 1)  # token 1 = token 2 + O(1)
    v1 = torch.randn(B, 1, F_out) * 1e3
    v = torch.cat([v1, -v1], 1)                                # opposite output gradients
    loss = lambda x, v: (lin(x) * v).sum()  # noqa: E731
    worst = 0.0
    for k in range(B):  # sample k alone, twice (a batch of 2): the clipped sum must have norm <= 2C
        xx, vv = x[k:k + 1].repeat(2, 1, 1), v[k:k + 1].repeat(2, 1, 1)
        s = psg.per_sample(lin, backend="eager", reduce=psg.clip_sum(C))(loss)(xx, vv)["weight"]
        worst = max(worst, s.double().norm().item() / 2)
    print(f"[activations {scale:.0e}] {'OK' if worst <= C * (1 + 1e-5) else 'WRONG'}: largest clipped contribution "
          f"{worst:.6f} (bound C = {C})")
