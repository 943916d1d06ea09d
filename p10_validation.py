"""Settings validation: bad values must raise DPConfigError (a ValueError) naming the argument, before anything changes."""
from common import *
from torch.utils.data import DataLoader, TensorDataset
def mk():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)); o = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, o, (lambda x, y: F.cross_entropy(m(x), y))
def expect_refusal(name, fn, arg=None):
    def t():
        m, o, lf = mk()
        before = [p.clone() for p in m.parameters()]
        try:
            r = fn(m, o, lf)
        except psg.DPConfigError as e:
            named = arg is None or arg in str(e)
            same = all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
            report(f"refused: {name}", named and same, f"DPConfigError{'' if named else ' (does not name ' + arg + ')'}: {str(e)[:110]}")
            return
        except psg.PerSampleError as e:
            report(f"refused: {name}", True, f"{type(e).__name__}: {str(e)[:110]}")
            return
        except Exception as e:
            report(f"refused: {name}", False, f"RAW {type(e).__name__}: {str(e)[:150]}")
            return
        report(f"refused: {name}", False, f"accepted -> {r!r}"[:200])
    run(name, t)
X, Y = data(B=6, dtype=torch.float32)
def cs(**kw):
    def f(m, o, lf):
        base = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=6, backend="eager")
        base.update(kw)
        s = psg.compile_step(lf, m, o, **base); s(X, Y); s(X, Y)
        return f"stepped; params finite {all(torch.isfinite(p).all() for p in m.parameters())}"
    return f
CASES = [
    ("noise_multiplier=-1", cs(noise_multiplier=-1.0), "noise_multiplier"),
    ("noise_multiplier=nan", cs(noise_multiplier=float("nan")), "noise_multiplier"),
    ("noise_multiplier=inf", cs(noise_multiplier=math.inf), "noise_multiplier"),
    ("noise_multiplier='1'", cs(noise_multiplier="1"), "noise_multiplier"),
    ("noise_multiplier=True", cs(noise_multiplier=True), "noise_multiplier"),
    ("noise_multiplier=tensor(1.)", cs(noise_multiplier=torch.tensor(1.0)), "noise_multiplier"),
    ("max_grad_norm=0", cs(max_grad_norm=0.0), "max_grad_norm"),
    ("max_grad_norm=-1", cs(max_grad_norm=-1.0), "max_grad_norm"),
    ("max_grad_norm=nan", cs(max_grad_norm=float("nan")), "max_grad_norm"),
    ("max_grad_norm=inf with noise", cs(max_grad_norm=math.inf), "max_grad_norm"),
    ("max_grad_norm='1'", cs(max_grad_norm="1"), "max_grad_norm"),
    ("max_grad_norm=True", cs(max_grad_norm=True), "max_grad_norm"),
    ("max_grad_norm=1e30 (noise overflow f32)", cs(max_grad_norm=1e38, noise_multiplier=10.0), "max_grad_norm"),
    ("noise without bound", cs(max_grad_norm=None), "max_grad_norm"),
    ("expected_batch_size=0", cs(expected_batch_size=0), "expected_batch_size"),
    ("expected_batch_size=nan", cs(expected_batch_size=float("nan")), "expected_batch_size"),
    ("expected_batch_size=inf", cs(expected_batch_size=math.inf), "expected_batch_size"),
    ("expected_batch_size='6'", cs(expected_batch_size="6"), "expected_batch_size"),
    ("expected_batch_size=1e-320 (scale inf)", cs(expected_batch_size=1e-320), "expected_batch_size"),
    ("loss_reduction='none'", cs(loss_reduction="none"), "loss_reduction"),
    ("clipping='foo'", cs(clipping="foo"), "clipping"),
    ("per_layer 3 bounds for 4 params", cs(clipping="per_layer", max_grad_norm=[1.0, 1.0, 1.0]), "max_grad_norm"),
    ("per_layer list with flat", cs(max_grad_norm=[1.0, 1.0]), "max_grad_norm"),
    ("per_layer bound 0 in list", cs(clipping="per_layer", max_grad_norm=[1.0, 0.0, 1.0, 1.0]), "max_grad_norm"),
    ("clip_groups unknown name", cs(clipping="per_layer", max_grad_norm=[1.0, 1.0], clip_groups=[["0.weight", "0.bias"], ["2.weight", "nope"]]), "clip_groups"),
    ("clip_groups missing a param", cs(clipping="per_layer", max_grad_norm=[1.0], clip_groups=[["0.weight", "0.bias", "2.weight"]]), "clip_groups"),
    ("clip_groups as a string", cs(clipping="per_layer", max_grad_norm=1.0, clip_groups="0.weight"), "clip_groups"),
    ("automatic_gamma=0", cs(clipping="automatic", automatic_gamma=0.0), "automatic_gamma"),
    ("automatic_gamma=nan", cs(clipping="automatic", automatic_gamma=float("nan")), "automatic_gamma"),
    ("automatic_gamma='x'", cs(clipping="automatic", automatic_gamma="x"), "automatic_gamma"),
    ("adaptive no unclipped_num_std", cs(clipping="adaptive"), "unclipped_num_std"),
    ("adaptive sigma_b too small", cs(clipping="adaptive", unclipped_num_std=0.4), "unclipped_num_std"),
    ("adaptive quantile 1.5", cs(clipping="adaptive", unclipped_num_std=2.0, target_unclipped_quantile=1.5), "target_unclipped_quantile"),
    ("adaptive quantile nan", cs(clipping="adaptive", unclipped_num_std=2.0, target_unclipped_quantile=float("nan")), "target_unclipped_quantile"),
    ("adaptive quantile '0.5'", cs(clipping="adaptive", unclipped_num_std=2.0, target_unclipped_quantile="0.5"), "target_unclipped_quantile"),
    ("adaptive lr nan", cs(clipping="adaptive", unclipped_num_std=2.0, clipbound_learning_rate=float("nan")), "clipbound_learning_rate"),
    ("adaptive sigma_b nan", cs(clipping="adaptive", unclipped_num_std=float("nan")), "unclipped_num_std"),
    ("adaptive sigma_b inf", cs(clipping="adaptive", unclipped_num_std=math.inf), "unclipped_num_std"),
    ("adaptive min>max", cs(clipping="adaptive", unclipped_num_std=2.0, min_clipbound=2.0, max_clipbound=1.0), "clipbound"),
    ("adaptive max_clipbound nan", cs(clipping="adaptive", unclipped_num_std=2.0, max_clipbound=float("nan")), "clipbound"),
    ("adaptive min_clipbound None", cs(clipping="adaptive", unclipped_num_std=2.0, min_clipbound=None), "clipbound"),
    ("memory_budget=-1", cs(memory_budget=-1), "memory_budget"),
    ("memory_budget=nan", cs(memory_budget=float("nan")), "memory_budget"),
    ("public_buffers='x'", cs(public_buffers="x"), "public_buffers"),
    ("public_buffers unknown", cs(public_buffers=["x"]), "public_buffers"),
    ("public_buffers names a parameter", cs(public_buffers=["0.weight"]), "public_buffers"),
    ("max_physical_batch_size=0", cs(max_physical_batch_size=0), "max_physical_batch_size"),
    ("max_physical_batch_size=2.5", cs(max_physical_batch_size=2.5), "max_physical_batch_size"),
    ("max_physical_batch_size=True", cs(max_physical_batch_size=True), "max_physical_batch_size"),
    ("backend='foo'", cs(backend="foo"), "backend"),
    ("generator=int", cs(generator=5), "generator"),
    ("secure_rng='no'", cs(secure_rng="no"), "secure_rng"),
    ("custom reduce + micro", cs(max_grad_norm=None, noise_multiplier=0.0, reduce=psg.custom(lambda g: g) if hasattr(psg, "custom") else None, max_physical_batch_size=2), "max_physical_batch_size"),
    ("reduce=norms", cs(reduce=psg.norms()), "reduce"),
    ("clip_sum contradicts max_grad_norm", cs(reduce=psg.clip_sum(2.0), max_grad_norm=1.0), "max_grad_norm"),
    ("optimizer=None", lambda m, o, lf: psg.compile_step(lf, m, None, backend="eager"), "optimizer"),
    ("model not a module", lambda m, o, lf: psg.compile_step(lf, lf, o, backend="eager"), "model"),
    ("optimizer over other tensors", lambda m, o, lf: psg.compile_step(lf, m, torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), backend="eager", max_grad_norm=1.0, noise_multiplier=1.0)(X, Y), None),
]
for name, f, arg in CASES:
    expect_refusal(name, f, arg)

# assignment between steps
def assign(attr, value, argname):
    def f(m, o, lf):
        s = psg.compile_step(lf, m, o, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=6, backend="eager")
        s(X, Y); setattr(s, attr, value); s(X, Y)
        return f"accepted {attr}={value!r}; step.{attr}={getattr(s, attr)!r}"
    expect_refusal(f"assign step.{attr}={value!r}", f, argname)
for attr, value in [("noise_multiplier", -1.0), ("noise_multiplier", float("nan")), ("max_grad_norm", 0.0), ("max_grad_norm", None),
                    ("expected_batch_size", -3), ("max_physical_batch_size", 0), ("loss_reduction", "sum")]:
    assign(attr, value, None)

# make_private / accountant / calibrate / schedulers
def mp(**kw):
    def f(m, o, lf):
        train = TensorDataset(*data(B=60, dtype=torch.float32))
        base = dict(noise_multiplier=1.0, backend="eager"); base.update(kw)
        loader = base.pop("loader", DataLoader(train, batch_size=6))
        p = psg.make_private(m, o, loader, lf, **base)
        return p
    return f
MP = [
    ("both sigma and target", mp(target_epsilon=2.0, epochs=1), None),
    ("target without epochs", mp(noise_multiplier=None, target_epsilon=2.0), "epochs"),
    ("epochs=0", mp(noise_multiplier=None, target_epsilon=2.0, epochs=0), "epochs"),
    ("epochs=1.5", mp(noise_multiplier=None, target_epsilon=2.0, epochs=1.5), "epochs"),
    ("target_epsilon=inf", mp(noise_multiplier=None, target_epsilon=math.inf, epochs=1), "target_epsilon"),
    ("target_epsilon=nan", mp(noise_multiplier=None, target_epsilon=float("nan"), epochs=1), "target_epsilon"),
    ("target_epsilon=1e6", mp(noise_multiplier=None, target_epsilon=1e6, epochs=1), "target_epsilon"),
    ("target_delta=0", mp(target_delta=0.0), "delta"),
    ("target_delta=nan", mp(target_delta=float("nan")), "delta"),
    ("sample_rate=0", mp(sample_rate=0.0), "sample_rate"),
    ("sample_rate=1.5", mp(sample_rate=1.5), "sample_rate"),
    ("sample_rate=nan", mp(sample_rate=float("nan")), "sample_rate"),
    ("accountant='foo'", mp(accountant="foo"), "accountant"),
    ("loader a list", mp(loader=[(X, Y)]), "data_loader"),
    ("empty dataset", mp(loader=DataLoader(TensorDataset(X[:0], Y[:0]), batch_size=6)), None),
    ("iterable dataset", mp(loader=DataLoader(type("It", (torch.utils.data.IterableDataset,), {"__iter__": lambda s: iter([(X[0], Y[0])])})(), batch_size=2)), None),
    ("max_grad_norm=None", mp(max_grad_norm=None), "max_grad_norm"),
]
for name, f, arg in MP:
    expect_refusal("make_private " + name, f, arg)
def pt_assign(attr, value):
    def f(m, o, lf):
        p = mp()(m, o, lf); setattr(p, attr, value); return f"accepted; {attr}={getattr(p, attr)!r}"
    expect_refusal(f"PrivateTraining.{attr}={value!r}", f, None)
pt_assign("noise_multiplier", 0.0); pt_assign("noise_multiplier", -1.0); pt_assign("max_grad_norm", None); pt_assign("noise_multiplier", "2")
for name, f in [("calibrate target 0", lambda *a: psg.calibrate_noise(0.0, 1e-5, 0.1, 10)),
                ("calibrate steps 0", lambda *a: psg.calibrate_noise(1.0, 1e-5, 0.1, 0)),
                ("calibrate q 2", lambda *a: psg.calibrate_noise(1.0, 1e-5, 2.0, 10)),
                ("calibrate mechanism", lambda *a: psg.calibrate_noise(1.0, 1e-5, 0.1, 10, "gdp")),
                ("Accountant('x')", lambda *a: psg.Accountant("x")),
                ("Accountant.step sigma nan then epsilon", lambda *a: (lambda A: (A.step(float("nan"), 0.1), A.epsilon(1e-5))[1])(psg.Accountant())),
                ("Accountant.step sigma -1 then epsilon", lambda *a: (lambda A: (A.step(-1.0, 0.1), A.epsilon(1e-5))[1])(psg.Accountant())),
                ("Accountant.step steps=-5 then epsilon", lambda *a: (lambda A: (A.step(1.0, 0.1, 3), A.step(1.0, 0.1, -5), A.epsilon(1e-5), A.steps)[2:])(psg.Accountant())),
                ("Accountant.epsilon delta 0", lambda *a: (lambda A: (A.step(1.0, 0.1), A.epsilon(0.0))[1])(psg.Accountant())),
                ("ExponentialNoise gamma nan", lambda m, o, lf: psg.ExponentialNoise(mp()(m, o, lf), gamma=float("nan"))),
                ("ExponentialNoise gamma 0", lambda m, o, lf: psg.ExponentialNoise(mp()(m, o, lf), gamma=0.0)),
                ("StepNoise step_size 0", lambda m, o, lf: psg.StepNoise(mp()(m, o, lf), step_size=0)),
                ("LambdaNoise -> nan", lambda m, o, lf: psg.LambdaNoise(mp()(m, o, lf), lambda e: float("nan"))),
                ("LambdaNoise -> inf", lambda m, o, lf: psg.LambdaNoise(mp()(m, o, lf), lambda e: math.inf)),
                ("scheduler on a model", lambda m, o, lf: psg.ExponentialNoise(m, gamma=0.9)),
                ]:
    expect_refusal(name, f, None)
summary()
