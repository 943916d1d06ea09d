import torch, torch.nn as nn, torch.nn.functional as F
exec(open("p5_reduce.py").read().split("torch.manual_seed(0)\nm = Tied()")[0])
torch.manual_seed(0)
lin = nn.Linear(4, 4).double(); head = nn.Linear(4, 3).double()
mods = nn.ModuleDict({"lin": lin, "head": head})
def loss(x, s, y):
    a = lin(x)                  # [B, 4]
    b = lin(s).mean(1)          # [B, T, 4] -> [B, 4]
    c = F.linear(s, lin.weight.T).sum(1)  # transpose use
    return F.cross_entropy(head(torch.tanh(a + b + c)), y)
for B in (1, 2, 5):
    x, s, y = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, 3, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    sweep(f"weight on [B,F], [B,T,F] and transposed, B={B}", mods, loss, (x, s, y))
conv = nn.Conv1d(2, 2, 3, padding=1).double()
def loss2(x, y):
    h = conv(x)                        # conv
    h2 = F.conv1d(h, conv.weight.flip(-1), conv.bias, padding=1)  # same weight flipped
    return ((h2.sum(-1) - y) ** 2).sum()
for B in (1, 3):
    sweep(f"conv weight used twice B={B}", conv, loss2, (torch.randn(B, 2, 5, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)))
