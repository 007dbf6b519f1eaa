"""Helpers shared by the Prefect tasks: logging, artifact keys, retry policy."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import re

from prefect import get_run_logger
from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler

from dflash_pipeline import PACKAGE_LOGGER
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.runguard import reported


def forward_logic_logs() -> None:
    """Send the package's log records to the Prefect UI (inside runs). Done here, at import of the tasks,
    because a deployment's flow-run process imports prefect before any of our code (so
    PREFECT_LOGGING_EXTRA_LOGGERS would come too late)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        handler = APILogHandler()
        handler.addFilter(_in_a_run)
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)


def _in_a_run(record: logging.LogRecord) -> bool:
    """Only records of a flow or task run go to the API: the logic's records outside runs (a direct call, the CLI's
    pre-flight) have no run to belong to, and Prefect's handler warned once per record about each of them."""
    return (
        getattr(record, "flow_run_id", None) is not None
        or FlowRunContext.get() is not None
        or TaskRunContext.get() is not None
    )


forward_logic_logs()


def percent(done: float, total: float) -> float:
    """A progress artifact's value: Prefect warns on the console of anything outside [0, 100] (a fresh-user check:
    "Progress: 320.0%" when a reused regeneration held more conversations than this run asks for)."""
    return min(100.0, max(0.0, 100.0 * done / max(total, 1)))


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context (direct calls in tests)
        return logging.getLogger(PACKAGE_LOGGER)


_artifact_store: contextvars.ContextVar[str | None] = contextvars.ContextVar("artifact_store", default=None)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def store_suffix(store: str) -> str:
    """`<store's last path part>-<8 hex of its full path>`: two stores named alike still differ."""
    name = _slug(str(store).rstrip("/").rsplit("/", 1)[-1])[:24].strip("-") or "store"
    return f"{name}-{hashlib.sha256(str(store).rstrip('/').encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def artifacts_of_store(store: str):
    """Inside: every artifact_key carries `store`'s suffix (the flow sets it once; Prefect's task threads copy the
    context). A key shared by runs of other stores made the Artifacts page's "latest" come from another store."""
    token = _artifact_store.set(store)
    try:
        yield
    finally:
        _artifact_store.reset(token)


def artifact_key(*parts: str, store: str | None = None) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only; scoped to `store` (or the store of
    the flow run, artifacts_of_store) so each store's latest artifact is its own."""
    store = store or _artifact_store.get()
    key = _slug("-".join(parts))
    if not store:
        return key[:100]
    suffix = store_suffix(store)
    return f"{key[: 99 - len(suffix)].strip('-')}-{suffix}"


def _flow_run_cancelling(task_run) -> bool:
    """Whether this task's flow run is being cancelled (the UI's Cancel, `prefect flow-run cancel`)."""
    flow_run_id = getattr(task_run, "flow_run_id", None)
    if flow_run_id is None:
        return False
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
        return bool(state and (state.is_cancelling() or state.is_cancelled()))
    except Exception:  # noqa: BLE001 - no API: not a cancellation we can see
        return False


def retry_unless_user_error(task, task_run, state) -> bool:
    """Retry crashes and transient failures; never a validation failure or a bad-input error, never a run that
    is being stopped (a signal, or its flow run is being cancelled)."""
    try:
        state.result(raise_on_failure=True)
    except PipelineError as e:
        reported(e)  # the run fails with it, and the CLI prints it once (regenerate and train have retries)
        return False
    except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
        return False
    except BaseException as e:  # noqa: BLE001
        if type(e).__name__ in ("TerminationSignal", "Abort", "CancelledRun") or _flow_run_cancelling(task_run):
            return False
        return True
    return False
