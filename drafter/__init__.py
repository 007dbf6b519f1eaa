"""The DFlash drafter: model, training from the hidden-state store, export, acceptance evaluation and
response regeneration. Logic only: no Prefect imports here (the pipeline's tasks wrap these functions)."""
