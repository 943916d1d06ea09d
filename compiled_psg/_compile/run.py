"""Compile a rewritten graph with a backend and run it on real inputs.

``backend="inductor"`` compiles once with the batch symbolic (every batch size from 2 up) and once more,
lazily, for a batch of one (the shape environment specializes sizes 0 and 1). ``backend="eager"`` runs the
rewritten FX graph op by op: the same numbers, no compiler, for telling rewrite bugs from compiler bugs.

In-place updates the loss makes to its inputs (``x.mul_(2)``, a buffer counter) are applied after every run, as
an eager call of the loss would: the capture's mutation graph computes the new values from the same inputs and
they are copied into the user's tensors (the real argument, parameter or buffer, not a contiguous copy).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable

import torch
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from .._analyze.source import source_line
from .._capture import patches, torch_caches
from .._capture.corrected_decompositions import FAILED_CHECK
from .._capture.dynamo import CAPTURE_LOCK
from .._errors import BatchInputError, CompileError, InternalError, PerSampleError
from .._generators import Rewind
from .._heap import opted_in_by_environment, retain_freed_memory
from .._reduce.reductions import holds_low_precision
from .._rewrite.rules.conv import calls_batch_as_groups
from . import indexing  # noqa: F401 - registers the compile phase's index simplification
from .batch_values import failing_samples, out_of_range, without_numbers
from .build import Rewritten
from .prepare import for_inductor

BACKENDS = ("inductor", "eager")


def _inductor_config(graph: torch.fx.Graph):
    return torch._inductor.config.patch(**_inductor_settings(graph))


def _inductor_settings(graph: torch.fx.Graph) -> dict:
    """Inductor's config for one rewritten graph: bf16 intermediates rounded as eager does (the norm and the
    clipped sum read the same values), no channels-last layouts where per-sample convolutions read NCHW, and no
    ``reorder_for_locality``. That post-grad pass runs on inference graphs only (torch's training graphs, where
    gradients are computed, never get it), and a rewritten graph computes gradients as an inference graph: on the
    per-sample graph of a 2-layer bidirectional ``nn.RNN`` it gave wrong gradients (2.76 off on a scale of 2.68,
    float64), exact with the pass off (``tests/test_inductor_prepare.py``)."""
    return {"emulate_precision_casts": holds_low_precision(graph),
            "layout_optimization": torch._inductor.config.layout_optimization and not calls_batch_as_groups(graph),
            "reorder_for_locality": False}


patches.register(patches.Patch(
    "Inductor settings", "torch._inductor.config: emulate_precision_casts, layout_optimization, reorder_for_locality",
    "bf16 intermediates rounded as eager rounds them (the norm and the clipped sum read the same values); no "
    "channels-last layouts where per-sample convolutions read NCHW; no reordering for locality, a pass of inference "
    "graphs that gave a gradient graph wrong values", ("compile",),
    "process-wide config; another thread's torch.compile waits on Dynamo's compile lock",
    "torch._inductor.config.patch restores each value on exit", enter=_inductor_config, takes=("graph",),
    current=lambda: (torch._inductor.config.emulate_precision_casts, torch._inductor.config.layout_optimization,
                     torch._inductor.config.reorder_for_locality)))


class CompiledGraph:
    """Runs ``graph`` (default: the rewritten graph) compiled by ``backend``. A graph built on the rewritten one
    (the fused training step) may take more inputs after the rewritten graph's own: ``run(..., extra)``.

    ``cuda_graphs``: Inductor records the compiled program as CUDA graphs (its cudagraph trees: one graph per
    batch size, replayed after). A replay's outputs live in memory the next replay overwrites: the caller copies
    out what it keeps before the next run (``_train/buckets.py``), and each run starts a new step
    (``torch.compiler.cudagraph_mark_step_begin``) so that the trees replay rather than record a branch. Inputs
    are copied into the graph's own buffers on every replay (none is marked static)."""

    def __init__(self, rewritten: Rewritten, backend: str, graph: torch.fx.GraphModule | None = None,
                 cuda_graphs: bool = False):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if cuda_graphs and backend != "inductor":
            raise ValueError("cuda_graphs needs backend='inductor'")
        self.rewritten = rewritten
        self.graph = rewritten.graph_module if graph is None else graph
        self.backend = backend
        self.cuda_graphs = cuda_graphs
        self._compiled: dict[str, Callable] = {}
        self.compile_seconds = 0.0
        self.compiles = 0
        self._plan: list[tuple[int, str, object]] | None = None  # built on first use (_make_plan)
        self._heap_checked = False
        self._empty_loss_graph: torch.fx.GraphModule | None = None  # built on the first empty batch

    def _inputs(self, params: dict[str, torch.Tensor], args: tuple, batch_size: int) -> list:
        if self._plan is None:
            self._plan = self._make_plan()
        constants = self.rewritten.captured.constants
        inputs = []
        for i, kind, key in self._plan:  # compiled kernels assume the example inputs' (contiguous) strides
            if kind == "param":
                inputs.append(params[key].detach())
            elif kind == "arg":
                arg = args[key]
                inputs.append(arg.contiguous() if isinstance(arg, torch.Tensor) else arg)
            elif kind == "arg_as_given":  # its strides are the capture's (a new layout is recaptured by the guards)
                inputs.append(args[key])
            elif kind == "batch":
                inputs.append(batch_size)
            elif kind == "const_size":
                inputs.append(key)
            elif kind == "size":
                inputs.append(int(key.subs(self.rewritten.batch.symbol, batch_size)))
            else:
                value = constants[i]
                inputs.append(value.detach() if isinstance(value, torch.Tensor) else value)
        return inputs

    def _make_plan(self) -> list[tuple[int, str, object]]:
        """``(placeholder, kind, key)`` per input: a size that is the batch size itself is read without sympy
        (``subs`` cost more than a small graph's kernels), a size that is a number is that number."""
        rw = self.rewritten
        plan = []
        for i, role in enumerate(rw.roles):
            if role.kind == "size":
                node = rw.captured.fake_inputs[i].node
                # the shape environment's replacements (a size equal to the batch size is unified with it), which
                # node.expr applies only once something has asked the environment about this size
                expr = node.shape_env.replace(node.expr)
                if expr == rw.batch.symbol:
                    plan.append((i, "batch", None))
                elif expr.is_number:
                    plan.append((i, "const_size", int(expr)))
                else:
                    plan.append((i, "size", expr))
            elif role.kind == "arg" and not role.batched:  # captured as given (``_api._capture_args``)
                plan.append((i, "arg_as_given", role.key))
            else:
                plan.append((i, role.kind, role.key))
        return plan

    def _callable(self, batch_size: int, inputs: list) -> Callable:
        if not self._heap_checked:  # a CPU program, and the environment opts in: recycle buffers (_heap.py)
            self._heap_checked = True
            if opted_in_by_environment() and any(isinstance(x, torch.Tensor) and x.device.type == "cpu"
                                                 for x in inputs):
                retain_freed_memory()
        if self.backend == "eager":
            return self.graph.forward  # not the module call: global module hooks must not run on our graph
        key = "one" if batch_size == 1 else "any"
        if key not in self._compiled:
            with CAPTURE_LOCK:  # Inductor shares Dynamo's process-wide state; one compile at a time
                if key not in self._compiled:
                    try:
                        self._compile(key, inputs)
                    finally:
                        torch_caches.track(getattr(detect_fake_mode(self.rewritten.captured.fake_inputs),
                                                       "shape_env", None))
                        torch_caches.release()
        return self._compiled[key]

    def _compile(self, key: str, inputs: list) -> None:
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        gm = for_inductor(self.graph)  # a copy, with views as reshapes (prepare.py)
        if key == "any":
            fakes = self.rewritten.fake_inputs
            mode = detect_fake_mode(fakes)
            examples = [f.detach() if isinstance(f, torch.Tensor) else f for f in fakes]
            examples += [mode.from_tensor(x, static_shapes=True) for x in inputs[len(fakes):]]
        else:
            examples = inputs
        try:
            with patches.applied("compile", graph=gm.graph):
                # Inductor's CUDA graphs (cudagraph trees, its default tree mode): a graph with a CPU op or an
                # input it mutates is run without them, and Inductor logs why ("skipping cudagraphs")
                compiled = (compile_fx(gm, examples, config_patches={"triton.cudagraphs": True}) if self.cuda_graphs
                            else compile_fx(gm, examples))
        except PerSampleError:
            raise
        except Exception as e:
            raise CompileError(
                f"Inductor failed to compile the rewritten per-sample graph ({type(e).__name__}: "
                f"{(str(e).strip().splitlines() or [''])[0]}). The rewrite itself is fine: backend=\"eager\" "
                "runs the same graph without a compiler and gives the same numbers. Please report this "
                "with the message above.") from e
        if key == "any":
            _check_batch_not_pinned(self.rewritten, "Inductor")
        self._compiled[key] = compiled
        self.compile_seconds += time.perf_counter() - start
        self.compiles += 1

    def prepare(self, params: dict[str, torch.Tensor], args: tuple, batch_size: int, extra: tuple = ()) -> None:
        """Compile for ``batch_size`` now, without running."""
        self._callable(batch_size, self._inputs(params, args, batch_size) + list(extra))

    def run(self, params: dict[str, torch.Tensor], args: tuple, batch_size: int, extra: tuple = ()) -> list:
        """The graph's flat outputs; ``extra`` feeds the placeholders after the rewritten graph's own."""
        inputs = self._inputs(params, args, batch_size) + list(extra)
        fn = self._callable(batch_size, inputs)
        if self.cuda_graphs:  # the last run's outputs were copied out (the caller's part): they may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        mutated = bool(self.rewritten.captured.mutated)
        with torch.no_grad():
            hidden = None  # raised outside the handler: torch's error (which may show a value) is not its context
            try:
                # the loss's in-place writes from the inputs as they are now: a fused step's program updates the
                # parameters in place, and a buffer written from a weight must get the pre-update weight, as in
                # one eager forward
                new_values = self._mutation_values(inputs) if mutated else None
                outputs = list(fn(*inputs))
            except PerSampleError:
                raise
            except Exception as e:  # the graph ran ops the capture only saw on fake tensors
                failed = _failed_check(e)
                if failed is not None:  # an assertion the capture put where eager torch raises
                    raise failed_check_error(_at_user_line(self.rewritten, failed),
                                             _failing_samples(self.rewritten, inputs, failed)) from e
                if _dtype_mismatch(e):
                    raise BatchInputError(
                        f"the loss failed on this batch's dtypes ({type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0]}): {_dtypes(args, params)}. Fix: give the batch "
                        f"the dtype the model computes in ({_to_params_dtype(params)}), or convert the model") from e
                hidden = _run_failure(self.rewritten, inputs, e)
            if hidden is not None:
                raise hidden
            if new_values is not None:
                self._apply_mutations(params, args, new_values)
        return outputs

    def _mutation_values(self, inputs: list) -> list[torch.Tensor]:
        """The new values of the tensors the loss updates in place, from ``inputs`` (the old values)."""
        captured = self.rewritten.captured
        graph_inputs = inputs[:len(captured.roles)]
        values = captured.mutation_graph.forward(*graph_inputs)  # no module hooks
        # a value that is an input itself (``buffer.copy_(weight)``) is read now, before the program updates it
        held = {t.untyped_storage().data_ptr() for t in graph_inputs if isinstance(t, torch.Tensor)}
        return [v.clone() if v.untyped_storage().data_ptr() in held else v for v in values]

    def _apply_mutations(self, params: dict[str, torch.Tensor], args: tuple, new_values: list) -> None:
        """Write the loss's in-place updates into the user's tensors. Post: each mutated argument, parameter or
        buffer holds what one eager call of the loss, before the step's update, would have left in it."""
        captured = self.rewritten.captured
        for i, value in zip(captured.mutated, new_values, strict=True):
            role = captured.roles[i]
            if role.kind == "param":
                target = params[role.key]
            elif role.kind == "arg":
                target = args[role.key]
            else:
                target = captured.constants[i]
            target.copy_(value)

    def loss_of_empty_batch(self, params: dict[str, torch.Tensor], args: tuple) -> torch.Tensor:
        """The loss of a batch of no samples, as the function computes it: NaN for a mean over the samples, 0 for
        a sum. The rewritten graph's nodes that compute the loss (the captured forward) run op by op on the empty
        batch, without gradients; where they raise on zero samples (a shape the loss derives from the batch size,
        ``x.view(len(x), -1)``), NaN. The loss's in-place updates are applied as one eager call applies them (a
        counter, a power iteration's vector: Poisson sampling draws empty batches), unless computing them raises
        on zero samples: then none is."""
        if self._empty_loss_graph is None:
            graph = copy.deepcopy(self.rewritten.graph_module.graph)
            output = graph.output_node()
            loss = output.args[0][0]
            graph.erase_node(output)
            graph.output(loss)
            graph.eliminate_dead_code()
            self._empty_loss_graph = torch.fx.GraphModule(self.rewritten.graph_module, graph)
        weights = self.rewritten.seed_weights
        if weights is not None:  # the seed weights' placeholder (``build(seed_weights=True)``): no samples
            args = (*args, torch.zeros(0, dtype=weights.dtype, device=weights.device))
        inputs = self._inputs(params, args, 0)
        with torch.no_grad():
            new_values = None
            if self.rewritten.captured.mutated:
                try:
                    new_values = self._mutation_values(inputs)
                except Exception:  # noqa: BLE001 -- an update undefined on zero samples: all of them are skipped
                    new_values = None
            try:
                loss = self._empty_loss_graph.forward(*inputs)  # not the module call: no global module hooks
            except Exception:  # noqa: BLE001 -- the loss is undefined on zero samples; the step of noise still is
                reference = next(iter(params.values()))
                loss = torch.full((), float("nan"), dtype=reference.dtype, device=reference.device)
            if new_values is not None:
                self._apply_mutations(params, args, new_values)
        return loss

    def __call__(self, params: dict[str, torch.Tensor], args: tuple, batch_size: int):
        weights = self.rewritten.seed_weights
        if weights is not None:  # the loss's own arguments: every sample weighs 1 (``build(seed_weights=True)``)
            args = (*args, torch.ones(batch_size, dtype=weights.dtype, device=weights.device))
        loss, per_sample_losses, *flat = self.run(params, args, batch_size)
        return loss, per_sample_losses, pytree.tree_unflatten(list(flat), self.rewritten.out_spec)


def _run_failure(rw: Rewritten, inputs: list, e: Exception) -> BatchInputError:
    """The error for an op that raised on the real batch (the capture ran it on fake tensors only): the op and the
    user's line, found by running the captured graph again, node by node, on the same inputs (a compiled kernel's
    message names its generated C++ line; the op's own eager message is the one shown, without its numbers: the
    failure is about the batch's values, which it may name, ``batch_values``)."""
    found = _failing_node(rw, inputs)
    random = _random_nodes(rw.captured.joint.graph)
    if found is None and random:
        node = random[0]
        return BatchInputError(
            f"running the rewritten per-sample graph on this batch failed ({type(e).__name__}: {_torch_text(e)}). "
            f"The loss draws random numbers ({node.target} at {source_line(node)}), and a run of the loss again on "
            "the same batch, to find the op that fails, drew other numbers and did not fail: the failure depends on "
            "the draws (a dropout mask that leaves nothing, a sample drawn out of range). Fix: call the loss "
            "eagerly on the batch to see the op that fails, or check it with the random op switched off "
            "(model.eval() for dropout)")
    if found is None:
        return BatchInputError(
            f"running the rewritten per-sample graph on this batch failed ({type(e).__name__}: {_torch_text(e)}). "
            "A sample's own loss is the loss of a batch of one: if the loss is undefined for one sample (kthvalue "
            "with k > 1 over the batch, a statistic that needs two samples), per-sample gradients are undefined "
            "too; compute that statistic outside the loss. Otherwise please report this message.")
    node, raised, value_of = found
    where = f"{node.target} at {source_line(node)}"
    try:
        outside = out_of_range(node, value_of)
    except Exception:  # noqa: BLE001 -- naming the range is a courtesy: the message below stands without it
        outside = None
    if outside is not None and not _holds_the_batch(outside.index, rw.batch.symbol):
        # an index without a dimension of the batch's size: the loss's own (a constant, a closure's), or a value
        # it computed from the batch (y[0], y.max()), whose numbers stay out of the message
        return BatchInputError(
            f"the loss fails on this batch: {where} raised {type(raised).__name__}: an index with no dimension of "
            f"the batch (the loss's own, or one it computed from the batch, as y.max()) is outside the range the op "
            f"accepts: {outside.range}. Fix: the index the loss gives that op at that line")
    if outside is not None:
        return failed_check_error(
            f"the loss fails on this batch: {where} raised {type(raised).__name__}: an index that the batch gives "
            f"is outside the range the op accepts: {outside.range}. The index itself is left out (it is the "
            "batch's data). Fix: check the batch's labels and indices", failing_samples(outside, rw.batch.symbol))
    text = _torch_text(raised)
    where = f"{where} raised {type(raised).__name__}: {text}"
    if isinstance(raised, IndexError) or "out of bounds" in text or "out of range" in text:
        return BatchInputError(
            f"the loss fails on this batch: {where}. A value of the batch is outside what the op accepts (a label "
            "at or past the number of classes, an index past an embedding's rows). Fix: check the batch's labels "
            "and indices")
    return BatchInputError(
        f"the loss fails on this batch: {where}. If the loss raises this when called eagerly on the batch, fix it "
        "there; if it is undefined for one sample (kthvalue with k > 1 over the batch, a statistic that needs two "
        "samples), per-sample gradients are undefined too: compute that statistic outside the loss")


def _holds_the_batch(index: torch.fx.Node, batch_symbol) -> bool:
    """Whether an index's value has a dimension of the batch's size (else it is the loss's own, not the batch's)."""
    value = index.meta.get("val")
    return any(isinstance(size, torch.SymInt) and size.node.expr == batch_symbol
               for size in getattr(value, "shape", ()))


def _torch_text(e: BaseException) -> str:
    """The first line of torch's message, its numbers left out (they may be the batch's values)."""
    first = (str(e).strip().splitlines() or [""])[0].rstrip(".")
    shown = without_numbers(first)
    return shown if shown == first else f"{shown} (numbers left out: they may be the batch's values)"


class _NodeTracker(torch.fx.Interpreter):
    current: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node):
        self.current = n
        return super().run_node(n)


def _random_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]


def _generators_of(graph: torch.fx.Graph, inputs: list) -> list[torch.Generator]:
    """The generators a run of ``graph``'s random ops draws from: torch's global ones (CPU, and the CUDA devices
    of ``inputs``) and any generator a node is given."""
    generators = [torch.default_generator]
    for index in sorted({t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor)
                         and t.device.type == "cuda"}):
        generators.append(torch.cuda.default_generators[index])
    for node in graph.nodes:
        generators += [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.Generator)]
    return generators


def _failing_node(rw: Rewritten, inputs: list) -> tuple[torch.fx.Node, Exception, Callable] | None:
    """The node of the captured joint graph that raises on ``inputs``, what it raises, and the values the run
    computed (an argument of the node -> its value; the graph writes nothing: its updates are outputs); None where
    nothing raises. The run's random ops (dropout) draw other numbers than the failed run's, from generators that
    are set back afterwards where nothing else drew from them meanwhile (``_generators.Rewind``; otherwise left
    advanced by draws no one sees): the user's generators are as the failed run left them."""
    joint = rw.captured.joint
    rewind = Rewind(_generators_of(joint.graph, inputs)) if _random_nodes(joint.graph) else None
    tracker = _NodeTracker(joint)
    try:
        with torch.no_grad(), contextlib.nullcontext() if rewind is None else rewind.drawing():
            tracker.run(*inputs[:len(rw.captured.roles)])
    except Exception as raised:  # noqa: BLE001 - any op's failure is the one to name
        node = tracker.current
        if node is None or node.op != "call_function":
            return None
        return node, raised, lambda arg: tracker.env.get(arg) if isinstance(arg, torch.fx.Node) else arg
    finally:
        if rewind is not None:
            rewind.restore()
    return None


def _failed_check(e: Exception) -> str | None:
    """The message of a check the capture put in the graph (``corrected_decompositions._assert_ok``), from the
    error that the eager op or Inductor's assertion raised with it; None for any other error."""
    text = str(e)
    start = text.find(FAILED_CHECK)
    if start < 0:
        return None
    return text[start + len(FAILED_CHECK):].strip().splitlines()[0].strip().rstrip("\"'")


def failed_check_error(failed: str, samples: list[int], offset: int = 0,
                       unchecked_from: int | None = None) -> BatchInputError:
    """The ``BatchInputError`` of a failed check of the capture, naming the samples that fail it (positions in
    a batch whose first sample is at ``offset`` of the user's batch: a micro-batch's; the samples from
    ``unchecked_from`` on, later micro-batches', did not run). It keeps ``failed`` and ``samples`` so that a step
    running micro-batches can name the positions in the user's batch (``_train.paths``)."""
    at = sorted(offset + s for s in samples)
    others = ("the others pass" if unchecked_from is None else
              f"the others before position {unchecked_from} pass, and the samples from position {unchecked_from} "
              "on were not checked (the step stops at the first micro-batch that fails)")
    text = f". The samples at positions {at} of the batch (counting from 0) fail it, {others}" if at else ""
    error = BatchInputError(failed + text)
    error.failed_check, error.failing_samples = failed, at
    return error


def _at_user_line(rw: Rewritten, failed: str) -> str:
    """``failed`` with ``raises here`` made ``raises at <the user's line>`` where the check's node carries it."""
    for node in rw.captured.joint.graph.nodes:
        if node.target is torch.ops.aten._assert_async.msg and str(node.args[1]).strip().endswith(failed):
            line = source_line(node)
            if line != "unknown source line" and "compiled_psg" not in line.split(":", 1)[0]:
                return failed.replace(" raises here,", f" raises at {line},", 1)
            break
    return failed


def _failing_samples(rw: Rewritten, inputs: list, failed: str) -> list[int]:
    """The samples that fail a check of the capture (``corrected_decompositions._assert_ok``): the joint graph run
    again up to the ``info`` of each check with that message, which is nonzero for each matrix that fails, on the
    same inputs (the graph writes nothing: its updates are outputs). Only after the failure, so the program itself
    does no more work; [] where the re-run finds none, a random op comes before the check, or the batch is not one
    dimension of ``info``."""
    captured = rw.captured
    try:
        infos = _check_infos(captured.joint, failed)
        if not infos:
            return []
        gm = copy.deepcopy(captured.joint)
        by_name = {n.name: n for n in gm.graph.nodes}
        gm.graph.output_node().args = (tuple(by_name[i.name] for i in infos),)
        for node in list(gm.graph.nodes):  # the checks themselves (kept by dead-code elimination: they raise)
            if node.target is torch.ops.aten._assert_async.msg and FAILED_CHECK in str(node.args[1]):
                gm.graph.erase_node(node)
        gm.graph.eliminate_dead_code()
        if any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in gm.graph.nodes):
            return []  # a draw before the check: run again it would draw other values (and advance the generator)
        gm.recompile()
        with torch.no_grad():
            values = gm(*inputs[:len(captured.roles)])
        samples: set[int] = set()
        for node, info in zip(infos, values, strict=True):
            dim = _batch_dim(node.meta.get("val"), rw.batch.symbol)
            if dim is None:
                return []
            failing = (info != 0).movedim(dim, 0).reshape(info.shape[dim], -1).any(1)
            samples |= set(failing.nonzero().flatten().tolist())
    except Exception:  # naming the samples is a courtesy: the check's own message stands without it
        return []
    return sorted(samples)


def _check_infos(joint: torch.fx.GraphModule, failed: str) -> list[torch.fx.Node]:
    """The ``info`` nodes of the checks ``_assert_async((info == 0).all(), msg)`` whose message is ``failed``."""
    infos = []
    for node in joint.graph.nodes:
        if node.target is not torch.ops.aten._assert_async.msg or FAILED_CHECK not in str(node.args[1]):
            continue
        if str(node.args[1])[str(node.args[1]).find(FAILED_CHECK) + len(FAILED_CHECK):].strip() != failed:
            continue
        cond = node.args[0]
        if getattr(cond, "target", None) is torch.ops.aten.all.default \
                and getattr(cond.args[0], "target", None) is torch.ops.aten.eq.Scalar:
            infos.append(cond.args[0].args[0])
    return infos


def _batch_dim(value, symbol) -> int | None:
    """The dimension of ``value`` whose size is the batch size itself."""
    if not isinstance(value, torch.Tensor):
        return None
    dims = [d for d, size in enumerate(value.shape)
            if isinstance(size, torch.SymInt) and size.node.expr == symbol]
    return dims[0] if len(dims) == 1 else None


def _dtype_mismatch(e: Exception) -> bool:
    text = str(e)
    return any(part in text for part in ("must have the same dtype", "expected scalar type", "dtype mismatch",
                                         "Expected both inputs to have the same dtype", "not implemented for 'Long'",
                                         "not implemented for 'Int'"))


def _to_params_dtype(params: dict[str, torch.Tensor]) -> str:
    """``x.to(torch.float64)``: the conversion to the parameters' floating dtype (the first, where they differ)."""
    kinds = [p.dtype for p in params.values() if p.is_floating_point()]
    return f"x.to({kinds[0]})" if kinds else "x.to(the parameters' dtype)"


def _dtypes(args: tuple, params: dict[str, torch.Tensor]) -> str:
    """``argument 0 is torch.float64, ...; the parameters are torch.float32``."""
    given = [f"argument {i} is {a.dtype}" for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    kinds = sorted({str(p.dtype) for p in params.values()})
    return ", ".join(given) + f"; the parameters are {' and '.join(kinds)}"


def _check_batch_not_pinned(rw: Rewritten, stage: str) -> None:
    env = getattr(detect_fake_mode(rw.captured.fake_inputs), "shape_env", None)
    if env is not None and rw.batch.symbol in env.replacements:
        raise InternalError(f"{stage} fixed the batch size to {env.replacements[rw.batch.symbol]}; an op "
                             "in the rewritten graph needs an opaque implementation. Use backend='eager' meanwhile.")

