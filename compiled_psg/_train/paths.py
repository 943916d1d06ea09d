"""The two ways a DP step runs a batch, as small functions of the step's parts.

- ``fused_path``: the earlier micro-batches through the compiled per-sample graph, their clipped sums added here,
  and the last micro-batch through the step program (forward, rewritten backward, clipping, noise, all-reduce and
  the optimizer's update in one program), whose new parameters and state are then committed in one call.
- ``eager_path``: the first step (optimizers create their state lazily, and the program reads it), an empty
  batch (a step of noise alone) and an update that could not be captured: the per-sample graph on every
  micro-batch, then ``eager.eager_update`` (noise, all-reduce, ``optimizer.step()`` in Python). At its end the
  program is built and compiled, so that the first call carries the compile time.

Both record on the step what it reports (``last_norms``, ``last_batch_size``) and, before the update begins,
``released_config`` (``transaction.py`` and ``DPStep._count_release`` read it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils import _pytree as pytree

from .._compile.run import CompiledGraph, failed_check_error
from .._errors import BatchInputError
from .buckets import PaddedCall, real_rows, real_size, source_row
from .config import DPConfig
from .eager import eager_update
from .fuse import StepProgram, commit
from .inputs import InputKind, StepInputs
from .results import add_into, combine_losses, split_result


def drawing(step) -> contextlib.AbstractContextManager:
    """Around a part of the step that draws from a generator (the model's dropout, the noise): a failed step sets
    a generator back only where nothing else drew from it between these parts (``transaction.Snapshot``)."""
    return contextlib.nullcontext() if step.snapshot is None else step.snapshot.drawing()


def run_per_sample(inputs: StepInputs, entry: CompiledGraph, config: DPConfig, params: dict, args: tuple,
                   size: int):
    """``(loss, per-sample losses, result)`` of the per-sample graph, fed its run-time inputs."""
    graph = entry.rewritten.graph_module.graph
    extra = sum(n.op == "placeholder" for n in graph.nodes) - len(entry.rewritten.roles)
    loss, losses, *flat = entry.run(params, args, size, inputs.reduce_inputs(config, extra))
    return loss, losses, pytree.tree_unflatten(list(flat), entry.rewritten.out_spec)


class _SameBuffers:
    """Every micro-batch's forward starts from the buffers as the step found them, so that what stays written is
    one forward's, as for the whole batch (``spectral_norm``'s power iteration runs once per step, not once per
    micro-batch). Nothing to do for one piece or a loss that writes no buffer; a transactional step already holds
    the copies (``transaction.Snapshot.buffers``)."""

    def __init__(self, step, pieces: list):
        writes = len(pieces) > 1 and any(c.entry.rewritten.captured.mutated for c in pieces)
        if not writes:
            self.saved = []
        elif step.snapshot is not None:
            self.saved = step.snapshot.buffers
        else:
            with torch.no_grad():
                self.saved = [(b, b.clone()) for b in step.model.buffers()]
        self.started = False

    def before_piece(self) -> None:
        if self.started:
            with torch.no_grad():
                for live, saved in self.saved:
                    live.copy_(saved)
        self.started = True


@contextlib.contextmanager
def _positions_from(offset: int, piece, total: int) -> Iterator[None]:
    """A failed check of the loss (a singular matrix) inside ``piece``, a micro-batch whose first sample is at
    ``offset`` of the user's batch of ``total``, names the failing samples' positions in the user's batch, and says
    that the later micro-batches' samples were not checked. A padded piece's rows past its real samples are copies
    of a real one (``buckets.source_row``): they name that sample, once."""
    size = real_size(piece)
    try:
        yield
    except BatchInputError as e:
        samples = getattr(e, "failing_samples", None)
        if not samples or (size == total and not isinstance(piece, PaddedCall)):
            raise
        own = sorted({source_row(s, size) for s in samples})
        unchecked = offset + size if offset + size < total else None
        raise failed_check_error(e.failed_check, own, offset, unchecked) from e.__cause__


def _sums_of(step, config: DPConfig, pieces: list, runner=lambda entry: entry, buffers: _SameBuffers | None = None,
             total: int | None = None):
    """The per-sample graph on each micro-batch of ``pieces`` (the first ones of a batch of ``total`` samples;
    None: all of it): their losses, norms and summed results."""
    losses, norms, partial = [], [], None
    offset = 0
    total = sum(map(real_size, pieces)) if total is None else total
    for c in pieces:
        if buffers is not None:
            buffers.before_piece()
        with _positions_from(offset, c, total), drawing(step):
            loss, per_sample, result = run_per_sample(step.inputs, runner(c.entry), config, c.params, c.args,
                                                      c.batch_size)
        offset += real_size(c)
        sums, piece_norms = split_result(result, step.binding.names, step.binding.params)
        loss, piece_norms = real_rows(c, loss, per_sample, piece_norms, config.loss_reduction)
        partial = add_into(partial, sums, step.binding.names)
        losses.append(loss)
        norms.append(piece_norms)
    return losses, norms, partial


def fused_path(step, config: DPConfig, built: tuple[StepProgram, CompiledGraph], pieces: list,
               batch_size: int) -> torch.Tensor:
    program, compiled = built
    *head, last = pieces
    buffers = _SameBuffers(step, pieces)
    losses, norms, partial = _sums_of(step, config, head, buffers=buffers, total=batch_size)
    buffers.before_piece()
    step.binding.install()
    with drawing(step):
        extra = step.inputs.for_program(config, program.inputs, batch_size, partial=partial)
        step.released_config = config
        with _positions_from(batch_size - real_size(last), last, batch_size):
            outputs = dict(zip(program.outputs, compiled.run(last.params, last.args, last.batch_size, extra),
                               strict=True))
    # the update, written into the user's tensors only now that the program has run whole (``fuse.commit``): no
    # code of the user's runs between the program and the commit
    commit([_target(step, last.params, kind, key) for kind, key in program.commits],
           [outputs[f"commit_{k}"] for k in range(len(program.commits))], step.snapshot)
    count = outputs.get("global_count")
    step.last_batch_size = batch_size if count is None else int(round(count.item()))
    loss, piece_norms = real_rows(last, outputs["loss"], outputs["per_sample_losses"], outputs.get("norms"),
                                  config.loss_reduction)
    step.last_norms = None if piece_norms is None else torch.cat([*norms, piece_norms])
    return combine_losses([*losses, loss], [real_size(c) for c in pieces], config.loss_reduction)


def _target(step, params: dict, kind: str, key: object) -> torch.Tensor:
    """The user's tensor behind a program's commit target (``fuse.StepProgram.commits``)."""
    if kind == "param":
        return params[key]
    if kind == InputKind.DOT_GRAD:
        return step.binding.dot_grads[key]
    return key  # InputKind.TENSOR: the optimizer's state tensor itself


def eager_update_of(step, config: DPConfig, grads: list[torch.Tensor], batch_size: int) -> None:
    if step.snapshot is not None:  # the update in Python writes parameters and state one by one
        step.snapshot.cover_update(step.binding)
    step.released_config = config
    before_step = None if step.snapshot is None else step.snapshot.before_optimizer_step
    with drawing(step):
        step.last_batch_size = eager_update(config, grads, batch_size, step.binding, step.noise, step.distributed,
                                            before_step)
    step.state_ready = True


def eager_path(step, config: DPConfig, pieces: list, batch_size: int, accumulate: bool) -> torch.Tensor:
    losses, norms, partial = _sums_of(step, config, pieces, step.eager_runner, _SameBuffers(step, pieces))
    step.last_norms = None if norms[0] is None else torch.cat(norms)
    eager_update_of(step, config, partial, batch_size)
    last = pieces[-1]
    if step.fused:  # build and compile the program now, so that the first call carries the compile time
        built = step.program_for(last.entry, config, accumulate)
        if built is not None:
            program, compiled = built
            compiled.prepare(last.params, last.args, max(last.batch_size, 2),
                             step.inputs.for_program(config, program.inputs, last.batch_size, draw_noise=False))
    return combine_losses(losses, [real_size(c) for c in pieces], config.loss_reduction)
