"""Side-by-side benchmarks of compiled_psg and its peers: ``python -m benchmarks --help``.

``models.MODELS`` and ``methods.METHODS`` are the two tables; ``measure`` runs one model in one process;
``report`` writes the page and the plots from the raw results.
"""

import os


def keep_freed_memory() -> None:
    """The benchmark commands keep freed memory in the CPU heap (``compiled_psg.retain_freed_memory``), as the
    pages say: each command's ``main`` calls this, so its worker processes inherit it (``benchmarks.probes.heap``
    sets the variable per worker to compare both settings). Importing the package changes nothing."""
    os.environ.setdefault("COMPILED_PSG_RETAIN_FREED_MEMORY", "1")
