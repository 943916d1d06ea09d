"""The user's source line behind a graph node, from the stack trace Dynamo records."""

from __future__ import annotations

import re

import torch.fx as fx

# a frame of a stack trace, with its code line when the trace has one (linecache may find none)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)'
                    r'(?:\n(?![ \t]*File ")[ \t]*(?P<code>[^\n]*))?')
_LIBRARY_PARTS = ("/torch/", "/compiled_psg/_")


def source_line(node: fx.Node) -> str:
    """``file:line in func: code`` of the innermost frame outside torch and compiled_psg, or ``"unknown"``."""
    trace = node.meta.get("stack_trace") or ""
    frames = list(_FRAME.finditer(trace))
    user = [f for f in frames if not any(part in f["file"] for part in _LIBRARY_PARTS)]
    chosen = (user or frames)[-1:] if frames else []
    if not chosen:
        return "unknown source line"
    f = chosen[0]
    return f'{f["file"]}:{f["line"]} in {f["func"]}: {(f["code"] or "").strip()}'


_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\](?P<package>[^/\\]+)")


def installed_library(node: fx.Node) -> str | None:
    """The installed package (``transformers``) whose code is the node's innermost frame outside torch and
    compiled_psg, or None where that frame is the user's own: a fix that edits the line is not the user's there."""
    frames = [f for f in _FRAME.finditer(node.meta.get("stack_trace") or "")
              if not any(part in f["file"] for part in _LIBRARY_PARTS)]
    found = _INSTALLED.search(frames[-1]["file"]) if frames else None
    return found["package"].removesuffix(".py") if found else None


_ROOT = re.compile(r"^(?:[GL]\['[^\]]*'\]|self)")  # Dynamo's source of the root object: a global or local
_HOPS = re.compile(r"\.__closure__\[\d+\]\.cell_contents|\.__self__|\.__func__|\.__globals__\['[^']*'\]")


def readable_module_path(path: str) -> str:
    """Dynamo's source expression of a module -> its dotted name inside the model: ``conv1.1``.

    ``L['loss_fn'].__closure__[0].cell_contents._modules['conv1']._modules['1']``, ``G['model'].conv1[1]`` and
    ``getattr(L['self'].conv1, '1')`` all read ``conv1.1``; the root module itself reads ``""``.
    """
    name = path
    while True:  # getattr(x, 'a') -> x.a, innermost first
        unwrapped = re.sub(r"getattr\(([^(),]+), '([^']+)'\)", r"\1.\2", name)
        if unwrapped == name:
            break
        name = unwrapped
    name = _ROOT.sub("", name)
    name = _HOPS.sub("", name)
    name = re.sub(r"\._modules\['([^']+)'\]", r".\1", name)
    name = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", name)
    # a module Dynamo reached through the instance dict (``self.__dict__['_modules']['stem']``, as it does when
    # nn.Module.__call__ is not torch's own) names its children the same way
    name = re.sub(r"(?:^|\.)__dict__\._modules(?=\.|$)", "", name)
    return name.strip(".")


def module_path(node: fx.Node) -> str | None:
    """``name (Type)`` of the innermost nn.Module the node ran in, from Dynamo's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, kind = list(stack.values())[-1]
    name = readable_module_path(path) or "top-level module"
    type_name = getattr(kind, "__name__", str(kind).split(".")[-1].strip("'>"))
    return f"{name} ({type_name})"


def where(node: fx.Node) -> str:
    """The source line, and the module when the op ran inside one."""
    module = module_path(node)
    return source_line(node) + (f" [module {module}]" if module else "")


_INDEX = re.compile(r"(?<=\.)\d+(?=[.\s]|$)|^\d+(?=\.)")


def group_sites(sites) -> list[str]:
    """One line per op and source line, with how many sites and their modules in brief: the BatchNorms of a
    ResNet that run one line of code read ``op at resnet.py:147 ... [module layerN.N.bn1 (BatchNorm2d)] (x8)``.
    A reason and Fix shared with an earlier line are not repeated."""
    groups: dict[tuple, list] = {}
    for site in sites:
        if not all(hasattr(site, a) for a in ("op", "source", "reason", "fix")):
            groups.setdefault((str(site),), []).append(site)
            continue
        line, _, _ = site.source.partition(" [module ")
        groups.setdefault((site.op, line, site.reason, site.fix), []).append(site)
    lines, said = [], set()
    for key, members in groups.items():
        if len(key) == 1:
            lines.append(key[0])
            continue
        op, line, reason, fix = key
        repeated = (reason, fix) in said
        said.add((reason, fix))
        if len(members) == 1 and not repeated:
            lines.append(str(members[0]))
            continue
        modules = [m.source.partition(" [module ")[2].removesuffix("]") for m in members]
        where = f"{line} [module {_common_modules(modules)}]" if any(modules) else line
        count = f" (x{len(members)})" if len(members) > 1 else ""
        lines.append(f"{op} at {where}{count}: " + ("the same reason and Fix as above" if repeated
                                                   else f"{reason}. Fix: {fix}"))
    return lines


def _common_modules(modules: list[str]) -> str:
    """Module names in brief: ``layerN.N.bn1 (BatchNorm2d)`` (each number that differs among them written ``N``)
    where they differ in their numbers only, else each distinct name with its block indices written ``N``."""
    split = [re.split(r"(\d+)", m) for m in modules]
    if len({tuple(parts[::2]) for parts in split}) == 1:  # the same text between the numbers
        return "".join(parts[0] if len(set(parts)) == 1 else "N" for parts in zip(*split, strict=True))
    names = dict.fromkeys(_INDEX.sub("N", m) for m in modules)
    kinds = {name.rpartition(" (")[2] for name in names}
    if len(kinds) == 1:  # one type: said once, after the names
        return ", ".join(name.rpartition(" (")[0] for name in names) + f" ({kinds.pop()}"
    return ", ".join(names)
