"""compile stage of compiled_psg (private)."""
