"""Side-by-side benchmarks of compiled_psg and its peers: ``python -m benchmarks --help``.

``models.MODELS`` and ``methods.METHODS`` are the two tables; ``measure`` runs one model in one process;
``report`` writes the page and the plots from the raw results.
"""
