"""One-question investigations behind design decisions: ``python -m benchmarks.probes.NAME``. Their figures
are on docs/benchmarks-probes.md."""
