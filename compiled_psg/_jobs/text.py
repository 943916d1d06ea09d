"""Text that ships with Python: the standard library's own docstrings, as byte-level token windows.

Nothing downloads and nothing is fitted on the data: the tokenizer is the identity on UTF-8 bytes (vocabulary
256), so building it costs no privacy. The docstrings depend on the Python version; the module lists are fixed
and read in a deterministic order (module, then its classes and functions by name, then each class's methods by
name; identical docstrings kept once).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from dataclasses import dataclass

import torch

VOCAB_SIZE = 256  # byte-level: token = UTF-8 byte

# The base model is pre-trained (non-privately) on these modules' docstrings: the "public" text.
PUBLIC_MODULES = ("abc", "argparse", "collections", "contextlib", "dataclasses", "datetime", "decimal", "enum",
                  "fractions", "functools", "heapq", "inspect", "itertools", "json", "logging", "os", "pathlib",
                  "pickle", "random", "re", "shutil", "statistics", "string", "subprocess", "textwrap",
                  "threading", "typing", "unittest", "zipfile")
# DP fine-tuning uses other modules (networking, mail, files and formats): the "private" text, split into
# training and held-out docstrings.
PRIVATE_MODULES = ("asyncio", "calendar", "configparser", "csv", "difflib", "email.message", "email.utils",
                   "ftplib", "gzip", "http.client", "http.cookiejar", "http.server", "imaplib", "ipaddress",
                   "mailbox", "poplib", "queue", "sched", "selectors", "smtplib", "socket", "socketserver",
                   "tarfile", "tempfile", "urllib.parse", "urllib.request", "uuid", "wave", "xml.dom.minidom")


def stdlib_docstrings(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The docstrings of ``modules`` (those that import), in a fixed order, each once."""
    seen: set[str] = set()
    docs: list[str] = []

    def add(obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    with warnings.catch_warnings():  # reading deprecated members (typing.io, ...) is not using them
        warnings.simplefilter("ignore")
        for name in modules:
            _add_module(name, add)
    return docs


def _add_module(name: str, add) -> None:
    """``add`` the docstrings of module ``name``, its classes and functions, and their methods, by name."""
    try:
        module = importlib.import_module(name)
    except ImportError:  # an optional module missing from this build of Python
        return
    add(module)
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or getattr(obj, "__module__", None) != name:
            continue
        add(obj)
        if inspect.isclass(obj):
            for method in sorted(vars(obj)):
                member = vars(obj)[method]
                if inspect.isfunction(member) or isinstance(member, classmethod | staticmethod | property):
                    fn = getattr(member, "__func__", getattr(member, "fget", member))
                    if getattr(fn, "__module__", None) == name:  # not one another library patched in
                        add(fn)


def encode(text: str) -> torch.Tensor:
    """Byte-level tokens of ``text`` (int64)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def windows(docs: list[str], length: int) -> torch.Tensor:
    """``[N, length]`` non-overlapping windows of the docstrings joined by blank lines (the tail is dropped)."""
    tokens = encode("\n\n".join(docs) + "\n\n")
    n = len(tokens) // length
    return tokens[:n * length].reshape(n, length)


@dataclass
class Corpus:
    """Token windows: ``public`` (pre-training), ``private_train`` (DP fine-tuning), ``private_test``
    (held-out docstrings of the private modules: every ``test_every``-th one)."""
    public: torch.Tensor
    private_train: torch.Tensor
    private_test: torch.Tensor
    public_docs: int
    private_docs: int


def load_corpus(length: int = 64, test_every: int = 5) -> Corpus:
    public = stdlib_docstrings(PUBLIC_MODULES)
    private = stdlib_docstrings(PRIVATE_MODULES)
    train = [d for i, d in enumerate(private) if i % test_every]
    test = [d for i, d in enumerate(private) if not i % test_every]
    return Corpus(windows(public, length), windows(train, length), windows(test, length), len(public),
                  len(private))
