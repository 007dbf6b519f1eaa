"""A stop signal is never lost (core/runguard.py). Its handler raises KeyboardInterrupt wherever the main thread
is, and a library can drop it there; a Ctrl-C was once lost that way mid-extraction and the run went on to the
end (tests/e2e/test_signals.py[ctrl-c], 1 failure in many runs). The run remembers the stop, and the flow raises
it again before each stage and while it waits for its extraction workers."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time

import pytest

from dflash_pipeline import runguard
from dflash_pipeline.config import load_config


@pytest.fixture
def guarded(monkeypatch):
    # The guard process (it stops what a SIGKILLed CLI leaves) watches the test process itself here: not wanted.
    monkeypatch.setattr(runguard, "ensure_guard", lambda: None)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # no temporary server to isolate
    return runguard.guarded_run


def _dropped(sig: int) -> None:
    """The signal arrives while a library runs, and the library drops the KeyboardInterrupt."""
    try:
        signal.raise_signal(sig)
    except KeyboardInterrupt:
        pass


@pytest.mark.parametrize(
    ("sig", "said"),
    [(signal.SIGINT, ""), (signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP")],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_a_dropped_stop_is_raised_again_by_the_flow(guarded, sig, said, tmp_path):
    from dflash_pipeline.flows.pipeline import PrefectRunner

    before = signal.getsignal(sig)
    cfg = load_config(None, {"output_dir": str(tmp_path)})
    runner = PrefectRunner()
    with guarded():
        runguard.raise_if_stopped()  # nothing asked for a stop yet
        _dropped(sig)
        with pytest.raises(KeyboardInterrupt) as e:
            runner.probe(cfg)  # the next stage does not start
        assert str(e.value) == said  # the CLI prints "stopped (Ctrl-C)" for "", else "stopped (SIGTERM)"
        assert not list(tmp_path.iterdir()), "the stage ran"
        with pytest.raises(KeyboardInterrupt):
            runner.extract(cfg, None, None)  # nor does extraction (checked before it plans workers)
    runguard.raise_if_stopped()  # a later run in the same process starts afresh
    assert signal.getsignal(sig) is before


def test_a_dropped_sigterm_inside_a_flow_run_is_remembered(guarded, prefect_harness, monkeypatch):
    """Inside a flow run Prefect's own SIGTERM handler is in place (it raises TerminationSignal): the flow's
    stops_remembered records the signal before handing it on."""
    from prefect import flow
    from prefect.exceptions import TerminationSignal

    monkeypatch.setenv("PREFECT_API_URL", prefect_harness)
    seen = {}

    @flow
    def stopped_once():
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        with runguard.stops_remembered():
            try:
                signal.raise_signal(signal.SIGTERM)
            except TerminationSignal:
                pass  # dropped
            runguard.raise_if_stopped()

    with guarded():
        ours = signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            stopped_once()
        assert seen["handler"] is not ours  # Prefect's, during the flow run
        assert signal.getsignal(signal.SIGTERM) is ours


def _futures(n: int) -> list[concurrent.futures.Future]:
    return [concurrent.futures.Future() for _ in range(n)]


def test_gather_returns_in_order_and_fails_at_the_first_failure():
    from dflash_pipeline.flows.pipeline import gather

    fs = _futures(3)
    for i in (2, 0, 1):
        fs[i].set_result(i)
    assert gather(fs, poll_s=0.05) == [0, 1, 2]

    slow, failing = _futures(2)  # one worker still extracting, another out of retries
    threading.Timer(0.2, failing.set_exception, [RuntimeError("worker on cuda:1 crashed")]).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cuda:1"):
        gather([slow, failing], poll_s=0.05)
    assert time.monotonic() - t0 < 5  # not after the slow one: it never finishes here


def test_gather_acts_on_a_dropped_stop_while_workers_run(guarded):
    from dflash_pipeline.flows.pipeline import gather

    never = _futures(2)
    with guarded():
        threading.Timer(0.2, signal.raise_signal, [signal.SIGINT]).start()
        t0 = time.monotonic()
        try:  # the handler's KeyboardInterrupt lands in gather's wait: the usual path
            gather(never, poll_s=0.05)
        except KeyboardInterrupt:
            pass
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):  # and if it had been dropped, the next poll raises it again
            gather(never, poll_s=0.05)
        assert time.monotonic() - t0 < 1
