"""inspect stage of compiled_psg (private)."""
