"""rules stage of compiled_psg (private)."""
