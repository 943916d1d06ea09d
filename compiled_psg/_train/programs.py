"""``ProgramCache``: the fused step programs of a ``DPStep`` (``fuse.py``), built and compiled on demand.

One program per per-sample graph (one per clipping bound) and per shape of the step around it: with or without
the noise input, dividing by the global batch size in the graph or by an input scale, with or without the
partial sums of earlier micro-batches. All of them share the captured optimizer update, which is captured again
when the optimizer's hyperparameters or state tensors change (``update_graph.signature``). When the update
cannot be captured (step hooks, a Dynamo failure) the cache falls back for good: ``fused`` is False and the step
runs the optimizer eagerly after the compiled per-sample graph.
"""

from __future__ import annotations

import logging

import torch

from .._compile.run import CompiledGraph
from . import distributed as dist_utils
from . import update_graph
from .binding import OptimizerBinding
from .config import DPConfig
from .fuse import StepProgram, fuse_step

log = logging.getLogger("compiled_psg")
_STEP_HOOKS = "the optimizer has step hooks, which run in Python (until they are removed)"


def _reads_numbers(gm: torch.fx.GraphModule) -> bool:
    """Whether the update graph turns a tensor into a Python number (``aten._local_scalar_dense``, ``.item()``):
    Inductor fails on its unbacked symbol inside the fused program (torch 2.13), where the graph run op by op
    computes it."""
    return any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes)


class ProgramCache:
    def __init__(self, optimizer: torch.optim.Optimizer, binding: OptimizerBinding, distributed: bool):
        self.optimizer = optimizer
        self.binding = binding
        self.distributed = distributed
        self.fused = True
        self.fallback_reason: str | None = None
        self.builds = 0
        self.current: StepProgram | None = None
        self._update: update_graph.UpdateGraph | None = None
        # (id(per-sample entry), noisy, divide_by_count, accumulate) -> the program and its compiled form
        self._programs: dict[tuple, tuple[StepProgram, CompiledGraph]] = {}

    @property
    def compiles(self) -> int:
        return sum(c.compiles for _, c in self._programs.values())

    def clear(self) -> None:
        """Forget every program and the captured update (the trained parameters changed)."""
        self._update = None
        self._programs.clear()
        self.current = None

    def rejoin(self) -> None:
        """Fuse the update again once the optimizer's step hooks are gone: of the fallbacks, only theirs is
        temporary (a step that could not be traced stays eager)."""
        if not self.fused and self.fallback_reason == _STEP_HOOKS \
                and not update_graph.has_step_hooks(self.optimizer):
            self.fused, self.fallback_reason = True, None

    def fall_back(self, reason: str) -> None:
        self.fused, self.fallback_reason = False, reason
        log.warning("compiled_psg: compile_step runs the optimizer update eagerly after the compiled per-sample "
                    "graph (two programs): %s", reason)

    def get(self, entry: CompiledGraph, config: DPConfig,
            accumulate: bool) -> tuple[StepProgram, CompiledGraph] | None:
        """The program for this per-sample graph and settings, or None after falling back. Raises
        ``update_graph.StateMissing`` when the optimizer has no state yet (one eager step creates it)."""
        if update_graph.has_step_hooks(self.optimizer):
            self.fall_back(_STEP_HOOKS)
            return None
        binding = self.binding
        if self._update is not None and self._update.signature != update_graph.signature(self.optimizer,
                                                                                          binding.trained):
            log.warning("compiled_psg: the optimizer's hyperparameters or state tensors changed; recompiling the "
                        "step (use tensor hyperparameters, lr=torch.tensor(0.1), to change them without this)")
            self.clear()
        if self._update is None:
            binding.install()
            try:
                self._update = update_graph.capture_update(self.optimizer, binding.trained, binding.params[0].dtype)
            except update_graph.StateMissing:
                raise
            except Exception as e:  # noqa: BLE001 -- any failure to trace the step: keep it eager, and say so
                self.fall_back(f"{type(self.optimizer).__name__}.step could not be captured whole "
                               f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
                return None
        # noise is an input only where it is added: on rank 0, and when sigma > 0 (sigma is read at run time)
        noisy = config.noise_std > 0 and dist_utils.rank() == 0
        divide_by_count = config.divide_by_count and self.distributed  # else the scale input holds 1 / count
        key = (id(entry), noisy, divide_by_count, accumulate)
        if key not in self._programs:  # once per program: the checks below are not on every step's path
            if entry.backend != "eager" and _reads_numbers(self._update.gm):
                self.fall_back(f"{type(self.optimizer).__name__}.step reads a tensor's value as a Python number "
                               "(.item(), as Adafactor reads its step count), which Inductor cannot compile into "
                               "the step's program")
                return None
            program = fuse_step(entry.rewritten, self._update, binding.params, binding.names, noisy=noisy,
                                group_name=dist_utils.group_name() if self.distributed else None,
                                divide_by_count=divide_by_count, accumulate=accumulate)
            self._programs[key] = (program, CompiledGraph(entry.rewritten, entry.backend, graph=program.gm,
                                                          cuda_graphs=entry.cuda_graphs))
            self.builds += 1
        self.current = self._programs[key][0]
        return self._programs[key]
