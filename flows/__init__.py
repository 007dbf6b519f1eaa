"""Prefect flows: the pipeline's shape (what runs after what, fan-out to devices)."""
