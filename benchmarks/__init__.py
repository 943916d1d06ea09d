"""Side-by-side benchmarks of compiled_psg and its peers: ``python -m benchmarks --help``.

``models.MODELS`` and ``methods.METHODS`` are the two tables; ``measure`` runs one model in one process;
``report`` writes the page and the plots from the raw results.
"""

import os

# The benchmarks keep freed memory in the CPU heap (``compiled_psg.retain_freed_memory``), as the pages say; a
# worker of ``benchmarks.heap`` sets the variable itself to compare both settings.
os.environ.setdefault("COMPILED_PSG_RETAIN_FREED_MEMORY", "1")
