"""Where the supported torch versions differ, in one place.

compiled_psg supports torch 2.11 to 2.15 (``TESTED``; CI runs 2.13, 2.14 and 2.15, 2.11 is run by hand and 2.12
by nobody). Where the package must behave differently on those versions, the choice is a function or constant
here, named for what it decides, with the versions it distinguishes; no other module reads
``torch.__version__``. Two differences need no choice and live where they are handled: Dynamo's membership
helper lost an argument in 2.14 (``batch_size_branches.membership_compares_sizes`` passes on whatever it gets),
and torch 2.15 traces ``h[arange(n), j] = v`` as ``index_fill`` (``_analyze.mixing._fills_own_positions``).
Outside the window, importing compiled_psg warns once.
"""

from __future__ import annotations

import warnings

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

TESTED = ((2, 11), (2, 15))  # inclusive: the minor versions CI or a recorded run covered


def torch_minor() -> tuple[int, int]:
    """torch's (major, minor), from ``torch.__version__`` ("2.14.1+cu130" -> (2, 14))."""
    major, minor = str(torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def warn_outside_window() -> None:
    low, high = TESTED
    if not low <= torch_minor() <= high:
        warnings.warn(f"compiled_psg is tested on torch {low[0]}.{low[1]} to {high[0]}.{high[1]}; this is torch "
                      f"{torch.__version__}. Capture relies on torch internals that change between releases: "
                      "errors or refusals may be this version's, not your code's.", stacklevel=3)


def logs_ignored_functions_in_metrics() -> bool:
    """torch 2.11 and 2.12 put Dynamo's config, every set sorted, into each compile's metrics, and
    ``ignore_logging_functions`` (functions: unsortable) is left out of it only from 2.13."""
    return torch_minor() < (2, 13)


def traces_batch_size_exponent() -> bool:
    """``h ** x.shape[0]`` (a tensor to a symbolic integer power): torch 2.11 to 2.13 fail inside torch while
    tracing (``NYI SymInt equality``, refused as a ``CaptureError``); 2.14 and later trace it, and the exponent
    reads 1 per sample like any batch-size value (exact against the loop)."""
    return torch_minor() >= (2, 14)


def embedding_bag_counts_each_id() -> bool:
    """``nn.EmbeddingBag(scale_grad_by_freq=True)`` on the CPU: from torch 2.14 the backward divides each id's
    gradient by that id's count; torch 2.11 to 2.13 divide the ``k``-th distinct id (in sorted order) by the
    count of the ``k``-th sorted id (``rules/embedding_bag._freq_scale`` follows the kernel, as the reference
    does)."""
    return torch_minor() >= (2, 14)


def item_of_a_constant_tensor_is_a_size() -> bool:
    """``.item()`` of a 0-d integer tensor the loss reads from a closure or global (``tensor_split`` at a number of
    sections held in a tensor): from torch 2.14 Dynamo makes it a backed size guarded on the tensor's value
    (``CallMethodItemSource``), and the capture is exact (``batch_size_branches`` does not take that size for the
    batch's); torch 2.11 to 2.13 leave it unbacked, and the capture refuses the shape computed from a tensor's
    values by name."""
    return torch_minor() >= (2, 14)


#: The committed FX graph dumps (``graphs/``) are generated on this torch version: later versions trace the same
#: programs with other node names and decompositions (2.14 records ``detach`` as ``alias``, 2.15 numbers nodes
#: differently), so ``tests/test_graphs.py`` compares the dumps on this version only.
GRAPH_DUMP_VERSION = (2, 13)


def reconnects_inner_gradients() -> bool:
    """A loss that calls ``torch.autograd.grad(..., create_graph=True)`` inside itself: from torch 2.13 the
    captured inner backward's saved values are reconnected and the per-sample gradients are exact; on 2.11 they
    came out wrong (``tests/test_mixing.py::test_loss_with_inner_gradient_is_exact``, not traced further), so
    such losses are refused there. 2.12 was not run: refused too."""
    return torch_minor() >= (2, 13)


def as_pass_config(passes: tuple):
    """The value for ``torch._inductor.config.post_grad_custom_post_pass`` that runs ``passes`` in order.
    torch 2.13+ takes a list; 2.11 and 2.12 take one pass, so several are chained into one whose ``uuid`` (the
    FX graph cache's key) names them all."""
    if torch_minor() >= (2, 13) or len(passes) <= 1:
        return passes if torch_minor() >= (2, 13) else (passes[0] if passes else None)
    return _Chain(passes)


def configured_passes(value) -> tuple:
    """The passes in ``post_grad_custom_post_pass``: a list on 2.13+, one pass (or a ``_Chain``) on 2.11/2.12."""
    if value is None:
        return ()
    if isinstance(value, _Chain):
        return value.passes
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


class _Chain(CustomGraphPass):
    """Several post-grad passes as one (torch 2.11/2.12 hold one); a ``CustomGraphPass``, as Inductor's FX
    graph cache requires of a post-grad pass."""

    def __init__(self, passes: tuple):
        self.passes = tuple(passes)

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self):
        """None (Inductor then bypasses its FX graph cache) unless every pass names itself, as 2.11 does for a
        pass that is not a ``CustomGraphPass`` or whose ``uuid`` is None."""
        ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        return None if any(i is None for i in ids) else tuple(ids)
