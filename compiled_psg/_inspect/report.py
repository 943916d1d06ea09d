"""``explain``: what the rewrite did, as data. Nothing here prints unless asked."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx


@dataclass
class Report:
    before: fx.GraphModule | None = None
    after: fx.GraphModule | None = None
    captured: fx.GraphModule | None = None
    rewrites: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)
    mixing: list = field(default_factory=list)

    @classmethod
    def for_refusal(cls, captured, forward, mixing):
        return cls(before=forward, captured=captured.joint, mixing=list(mixing))

    @classmethod
    def from_rewritten(cls, rw):
        return cls(before=rw.joint, after=rw.rewritten, captured=rw.captured.joint)


def explain(fn, *args):
    entry, *_ = fn.compiled_for(*args)
    return Report.from_rewritten(entry.rewritten)
