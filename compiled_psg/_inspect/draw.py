"""SVG drawings of graphs with torch.fx's drawer; rewritten nodes are filled orange. Needs pydot + Graphviz."""

from __future__ import annotations

from pathlib import Path

import torch.fx as fx


def drawing_support() -> str | None:
    """None when drawings work, else what is missing."""
    try:
        import pydot  # noqa: F401
    except ImportError:
        return "pydot is not installed (pip install 'compiled_psg[graphviz]')"
    import shutil

    if shutil.which("dot") is None:
        return "the Graphviz 'dot' program is not installed (apt-get install graphviz)"
    return None


def draw(gm: fx.GraphModule, name: str, path: Path) -> None:
    from torch.fx.passes.graph_drawer import FxGraphDrawer

    class Highlighting(FxGraphDrawer):
        def _get_node_style(self, node):
            style = super()._get_node_style(node)
            if "psg" in node.meta:
                style["fillcolor"] = "#FFB347"
            return style

    dot = Highlighting(gm, name).get_dot_graph()
    path.write_bytes(dot.create_svg())
