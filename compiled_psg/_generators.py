"""Setting torch's generators back without rewinding anyone else's draw.

A DP step that fails sets back the generators it drew from (``_train/transaction.py``), and the diagnosis of a
failed run sets back the generators its re-run drew from (``_compile/run.py``). Setting a generator back rewinds
every draw made from it since, whoever made it. Where another DP step drew its noise from the same generator
meanwhile (torch's global generator, which every thread shares; a user's generator given to two steps), that
noise would be drawn again for a later update, and the two released updates would differ by a noiseless sum. So
a generator is set back only where nothing but its owner drew from it in between:

- every draw of DP noise is counted per generator when it begins and when it ends (``noise_draw``), so another
  step's draw is seen even where it lands inside one of the owner's own (a program whose dropout draws while
  another thread draws its noise);
- the owner notes the generator's state right after each of its own draws and checks it before the next
  (``Rewind.drawing``), and once more before setting it back: a state other than the noted one means some other
  code drew from it in between.

Otherwise the generator is left where it is: the owner's own draws, never released, are skipped rather than
given out again. A draw of code other than a DP step that lands inside one of the owner's own draws (another
thread's ``torch.rand`` while the owner's program runs) cannot be told from the owner's.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_lock = threading.Lock()
_begun: collections.Counter = collections.Counter()  # id(generator) -> DP noise draws begun, process-wide
_ended: collections.Counter = collections.Counter()  # id(generator) -> DP noise draws ended


@contextlib.contextmanager
def noise_draw(generators: Iterable[torch.Generator], own: collections.Counter) -> Iterator[None]:
    """Count a draw of DP noise from ``generators``: begun now, ended on exit, and in ``own``, the drawer's tally
    (its ``Rewind`` tells its own draws from another's by it)."""
    keys = [id(g) for g in generators]
    with _lock:
        for k in keys:
            _begun[k] += 1
            own[k] += 1
    try:
        yield
    finally:
        with _lock:
            for k in keys:
                _ended[k] += 1
                own[_ENDED, k] += 1


#: ``own[_ENDED, id(generator)]``: the owner's draws ended (``own[id(generator)]``: begun), so that one of its own
#: draws an interrupt left unended (its ``finally`` skipped until the frame is collected) is not taken for another's
_ENDED = "ended"


@dataclass
class _Entry:
    generator: torch.Generator
    before: torch.Tensor  # the state to set back
    after: torch.Tensor  # the state right after the owner's last draw
    begun: int  # DP draws begun from it, and the owner's own, when the rewind was taken
    own: int
    clean: bool  # no draw but the owner's seen so far


class Rewind:
    """The state of each of ``generators`` now; ``restore`` sets each back where only the owner drew from it since.
    ``own``: the tally the owner's noise draws are counted in (``noise_draw``), if it draws noise."""

    def __init__(self, generators: Iterable[torch.Generator], own: collections.Counter | None = None):
        self.own = collections.Counter() if own is None else own
        self.entries: list[_Entry] = []
        self._open = 0  # drawing() regions entered and not left: an interrupt skipped the end of one
        with _lock:
            for g in generators:
                state = g.get_state()
                # a draw in flight now may land after the state just read: the generator is not set back
                k = id(g)  # draws in flight now other than the owner's own an interrupt kept from ending
                in_flight = _begun[k] - _ended[k] - (self.own[k] - self.own[_ENDED, k])
                self.entries.append(_Entry(g, state, state, _begun[k], self.own[k], clean=in_flight == 0))

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Around code of the owner's that draws: on entry, a state other than the one noted after the owner's
        last draw marks the generator as drawn from by someone else; on exit (a failure included), the state is
        noted."""
        self._check()
        self._open += 1
        try:
            yield
        finally:
            for e in self.entries:
                e.after = e.generator.get_state()
            self._open -= 1

    def _check(self) -> None:
        for e in self.entries:
            if e.clean and not torch.equal(e.generator.get_state(), e.after):
                e.clean = False

    def restore(self) -> None:
        """Set back each generator nothing but the owner drew from since; leave the others as they are."""
        with _lock:  # a DP draw waits: it begins either before the checks below (and is seen) or after the set
            if self._open:  # an interrupt at the end of a region of the owner's: its draws are the owner's
                for e in self.entries:
                    e.after = e.generator.get_state()
            self._check()
            for e in self.entries:
                k = id(e.generator)
                others = (_begun[k] - e.begun) - (self.own[k] - e.own)
                own_in_flight = self.own[k] - self.own[_ENDED, k]  # an interrupt kept one of its own from ending
                if e.clean and others == 0 and _begun[k] - _ended[k] == own_in_flight:
                    e.generator.set_state(e.before)


def state_loads(generator: torch.Generator, state: object) -> bool:
    """``generator.set_state(state)`` would succeed: tried on a fresh generator of its device (a state of the right
    shape may hold bytes torch refuses, and a checkpoint's load must fail before it changes anything)."""
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8
            and state.shape == generator.get_state().shape):
        return False
    try:
        torch.Generator(device=generator.device).set_state(state)
    except RuntimeError:
        return False
    return True


@contextlib.contextmanager
def states_put_back(generators: Iterable[torch.Generator | None], *, only_on_failure: bool = False) -> Iterator[None]:
    """torch's global CPU generator and ``generators`` (None entries skipped) set back to their states at entry
    when the block ends, or only when it raises: what ``make_private`` draws while it looks at the user's loader,
    or before it refuses, is not the user's draw (a dataset's random augmentation during that look is set back
    too: the look is no epoch of the user's)."""
    saved = [(g, g.get_state()) for g in {id(g): g for g in generators if g is not None}.values()]
    global_state = torch.random.get_rng_state()
    failed = True
    try:
        yield
        failed = False
    finally:
        if failed or not only_on_failure:
            torch.random.set_rng_state(global_state)
            for generator, state in saved:
                generator.set_state(state)
