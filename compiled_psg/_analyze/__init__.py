"""analyze stage of compiled_psg (private)."""
