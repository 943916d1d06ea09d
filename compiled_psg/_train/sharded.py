"""DP-SGD on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank holds, for every parameter, its shard (a ``DTensor`` of placement ``Shard(d)`` on a 1-D mesh over all
ranks: rows ``[r c, (r + 1) c)`` of dim ``d``, ``c = ceil(n_d / world)``, as FSDP chunks them) and its own samples,
as in FSDP. A step of ``compile_step`` on such a model (``ShardedStep``), with index letters i sample of rank r,
s rank, j parameter:

1. unshard: every FSDP module all-gathers its parameters (``FSDPModule.unshard``, FSDP's own collective), and
   FSDP's forward hooks are lifted for the step, so the captured per-sample graph (compiled once, like any
   other) reads the full parameters as plain tensors;
2. the per-sample graph computes, on rank r, each local sample's gradient of the *full* parameters, its norm
   and the clipped sum ``S^r_j = sum_i min(1, C / ||g_i||) g_i[j]`` (full shape). A sample's gradient lives
   entirely on the rank that holds the sample, so its squared norm is complete there: no collective on norms
   is needed. (An all-reduce of the ``[B]`` vector of squared norms is what a layout that splits one sample's
   gradient across ranks would need, tensor parallelism, which FSDP is not.)
   The clipping variants are computed the same way, whole on each rank: ``per_layer`` (a group's norm is a
   sample's) and ``automatic`` need nothing more; ``adaptive`` sums its counts of unclipped samples over the
   ranks after the step, rank 0 alone adding the count's noise (``DPStep._adapt_bound``, as under DDP);
3. the parameters are resharded; rank 0 adds the noise ``N(0, sigma^2 C^2)`` to its full sums (the numbers one
   process draws, drawn parameter by parameter: ``NoiseSource.stream``), so the noise is added once per
   coordinate;
4. ONE ``reduce_scatter_single`` over the mesh's group sums the ranks' sums and hands rank s only its shard:
   row s of the input is ``cat_j(pad(shard_s(S^r_j)).view(-1), [B_r])``, so the output on rank s is
   ``cat_j(shard_s(noise + sum_r S^r_j)), sum_r B_r``: the shard of the union's noisy clipped sum and the
   global batch size;
5. the shard is scaled (``1 / expected_batch_size``, or 1 / the global batch size) into ``p.grad`` (a
   ``DTensor`` like ``p``) and the optimizer updates each rank's shard.

So a step equals, up to the order of floating-point sums, one process running ``compile_step`` on the union of
the ranks' batches with the unsharded model and the same noise generator (``tests/test_sharded.py``). As FSDP
itself does, the ranks must start from the same model (same seed, or a loaded checkpoint): the shards are not
broadcast. ``state_dict`` is the rank's own part with its shards as local tensors (one file per rank; loading
into another world size is ``torch.distributed.checkpoint``'s job).

Memory: the step holds every parameter unsharded at once, and one full set of clipped sums (the graph's own
outputs, not copied; released parameter by parameter into the reduce-scatter's input buffer), where FSDP's
own step unshards one block at a time (``python -m benchmarks.probes.sharded_memory``; docs/training.md). What is not
done: the optimizer update runs eagerly after the compiled per-sample graph (two programs, ``step.fused`` is
False) instead of being fused into one program; hybrid sharding (2-D meshes), grouped ``fully_shard([a, b])``,
mixed-precision and CPU-offload policies, parameters outside every ``fully_shard`` and custom reductions are
refused.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from .._errors import DPConfigError, UnsupportedError
from .checkpoint import check_state_kind
from .config import DPConfig
from .paths import drawing, run_per_sample
from .results import combine_losses, micro_batches, split_result
from .step import DPStep

FIX = "Fix: apply fully_shard(module) to each block and then to the root model, with the default options"


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (empty: not an FSDP2 model)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed support
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    """True for a model with ``fully_shard`` modules; FSDP1's wrapper is refused (its flat parameters would be
    captured inside its own unshard hooks)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise UnsupportedError("the model is wrapped in FullyShardedDataParallel (FSDP1), which compile_step does "
                               "not support. Fix: shard it with FSDP2, torch.distributed.fsdp.fully_shard(module) "
                               "on each block and on the root")
    return bool(fsdp_modules(model))


def _is_fsdp_hook(hook) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    # FSDPState._pre_forward bound to its state, or (grouped modules) a wrapper around the bound method
    return any(isinstance(getattr(h, "__self__", None), FSDPState) for h in (hook, inspect.unwrap(hook)))


@contextmanager
def unsharded(modules: list[nn.Module]) -> Iterator[None]:
    """Full parameters registered on the modules (FSDP's all-gather), FSDP's forward hooks lifted (they would
    unshard and reshard inside the captured loss, outside any graph); both restored on exit."""
    for m in modules:
        m.unshard()
    saved = []
    try:
        for m in modules:
            for hooks in (m._forward_pre_hooks, m._forward_hooks):
                saved.append((hooks, dict(hooks)))  # in order: FSDP's pre-hook runs first
                for k in [k for k, h in hooks.items() if _is_fsdp_hook(h)]:
                    del hooks[k]
        yield
    finally:
        for hooks, everything in saved:
            hooks.clear()
            hooks.update(everything)
        for m in modules:
            m.reshard()


class ShardLayout:
    """Where parameter ``j``'s shard sits: dim ``dim``, ``chunk`` rows per rank (the last ranks may hold fewer,
    or none), as FSDP's ``Shard(dim)`` placement chunks it."""

    def __init__(self, p: torch.Tensor, world: int, rank: int, name: str):
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(p, DTensor):
            raise UnsupportedError(f"parameter {name!r} is not sharded (no fully_shard module owns it), so its "
                                   f"update would need an all-reduce the sharded step does not do. {FIX}")
        if p.device_mesh.ndim != 1 or len(p.placements) != 1 or not isinstance(p.placements[0], Shard):
            raise UnsupportedError(f"parameter {name!r} is placed {p.placements} on a {p.device_mesh.ndim}-D mesh; "
                                   "the sharded step supports FSDP's Shard(dim) on a 1-D mesh only (no hybrid "
                                   f"sharding). {FIX}")
        self.dim = p.placements[0].dim
        self.shape = tuple(p.shape)
        n = self.shape[self.dim]
        self.chunk = math.ceil(n / world)
        self.world = world
        self.local = self.rows(rank)
        local_shape = list(self.shape)
        local_shape[self.dim] = self.local[1]
        if tuple(p.to_local().shape) != tuple(local_shape):
            raise UnsupportedError(f"parameter {name!r}: this rank's shard is {tuple(p.to_local().shape)}, not the "
                                   f"chunk {tuple(local_shape)} of {self.shape} the sharded step expects. {FIX}")

    def rows(self, s: int) -> tuple[int, int]:
        """``(start, length)`` of rank ``s``'s rows along ``dim``."""
        n = self.shape[self.dim]
        start = min(s * self.chunk, n)
        return start, min(self.chunk, n - start)

    def write_piece(self, full: torch.Tensor, s: int, slot: torch.Tensor) -> None:
        """Rank ``s``'s rows of ``full``, zero-padded to ``chunk`` rows, into ``slot`` (flat, ``numel()``)."""
        start, length = self.rows(s)
        shape = list(self.shape)
        shape[self.dim] = self.chunk
        padded = slot.view(shape)
        padded.narrow(self.dim, 0, length).copy_(full.narrow(self.dim, start, length))
        padded.narrow(self.dim, length, self.chunk - length).zero_()

    def numel(self) -> int:
        return math.prod(self.shape) // self.shape[self.dim] * self.chunk

    def unpad(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard from its padded flat piece."""
        shape = list(self.shape)
        shape[self.dim] = self.chunk
        return flat.view(shape).narrow(self.dim, 0, self.local[1])


def reduce_scatter_sums(sums: list[torch.Tensor | None], count: torch.Tensor, layouts: list[ShardLayout], group,
                        noise: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(shards of sum_r sums[j], sum_r count)`` on every rank: one ``reduce_scatter_single`` whose row ``s`` is
    ``cat_j(pad(shard_s(sums[j])), [count])`` (the count in every row, so every rank gets the global one).

    Memory: the rows are written straight into the collective's input buffer (the padded parameters' size),
    and ``sums[j]`` is released (set to None in the list) once written, so the full sums and the buffer are
    held together one parameter at a time. ``noise(g)``, when given, is added to ``sums[j]`` first, in the
    order of the parameters (the order one process draws in)."""
    world = dist.get_world_size(group)
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in sums])  # float64 sums stay float64
    sizes = [lay.numel() for lay in layouts]
    buffer = sums[0].new_empty((world, sum(sizes) + 1), dtype=dtype)
    offset = 0
    for j, (lay, size) in enumerate(zip(layouts, sizes, strict=True)):
        g = sums[j]
        if noise is not None:
            g = g + noise(g)
        for s in range(world):
            lay.write_piece(g, s, buffer[s].narrow(0, offset, size))
        sums[j] = g = None
        offset += size
    buffer[:, -1] = count.to(dtype)
    out = buffer.new_empty(buffer.shape[1])
    dist.reduce_scatter_single(out, buffer.view(-1), op=dist.ReduceOp.SUM, group=group)
    del buffer
    parts = out.split([*sizes, 1])
    return [lay.unpad(part) for lay, part in zip(layouts, parts, strict=False)], parts[-1].view(())


def _accumulate(total: list[torch.Tensor] | None, sums: dict, names: list[str]) -> list[torch.Tensor]:
    """The micro-batches' clipped sums added up. The first micro-batch's are the graph's own outputs, kept
    without a copy: nothing writes into them (the sums and the noise are added out of place, one parameter at
    a time), so the step holds one full set of sums besides the unsharded parameters."""
    if total is None:
        return [sums[n] for n in names]
    return [t + sums[n] for t, n in zip(total, names, strict=True)]


class UnshardedCalls:
    """``step.per_sample`` of a sharded step: the per-sample function, whose calls run with the parameters
    unsharded (``make_private`` captures the loss through it before the first step); other attributes
    (``captures``, ``compiles``) are the function's."""

    def __init__(self, fn, modules: list[nn.Module]):
        self._fn, self._modules = fn, modules

    def __getattr__(self, name: str):
        value = getattr(self._fn, name)
        if name not in ("prepare_call", "compiled_for", "with_losses"):
            return value

        def unsharded_call(*args, **kwargs):
            with unsharded(self._modules):
                return value(*args, **kwargs)

        return unsharded_call

    def __call__(self, *args, **kwargs):
        with unsharded(self._modules):
            return self._fn(*args, **kwargs)


class ShardedStep(DPStep):
    """``compile_step`` for a ``fully_shard`` model (see the module docstring): the per-sample graph on the
    all-gathered parameters, the clipped sums reduce-scattered, the noise added once, each rank's shard
    updated. ``step.sharded`` is True; ``step.fused`` is False (the update runs eagerly)."""

    sharded = True

    def __init__(self, loss_fn, model: nn.Module, optimizer: torch.optim.Optimizer, *, distributed=None,
                 **options):
        if distributed is False:
            raise DPConfigError("distributed=False with a fully_shard model: its parameters are sharded across the "
                                "process group, so the step must use it. Fix: leave distributed=None")
        if not (dist.is_available() and dist.is_initialized()):
            raise DPConfigError("a fully_shard model needs an initialized process group. Fix: call "
                                "torch.distributed.init_process_group before compile_step")
        self._fsdp_modules = fsdp_modules(model)
        self._check_modules()
        # distributed=False: DPStep would broadcast rank 0's parameters; the shards are each rank's own
        super().__init__(loss_fn, model, optimizer, distributed=False, **options)
        if self._config.clipping == "custom":
            raise DPConfigError("a custom reduction (reduce=psg.custom(...)) on a fully_shard model is not tested "
                                "against one process, so it is refused. Fix: max_grad_norm=C with a clipping mode "
                                "(flat, per_layer, automatic, adaptive), or train the model unsharded (DDP)")
        self.distributed = True  # adaptive clipping sums its counts over the ranks (DPStep._adapt_bound)
        self._layouts_key: tuple = ()
        self._layouts: list[ShardLayout] = []
        self._group = None
        self._check_layouts()

    def _check_modules(self) -> None:
        for m in self._fsdp_modules:
            state = m._get_fsdp_state()
            if len(state._modules) > 1:
                raise UnsupportedError(f"fully_shard was applied to a group of modules ({len(state._modules)} "
                                       f"modules share one state). {FIX}")
            from torch.distributed.fsdp import CPUOffloadPolicy

            if any(isinstance(g.offload_policy, CPUOffloadPolicy) for g in state._fsdp_param_groups):
                raise UnsupportedError(f"fully_shard with CPUOffloadPolicy is not supported by the sharded step. "
                                       f"{FIX}")
            policy = state._mp_policy
            if policy.param_dtype is not None or policy.reduce_dtype is not None:
                raise UnsupportedError("fully_shard with a MixedPrecisionPolicy: the step clips and sums in the "
                                       "parameters' own dtype. Fix: leave mp_policy at its default and use "
                                       "torch.autocast inside the loss")

    def _check_layouts(self) -> None:
        """The shards of the trained parameters (checked again when the optimizer's parameters change)."""
        params = self.binding.params
        key = tuple(id(p) for p in params)
        if key == self._layouts_key:
            return
        # fully_shard without mesh= builds a mesh per call: the same ranks make the same group
        meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in params if hasattr(p, "device_mesh")}
        group = params[0].device_mesh.get_group() if hasattr(params[0], "device_mesh") else None
        if len(meshes) > 1:
            raise UnsupportedError(f"the trained parameters lie on {len(meshes)} device meshes. {FIX}")
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        self._layouts = [ShardLayout(p, world, rank, n) for p, n in zip(params, self.binding.names, strict=True)]
        if world != dist.get_world_size():
            raise UnsupportedError(f"the model is sharded over {world} of {dist.get_world_size()} ranks: the data "
                                   "parallel group would differ from the sharding group. Fix: fully_shard over "
                                   "every rank (the default mesh)")
        self._group, self._layouts_key = group, key

    @property
    def per_sample(self) -> UnshardedCalls:
        return UnshardedCalls(self._per_sample_for(self._config), self._fsdp_modules)

    # DPStep's fused program is not built for sharded parameters: the update runs eagerly
    fused = property(lambda self: False)
    fallback_reason = property(lambda self: "a fully_shard model: the optimizer updates each rank's shard eagerly")

    def _step(self, config: DPConfig, batch: tuple) -> torch.Tensor:
        from .._api import batch_dims_of

        f = self._per_sample_for(config)
        _, batch_size = batch_dims_of(batch, f.in_dims)
        self._bind()
        self._check_layouts()
        losses, norms, sizes, total = [], [], [], None
        with unsharded(self._fsdp_modules):
            if batch_size == 0:  # this rank drew no sample: zeros, and it still joins the collective
                with drawing(self):
                    loss, _, result = f.with_losses(*batch)
                sums, norm = split_result(result, self.binding.names, self.binding.params)
                total, losses, norms, sizes = _accumulate(None, sums, self.binding.names), [loss], [norm], [0]
            else:
                pieces = self._writing_copies(f, batch, [
                    self.prepare_batch(f, piece)
                    for piece in micro_batches(batch, f.in_dims, batch_size, self._max_physical_batch_size)])
                for c in pieces:
                    with drawing(self):
                        loss, _, result = run_per_sample(self.inputs, c.entry, config, c.params, c.args,
                                                         c.batch_size)
                    sums, norm = split_result(result, self.binding.names, self.binding.params)
                    total = _accumulate(total, sums, self.binding.names)
                    losses.append(loss)
                    norms.append(norm)
                    sizes.append(c.batch_size)
        sums = result = None  # the last micro-batch's sums: total holds them (the reduce-scatter frees it)
        self.last_norms = None if norms[0] is None else torch.cat(norms)
        with drawing(self):
            self.last_batch_size = self._sharded_update(config, total, batch_size)
        self.state_ready = True
        return combine_losses(losses, sizes, config.loss_reduction)

    def _sharded_update(self, config: DPConfig, sums: list[torch.Tensor], batch_size: int) -> int:
        """Noise (rank 0, on the full sums), one reduce-scatter, scaling into the shards' ``.grad``, the
        optimizer's step; returns the global batch size. ``sums`` is consumed (its entries are released)."""
        self.released_config = config  # noise is drawn from here on: a non-transactional failure counts the step
        noise = None
        if config.noise_std > 0 and dist.get_rank() == 0:  # the numbers one process draws for these sums
            draws = self.noise.stream(config, sums)
            noise = lambda g: next(draws)  # noqa: E731 -- called once per parameter, in order
        count = torch.tensor(float(batch_size), dtype=sums[0].dtype, device=sums[0].device)
        shards, count = reduce_scatter_sums(sums, count, self._layouts, self._group, noise)
        global_size = int(round(count.item()))
        scale = config.scale(global_size)
        if self.snapshot is not None:  # the update in Python writes the shards, .grad and state one by one
            self.snapshot.cover_update(self.binding)
        self.binding.install()
        with torch.no_grad():
            for buffer, shard in zip(self.binding.dot_grads, shards, strict=True):
                buffer.to_local().copy_(shard * scale)
            if self.snapshot is not None:  # the user's code in the optimizer's step would see the noisy update
                self.snapshot.before_optimizer_step()
            self.optimizer.step()
        return global_size

    # --- save and resume: each rank its own shards --------------------------------------------------------------
    def state_dict(self) -> dict:
        """``DPStep.state_dict`` of this rank, with every sharded tensor (the parameters' shards, the optimizer
        state of sharded parameters) as this rank's local tensor: ``torch.save`` it to one file per rank and
        load it on the same rank of a job sharded the same way. Plain tensors, so a file needs no process group
        or device mesh to be read back; resharding a checkpoint to another world size is
        ``torch.distributed.checkpoint``'s job, not this one's."""
        from torch.distributed.tensor import DTensor

        state = super().state_dict()
        state["model"] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state["model"].items()}
        params = _optimizer_params(self.optimizer)
        optim = dict(state["optimizer"])
        optim["state"], sharded = {}, []
        for i, entries in state["optimizer"]["state"].items():
            optim["state"][i] = dict(entries)
            for key, v in entries.items():
                if isinstance(v, DTensor):
                    _check_like_param(v, params[i], key)
                    optim["state"][i][key] = v.to_local()
                    sharded.append((i, key))
        state["optimizer"] = optim
        state["shards"] = {"rank": dist.get_rank(), "world": dist.get_world_size(), "optimizer": sharded}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's ``state_dict`` (saved by the same rank of the same world size): the local
        tensors are wrapped again as shards of this model's parameters, then ``DPStep.load_state_dict``."""
        from torch.distributed.tensor import DTensor

        check_state_kind(state, "DPStep")
        saved = state.get("shards")
        here = {"rank": dist.get_rank(), "world": dist.get_world_size()}
        if saved is None or {k: saved[k] for k in here} != here:
            where = "an unsharded step" if saved is None else f"rank {saved['rank']} of {saved['world']}"
            raise DPConfigError(f"this state was saved by {where}, and is loaded on rank {here['rank']} of "
                                f"{here['world']}: each rank loads its own shards. Fix: load the file of the same "
                                "rank in a job of the same world size (to reshard a checkpoint, use "
                                "torch.distributed.checkpoint)")
        live = self.model.state_dict()
        model = {k: _as_shard(v, live[k]) if isinstance(live.get(k), DTensor) else v
                 for k, v in state["model"].items()}
        params = _optimizer_params(self.optimizer)
        optim = dict(state["optimizer"])
        optim["state"] = {i: dict(entries) for i, entries in state["optimizer"]["state"].items()}
        for i, key in saved["optimizer"]:
            optim["state"][i][key] = _as_shard(optim["state"][i][key], params[i])
        super().load_state_dict({**state, "model": model, "optimizer": optim})


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in the order of the integer keys of its ``state_dict``."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_like_param(value, param: torch.Tensor, key: str) -> None:
    """Optimizer state saved as a local tensor is wrapped back like its parameter on load: it must be laid out
    like it."""
    if (getattr(param, "device_mesh", None) != value.device_mesh or tuple(param.placements) != tuple(value.placements)
            or param.shape != value.shape):
        raise UnsupportedError(f"the optimizer's state {key!r} is a DTensor {tuple(value.shape)} placed "
                               f"{value.placements}, unlike its parameter: the sharded step saves only state "
                               "sharded like the parameter. Fix: save with torch.distributed.checkpoint")


def _as_shard(local: torch.Tensor, like) -> torch.Tensor:
    """``local`` as this rank's shard of a DTensor laid out like ``like``."""
    from torch.distributed.tensor import DTensor

    if local.shape != like.to_local().shape:
        raise DPConfigError(f"a saved shard is {tuple(local.shape)}, this rank's shard of the model is "
                            f"{tuple(like.to_local().shape)}: the state was saved from another model or sharding")
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())
