"""The eager update of a step: noise, all-reduce, scaling and ``optimizer.step()`` in Python.

It runs on the first step (optimizers create their state lazily, and the fused program reads that state), on
an empty batch (a step of noise alone) and when the optimizer update could not be captured into the program.
Its all-reduce uses the fused program's layout (``distributed.all_reduce_flat``), so a rank running eagerly meets
the others in the same collective.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import torch

from .._generators import noise_draw
from . import distributed as dist_utils
from . import native_noise
from .binding import OptimizerBinding
from .config import DPConfig
from .dp import gaussian_like, gaussian_many, gaussian_stream


class NoiseSource:
    """N(0, (sigma C)^2) noise: ``os.urandom`` with ``secure``, else keyed from torch's ``generator`` (default:
    global): the native AES-CTR stream for float32 CPU noise where it runs, torch's generators otherwise."""

    def __init__(self, secure: bool = False, generator: torch.Generator | None = None, native_likely: bool = True):
        self.secure = secure
        self.generator = generator
        if native_likely and (generator is None or generator.device.type == "cpu"):
            native_noise.prepare()  # built while the program is captured and compiled, not at the first draw
        self._buffer: dict = {}  # the last large draw's flat buffer, filled again by the next (``gaussian_many``)
        # draws from each generator (by id), counted where every DP step's draws are (``_generators.noise_draw``):
        # a failed step sets a generator back only where no other step drew from it meanwhile
        self.drawn: collections.Counter = collections.Counter()

    def generators(self, likes: list[torch.Tensor]) -> list[torch.Generator]:
        """The generators a draw for ``likes`` advances: ``generator``, or torch's global ones of the devices
        (none with ``secure``: ``os.urandom``)."""
        if self.secure:
            return []
        if self.generator is not None:
            return [self.generator]
        devices = sorted({t.device.index or 0 for t in likes if t.device.type == "cuda"})
        return [torch.default_generator, *(torch.cuda.default_generators[i] for i in devices)]

    def draw_many(self, config: DPConfig, likes: list[torch.Tensor]) -> list[torch.Tensor]:
        """Noise for every tensor of ``likes`` at once (one parallel draw on CPU: ``dp.gaussian_many``). The
        tensors are views of one buffer that the next call fills again: read them before drawing more."""
        with noise_draw(self.generators(likes), self.drawn):
            return gaussian_many(likes, config.noise_std, secure=self.secure, generator=self.generator,
                                 reuse=self._buffer)

    def wipe(self) -> None:
        """Zero the kept buffer once its noise is spent: it would give back the un-noised sum (``.grad`` minus the
        noise) to whoever reads the step's attributes. One pass over memory the step has just written."""
        flat = self._buffer.get("flat")
        if flat is not None:
            flat.zero_()

    def stream(self, config: DPConfig, likes: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """The numbers ``draw_many`` would give, one tensor at a time in order (``dp.gaussian_stream``)."""
        generators = self.generators(likes)
        with noise_draw(generators, self.drawn):  # the native stream's key is drawn now
            draws = gaussian_stream(likes, config.noise_std, secure=self.secure, generator=self.generator)
        return self._counted(draws, generators)

    def _counted(self, draws: Iterator[torch.Tensor], generators: list[torch.Generator]) -> Iterator[torch.Tensor]:
        while True:
            with noise_draw(generators, self.drawn):  # torch's generators draw as each tensor is taken
                value = next(draws, None)
            if value is None:
                return
            yield value

    def draw_scalar(self, std: float) -> float:
        """One N(0, std^2) number (adaptive clipping's count noise), from the same source, in float64."""
        like = torch.zeros((), dtype=torch.float64,
                           device="cpu" if self.generator is None else self.generator.device)
        with noise_draw(self.generators([like]), self.drawn):
            return float(gaussian_like(like, std, secure=self.secure, generator=self.generator))


def eager_update(config: DPConfig, grads: list[torch.Tensor], batch_size: int, binding: OptimizerBinding,
                 noise: NoiseSource, distributed: bool, before_step: Callable[[], None] | None = None) -> int:
    """Add the noise (rank 0), all-reduce, scale into ``p.grad`` and step the optimizer; returns the global
    batch size. ``before_step`` is called just before ``optimizer.step()``, the first code that may show the
    noisy gradient to the user's (``transaction.Snapshot.before_optimizer_step``)."""
    if config.noise_std > 0 and dist_utils.rank() == 0:
        grads = [g + n for g, n in zip(grads, noise.draw_many(config, grads), strict=True)]
    if distributed:
        count = torch.tensor(float(batch_size), dtype=grads[0].dtype, device=grads[0].device)
        grads, count = dist_utils.all_reduce_flat(grads, count)
        batch_size = int(round(count.item()))
    scale = config.scale(batch_size)
    binding.install()
    with torch.no_grad():
        for buffer, g in zip(binding.dot_grads, grads, strict=True):
            buffer.copy_(g * scale)
        if before_step is not None:
            before_step()
        binding.optimizer.step()
    return batch_size
