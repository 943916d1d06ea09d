"""train stage of compiled_psg (private)."""
