"""An error found inside a run is printed once, by the CLI: the console leaves out Prefect's lines that repeat it
(core/runguard.py). Logic only: Prefect's records are made by hand, no server."""

from __future__ import annotations

import logging

from dflash_pipeline import runguard
from dflash_pipeline.drafter.regen_output import RegenerateError


class _FailedState:
    """A failed task run's state, as a retry condition gets it."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def result(self, raise_on_failure: bool = True):
        raise self.exc


def _shown(message: str) -> bool:
    record = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, message, None, None)
    return runguard._ConsoleOnce().filter(record)


def test_a_user_error_a_task_with_retries_does_not_retry_is_not_repeated():
    """regenerate (and train) have retries: their retry condition refuses a user error, and Prefect then logs no
    record with the exception, only the task's 'Finished in state Failed(...)'; that line came before the CLI's own
    `error: ...` (`error: Finished in state Failed("Task run encountered an exception RegenerateError: ...")`)."""
    from dflash_pipeline.tasks.common import retry_unless_user_error

    err = RegenerateError(
        "cannot reach the OpenAI-compatible server at http://127.0.0.1:4999/v1 (ConnectError: All connection "
        "attempts failed; waited 0 s, regenerate.server_wait_s). Start the server (docs/DRAFTER.md: 'Regenerating "
        "with vLLM or SGLang') or set regenerate.base_url to where it listens"
    )
    runguard._reported.clear()
    finished = f"Finished in state Failed({f'Task run encountered an exception RegenerateError: {err}'!r})"
    assert _shown(finished)  # nothing reported yet: Prefect's line is all there is
    assert retry_unless_user_error(None, None, _FailedState(err)) is False
    assert not _shown(finished) and _shown("Finished in state Failed('Task run encountered an exception: other')")
    assert retry_unless_user_error(None, None, _FailedState(OSError("transient"))) is True  # retried: not reported
    assert not any("transient" in t for t in runguard._reported)
    runguard._reported.clear()


def _record_with(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except type(exc):
        pass
    info = (type(exc), exc, exc.__traceback__)
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "Encountered exception", None, info)


def test_a_deployment_run_logs_a_user_error_as_its_line_and_any_other_error_with_its_traceback():
    """A flow run the CLI does not guard (a deployment's) adds the filter once; the formatted record of a user
    error is its line only, a real crash keeps its traceback."""
    from dflash_pipeline.errors import ConfigError

    lg = logging.getLogger("prefect.flow_runs")
    before = list(lg.filters)
    for f in before:  # a flow run earlier in this process added it (it stays for the process)
        if isinstance(f, runguard._UserErrorLine):
            lg.removeFilter(f)
    try:
        runguard.quiet_user_errors()
        runguard.quiet_user_errors()
        added = [f for f in lg.filters if isinstance(f, runguard._UserErrorLine)]
        assert len(added) == 1
        fmt = logging.Formatter("%(message)s")
        user = _record_with(ConfigError("overrides sets stages=[...]: drop stages from overrides"))
        crash = _record_with(ZeroDivisionError("division by zero"))
        assert added[0].filter(user) and added[0].filter(crash)  # both are logged
        assert fmt.format(user) == "Encountered exception"
        assert "Traceback" in fmt.format(crash) and "ZeroDivisionError" in fmt.format(crash)
    finally:
        for f in lg.filters[:]:
            lg.removeFilter(f)
        for f in before:
            lg.addFilter(f)
