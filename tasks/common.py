"""Helpers shared by the Prefect tasks: logging, artifact keys, retry policy."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import re
from dataclasses import dataclass

from prefect import get_run_logger
from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler

from dflash_pipeline import PACKAGE_LOGGER
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.local_prefect import ACTIVE_TASK_STATES, FLOW_NAME, ORPHANING_STATES
from dflash_pipeline.runguard import reported, stop_asked


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


# ---- how a run stops: its cause in words, its tasks' final states, a clean log (issue 50) -----------------------
STARTED_BY = os.getppid()  # the Prefect worker that started this flow-run process (PREFECT__FLOW_RUN_ID set)
# serve's marker that it is stopping (core/serve.py sets the variable for its worker and creates the file on a stop)
SERVE_STOPPING_ENV = "DFLASH_SERVE_STOPPING_FILE"


@dataclass(frozen=True)
class Stop:
    """Why a run ends before its end: `state` is the final state its flow run and every unfinished task run of it
    take (Cancelled for a stop someone asked for, Crashed for one that happened to it), `cause` says why in words."""

    state: str  # "Cancelled" | "Crashed" ("Failed": the unfinished task runs of a run that failed)
    cause: str

    def prefect_state(self, message: str):
        from prefect.states import Cancelled, Crashed, Failed

        return {"Cancelled": Cancelled, "Failed": Failed}.get(self.state, Crashed)(message=message)


def _cancel_intent() -> bool:
    """Whether the worker that runs this flow run told it (its control channel) that the run is being cancelled."""
    try:
        from prefect._internal.control_listener import get_intent
    except ImportError:  # another Prefect: the server's word alone (_flow_run_cancelling)
        return False
    return get_intent() == "cancel"


def worker_gone() -> int | None:
    """The pid of the Prefect worker that started this flow-run process, once it is gone (None while it lives, and
    outside a worker's flow run)."""
    if not os.environ.get("PREFECT__FLOW_RUN_ID") or STARTED_BY == 1 or os.getppid() == STARTED_BY:
        return None
    return STARTED_BY


def serve_stopping() -> bool:
    marker = os.environ.get(SERVE_STOPPING_ENV)
    return bool(marker) and os.path.exists(marker)


def stop_of(e: BaseException | None) -> Stop | None:
    """The stop under way in this flow-run process, if any (None: `e` is a failure of the run itself): a cancel
    (the UI, `prefect flow-run cancel`), the CLI's Ctrl-C / SIGTERM / SIGHUP, `dflash-pipeline serve` stopped,
    the Prefect worker dead, or a termination signal from elsewhere."""
    from prefect.exceptions import CancelledRun, TerminationSignal

    signal_like = e is None or isinstance(e, (TerminationSignal, KeyboardInterrupt, CancelledRun))
    signal_like = signal_like or type(e).__name__ in ("WorkerStopped", "CrashedRun")
    if _cancel_intent() or (signal_like and _flow_run_cancelling_now()):
        return Stop("Cancelled", "cancelled by the user")
    said = stop_asked()
    if said is not None:
        return Stop("Cancelled", f"`dflash-pipeline run` stopped ({said or 'Ctrl-C'})")  # (runguard's console filter)
    if serve_stopping():  # (before its worker: serve stops the worker's flow runs first, then the worker)
        return Stop("Crashed", "serve was stopped (`dflash-pipeline serve` got a stop signal and stopped its runs)")
    gone = worker_gone()
    if gone is not None:
        from dflash_pipeline import runguard

        how = getattr(runguard, "worker_end", None) or runguard.exit_of(gone)  # (before its watcher, if need be)
        end = f" ({how})" if how else ""
        return Stop("Crashed", f"the worker process died{end} (the Prefect worker, pid {gone}, that ran this flow run)")
    if isinstance(e, (TerminationSignal, CancelledRun)) or type(e).__name__ == "CrashedRun":
        return Stop("Crashed", "the flow-run process was sent SIGTERM (by its worker, or from outside)")
    if isinstance(e, KeyboardInterrupt):
        return Stop("Crashed", "the flow-run process was interrupted (SIGINT)")
    return None


def _flow_run_cancelling_now() -> bool:
    """Whether the server says this flow run is being cancelled (or is)."""
    from types import SimpleNamespace

    from prefect.runtime import flow_run

    return bool(flow_run.id) and _flow_run_cancelling(SimpleNamespace(flow_run_id=flow_run.id))


def ends_stopped(fn):
    """For a stage task's function: a stop that reaches it (the termination signal of a cancel, the CLI's
    KeyboardInterrupt, the worker's death) ends the task run Cancelled or Crashed as its flow run will end, with the
    cause in its message: not Prefect's 'Crash detected!' of an intended stop. The flow then sees the stop
    (CancelledRun or CrashedRun from the task's result) and ends the run the same way."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from prefect.exceptions import TerminationSignal

        try:
            return fn(*args, **kwargs)
        except (TerminationSignal, KeyboardInterrupt, SystemExit, Exception) as e:
            # (SystemExit: a console write to the pipe of a worker that died; rich's console exits on it)
            # (WorkerStopped: the flow stopped this task's extraction worker because the run is being stopped)
            if isinstance(e, Exception) and type(e).__name__ != "WorkerStopped":
                raise
            stop = stop_of(e)
            if stop is None:
                raise
            if stop.state == "Cancelled":  # from here on: no ERROR line for it (IntendedStopLines)
                IntendedStopLines.active = True
            from prefect.runtime import task_run

            return stop.prefect_state(f"{stop.state.lower()}: {stop.cause} (in {task_run.name or 'this task'})")

    return run


def finalize_task_runs(flow_run_id, stop: Stop, message: str) -> list[str]:
    """Every task run of the flow run that the API still shows unfinished (Pending, Running, ...) is set to the
    stop's final state, forced, with `message`: Prefect records a task run's states through events, and a process
    that stops (or a server that stops after it) loses the last of them, which left "train drafter" Running for
    ever beside a Crashed flow run. The state set here is newer than any such event, which therefore cannot undo
    it. Returns the names of the task runs it set."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )

    done = []
    with get_client(sync_client=True) as client:
        open_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=list(ACTIVE_TASK_STATES)))
            ),
        )
        for t in open_runs:
            client.set_task_run_state(t.id, stop.prefect_state(message), force=True)
            done.append(t.name)
    return done


def finalize_orphans(limit: int = 200) -> list[str]:
    """Task runs left unfinished by this pipeline's flow runs that have ended Crashed or Cancelled (a flow-run process
    killed by SIGKILL or the OOM killer reports nothing; serve or the zombie automation then sets its flow run
    Crashed): set to their flow run's final state, naming it. Called at a run's start;
    returns "task name (flow run name)" of those it set."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.states import Cancelled, Crashed

    done = []
    with get_client(sync_client=True) as client:
        orphans = client.read_task_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(ORPHANING_STATES)))
            ),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=list(ACTIVE_TASK_STATES)))
            ),
            limit=limit,
        )
        flows: dict = {}
        for t in orphans:
            if t.flow_run_id is None:
                continue
            if t.flow_run_id not in flows:
                flows[t.flow_run_id] = client.read_flow_run(t.flow_run_id)
            fr = flows[t.flow_run_id]
            kind = Cancelled if fr.state and fr.state.is_cancelled() else Crashed
            why = (fr.state.message or fr.state.name) if fr.state else "ended"
            msg = f"its flow run ended {fr.state.name if fr.state else ''} while it ran: {why}"
            client.set_task_run_state(t.id, kind(message=msg), force=True)
            done.append(f"{t.name} ({fr.name})")
    return done


class IntendedStopLines(logging.Filter):
    """On Prefect's flow-run and task-run loggers, while a stop someone asked for (a cancel, the CLI's stop) ends
    the run: no ERROR line and no traceback for it in the UI. Prefect logs a Cancelled task's "Finished in state
    Cancelled(...)" as an error, and the engine logs the CancelledRun that a Cancelled flow run's result raises as
    "Engine execution exited with unexpected exception" with its traceback: the first becomes INFO, the second is
    dropped (the run's own last line says where it stopped and how it resumes)."""

    active = False  # set by the flow when it ends a run Cancelled

    def filter(self, record: logging.LogRecord) -> bool:
        if not IntendedStopLines.active:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if type(exc).__name__ in ("CancelledRun", "TerminationSignal") or (
            "Engine execution" in record.getMessage() and exc is not None
        ):
            return False
        if record.levelno >= logging.WARNING and "Cancelled" in record.getMessage():
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def quiet_intended_stops() -> None:
    """Install IntendedStopLines once on Prefect's run loggers (it does nothing until a stop ends a run Cancelled)."""
    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.engine", "prefect.flow_engine"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, IntendedStopLines) for f in lg.filters):
            lg.addFilter(IntendedStopLines())
