"""Prefect flows: the pipeline's shape (what runs after what, fan-out to devices)."""

import os

# Logs of the logic packages reach the Prefect UI; offline-safe defaults (no telemetry).
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "dataprep,target,storage,drafter,pipeline,embedded")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
