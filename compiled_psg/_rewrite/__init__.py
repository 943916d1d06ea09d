"""rewrite stage of compiled_psg (private)."""
