"""``psg.explain``: the inspection report of a per-sample function, a DP step or a private training, for a batch.

It sits above the pipeline: it takes what any floor built (``_api``'s per-sample functions, ``_train``'s steps)
and hands back ``_inspect.report.Report``, which imports none of them.
"""

from __future__ import annotations

import torch

from ._api import PerSampleFunction, PerSampleGrad, batch_dims_of, no_keywords
from ._errors import BatchInputError
from ._inspect.report import Report
from ._train.private import PrivateTraining
from ._train.sharded import UnshardedCalls
from ._train.step import DPStep, contiguous_batch, refuse_ambient_autocast


def explain(fn, *args, **kwargs) -> Report:
    """The inspection report of ``fn`` (a ``@psg.per_sample`` function, a ``psg.per_sample_grad`` function, a
    ``compile_step`` DP step or what ``make_private`` returns) for these arguments (for ``per_sample_grad``, as
    it takes them: the parameter dict among them), a batch of at least one sample.

    Captures and rewrites like a call would (and caches it), runs nothing. For a DP step it is the per-sample
    graph of the step's current clipping settings, whose clip norms and clipped sums carry the per-layer choices
    (``step.graph`` is the fused program after the first step). The step of a ``fully_shard`` model gathers its
    parameters for the capture, as a step does: call ``explain`` on every rank. If the loss is refused, the
    ``SampleMixingError`` raised carries the report as ``error.report``.
    """
    if torch.is_inference_mode_enabled():  # as a call under it: the report is of the graph a call runs
        with torch.inference_mode(False):
            return explain(fn, *args, **kwargs)
    if isinstance(fn, PerSampleGrad):  # its parameter dict out of the arguments: the batch's function
        args, kwargs = fn.bind(args, kwargs), {}
        fn = fn.per_sample_function
    no_keywords(kwargs)
    if isinstance(fn, PrivateTraining):
        fn = fn.dp_step
    if isinstance(fn, DPStep):
        refuse_ambient_autocast()  # the step refuses it too: its graph would not be the step's
        args = contiguous_batch(args)  # as the step does
        fn = fn.per_sample  # a sharded step's unshards the parameters around the capture
    if not isinstance(fn, PerSampleFunction | UnshardedCalls):
        raise BatchInputError(f"psg.explain expects a function decorated with @psg.per_sample(model), one made by "
                              f"psg.per_sample_grad, a compile_step DP step or make_private's result, got "
                              f"{type(fn).__name__} {getattr(fn, '__name__', '')!s}. Fix: "
                              "explain(psg.per_sample(model)(loss_fn), *batch), decorate loss_fn with "
                              "@psg.per_sample(model), explain(psg.per_sample_grad(fn), params, *batch), or "
                              "explain(step, *batch)")
    if batch_dims_of(args, fn.in_dims)[1] == 0:
        raise BatchInputError("psg.explain got an empty batch: the graph is captured for a batch of samples. "
                              "Fix: pass a batch of one sample or more (any batch size gives the same graph)")
    entry = fn.prepare_call(*args).entry
    return Report.from_rewritten(entry.rewritten)
