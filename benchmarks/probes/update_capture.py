"""``python -m benchmarks.probes.update_capture --models resnet50_gn vit --optimizers sgd adamw``: the capture
of the optimizer's update (``compiled_psg/_train/update_graph.py``), a part of ``compile_step``'s first call.

For each scaled CPU model of ``benchmarks/scale_models.py`` and each optimizer (after one eager step, so that its
state exists), side by side in one process, medians of ``--repeats`` captures after one warm-up capture of each:

- ``by kind``: ``capture_update``, which traces one parameter of each kind (group, shape, dtype, state) and copies
  its graph for the others (``_by_representatives``);
- ``whole``: the trace of the whole step (``_whole``), what every optimizer got before, and what one outside
  ``update_graph.PER_PARAMETER`` gets.

Each capture is a Dynamo trace and an AOT autograd trace of ``optimizer.step``, a few seconds to a minute; no
kernel is compiled. ``kinds`` counts the parameters traced by kind.
"""

from __future__ import annotations

import argparse

import torch

from compiled_psg._train import update_graph

from ..scale_models import build_scale_model
from ..timing import interleaved_medians

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
}


def measure(model_name: str, optimizer: str, repeats: int, tiny: bool) -> dict:
    model, _, _ = build_scale_model(model_name, scaled=True, device=torch.device("cpu"), tiny=tiny)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OPTIMIZERS[optimizer](params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    trained = list(range(len(params)))
    kinds = update_graph._kinds(opt, trained)
    nodes = {}

    def capture(fn, name):
        def call():
            nodes[name] = len(fn(opt, trained, torch.float32).gm.graph.nodes)
        return call

    seconds = interleaved_medians({"by kind": capture(update_graph.capture_update, "by kind"),
                                   "whole": capture(update_graph._whole, "whole")}, repeats, warm_up=1)
    return {"model": model_name, "optimizer": optimizer, "parameters": len(params),
            "kinds": len(set(kinds)) if kinds is not None else len(params), "nodes": nodes["whole"],
            "by_kind_s": round(seconds["by kind"], 2), "whole_s": round(seconds["whole"], 2),
            "ratio": round(seconds["by kind"] / seconds["whole"], 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.update_capture",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet50_gn", "vit"])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the models' tiny configs (checks the probe, no figures)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.repeats} captures after one "
          "warm-up capture of each")
    print("| model | optimizer | parameters | kinds | update graph nodes | by kind (s) | whole (s) | by kind / whole |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for optimizer in args.optimizers:
            r = measure(model, optimizer, args.repeats, args.tiny)
            print(f"| {r['model']} | {r['optimizer']} | {r['parameters']} | {r['kinds']} | {r['nodes']} | "
                  f"{r['by_kind_s']:.2f} | {r['whole_s']:.2f} | {r['ratio']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
