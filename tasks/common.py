"""Helpers shared by the Prefect tasks: logging, artifact keys, retry policy."""

from __future__ import annotations

import logging
import re

from prefect import get_run_logger

from pipeline.errors import PipelineError


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context (direct calls in tests)
        return logging.getLogger("dflash")


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def retry_unless_user_error(task, task_run, state) -> bool:
    """Retry crashes and transient failures; never a validation failure or a bad-input error."""
    try:
        state.result(raise_on_failure=True)
    except PipelineError:
        return False
    except BaseException:  # noqa: BLE001
        return True
    return False
