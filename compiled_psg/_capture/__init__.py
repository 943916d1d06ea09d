"""capture stage of compiled_psg (private)."""
