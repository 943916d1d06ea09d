"""reduce stage of compiled_psg (private)."""
