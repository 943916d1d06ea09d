import torch, torch.nn as nn, torch.nn.functional as F
from _h import check
torch.manual_seed(0)
B = 5
x = torch.randn(B, 4, dtype=torch.float64)
m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
y = torch.tensor([0, 2, 1, 2, 0]); yi = torch.tensor([0, -100, 1, 2, -100])
t = torch.softmax(torch.randn(B, 3, dtype=torch.float64), 1)
w = torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64)
cases = {
 "kl_div batchmean": (lambda x, t: F.kl_div(F.log_softmax(m(x), 1), t, reduction="batchmean"), (x, t)),
 "ce weight+ignore+smoothing": (lambda x, y: F.cross_entropy(m(x), y, weight=w, ignore_index=-100, label_smoothing=0.1), (x, yi)),
 "ce probs target + smoothing": (lambda x, t: F.cross_entropy(m(x), t, label_smoothing=0.2), (x, t)),
 "nll weight mean": (lambda x, y: F.nll_loss(F.log_softmax(m(x), 1), y, weight=w), (x, y)),
 "gaussian_nll": (lambda x, t: F.gaussian_nll_loss(m(x), t, torch.ones(B, 3, dtype=torch.float64) * 0.5), (x, t)),
 "poisson_nll": (lambda x, t: F.poisson_nll_loss(m(x), t), (x, t)),
 "huber": (lambda x, t: F.huber_loss(m(x), t, delta=0.3), (x, t)),
 "multilabel_soft_margin": (lambda x, t: F.multilabel_soft_margin_loss(m(x), (t > 0.3).double()), (x, t)),
 "multi_margin": (lambda x, y: F.multi_margin_loss(m(x), y, weight=w), (x, y)),
 "cosine_embedding": (lambda x, t: F.cosine_embedding_loss(m(x), t, torch.ones(B, dtype=torch.float64)), (x, t)),
 "margin_ranking": (lambda x, t: F.margin_ranking_loss(m(x)[:, 0], t[:, 0], torch.ones(B, dtype=torch.float64)), (x, t)),
 "triplet": (lambda x, t: F.triplet_margin_loss(m(x), t, t.flip(1)), (x, t)),
 "bce_with_logits pos_weight": (lambda x, t: F.binary_cross_entropy_with_logits(m(x), t, pos_weight=w), (x, t)),
 "soft_margin": (lambda x, t: F.soft_margin_loss(m(x), torch.sign(t - 0.3)), (x, t)),
 "l1 + mse mix": (lambda x, t: F.l1_loss(m(x), t) + F.mse_loss(m(x), t, reduction="sum") / x.shape[0], (x, t)),
}
for name, (f, args) in cases.items():
    check(name, f, m, args)
