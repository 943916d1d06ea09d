import copy, torch, torch.nn as nn, torch.nn.functional as F
import compiled_psg as psg
def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
def batch(n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 6, generator=g, dtype=torch.float64) * 3, torch.randint(0, 3, (n,), generator=g)
def mk(physical, opt=torch.optim.Adam, **kw):
    m = cnn()
    st = psg.compile_step(lambda x, y: F.cross_entropy(m(x), y), m, opt(m.parameters(), lr=0.05),
                          noise_multiplier=0.7, expected_batch_size=20, backend="eager",
                          generator=torch.Generator().manual_seed(3), max_physical_batch_size=physical, **kw)
    return m, st
for label, kw in [("per_layer", dict(clipping="per_layer", max_grad_norm=[0.1, 0.2, 0.3, 0.4])),
                  ("per_layer groups", dict(clipping="per_layer", max_grad_norm=0.3, clip_groups=[["0.weight", "2.bias"], ["0.bias", "2.weight"]])),
                  ("automatic", dict(clipping="automatic", max_grad_norm=0.5)),
                  ("adaptive", dict(clipping="adaptive", max_grad_norm=0.3, unclipped_num_std=2.0)),
                  ("flat", dict(max_grad_norm=0.3))]:
    try:
        (a, sa), (b, sb) = mk(None, **kw), mk(3, **kw)
        errs = []
        for n in (7, 9, 4, 1, 5):
            la, lb = sa(*batch(n)), sb(*batch(n))
            errs.append(max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())))
            errs.append((la - lb).abs().max().item())
        print(f"[micro {label}] {'OK' if max(errs) < 1e-10 else 'WRONG'} {max(errs):.3g} bounds {sa.max_grad_norm} {sb.max_grad_norm}")
    except psg.PerSampleError as e:
        print(f"[micro {label}] REFUSED {type(e).__name__}: {str(e)[:200]}")
    except Exception as e:
        import traceback; traceback.print_exc(limit=-3)
        print(f"[micro {label}] RAW {type(e).__name__}: {str(e)[:200]}")

# resume after the program is built
for label, kw in [("flat", dict(max_grad_norm=0.3)), ("adaptive", dict(clipping="adaptive", max_grad_norm=0.3, unclipped_num_std=2.0)),
                  ("per_layer", dict(clipping="per_layer", max_grad_norm=[0.1, 0.2, 0.3, 0.4]))]:
    try:
        m, st = mk(None, **kw)
        for n in (7, 9): st(*batch(n))
        saved = copy.deepcopy(st.state_dict())
        for n in (5, 6): st(*batch(n))
        ref_after = [p.detach().clone() for p in m.parameters()]
        st.load_state_dict(saved)
        for n in (5, 6): st(*batch(n))
        err = max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref_after))
        # a fresh step loaded from the same state
        m2, st2 = mk(None, **kw); st2.load_state_dict(copy.deepcopy(saved))
        for n in (5, 6): st2(*batch(n))
        err2 = max((p - q).abs().max().item() for p, q in zip(m2.parameters(), ref_after))
        print(f"[resume {label}] {'OK' if max(err, err2) < 1e-10 else 'WRONG'} same-object {err:.3g} fresh {err2:.3g}")
    except Exception as e:
        import traceback; traceback.print_exc(limit=-3)
        print(f"[resume {label}] {type(e).__name__}: {str(e)[:200]}")
