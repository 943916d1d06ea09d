import sys, traceback, torch
sys.path.insert(0, __import__('os').path.dirname(__file__) + '/..')
import compiled_psg as psg
from tests.reference import reference_per_sample

def check(name, loss, params, args, in_dims=0, backend="eager", ref_loss=None, **kw):
    try:
        f = psg.per_sample(params, in_dims=in_dims, backend=backend, **kw)(loss)
        got = f(*args)
    except psg.PerSampleError as e:
        print(f"[{name}] REFUSED {type(e).__name__}: {str(e)[:200]}")
        return None
    except Exception as e:
        print(f"[{name}] RAW {type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(limit=-3)
        return None
    pd = {n: p for n, p in (params.named_parameters() if isinstance(params, torch.nn.Module) else params.items()) if p.requires_grad}
    try:
        ref = reference_per_sample(ref_loss or loss, pd, args, in_dims)
    except Exception as e:
        print(f"[{name}] library returned a result; the per-sample loop itself FAILS: {type(e).__name__}: {str(e)[:150]}")
        return got
    err = max((got[n] - ref[n]).abs().max().item() for n in ref)
    scale = max(ref[n].abs().max().item() for n in ref)
    tag = "OK" if err <= 1e-6 * max(1, scale) else "WRONG"
    print(f"[{name}] {tag} max err {err:.3g} (scale {scale:.3g})")
    return err
