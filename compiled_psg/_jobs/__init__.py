"""The jobs ``python -m compiled_psg`` runs: ``train`` (digits), ``finetune`` (a small LM with LoRA),
``explain`` and ``graphs`` (the inspection reports of the bundled examples). Not part of the library: nothing
below imports them."""
