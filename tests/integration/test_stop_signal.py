"""A stop signal is never lost (core/runguard.py). Its handler raises KeyboardInterrupt wherever the main thread
is, and a library can drop it there; a Ctrl-C was once lost that way mid-extraction and the run went on to the
end (tests/e2e/test_signals.py[ctrl-c], 1 failure in many runs). The run remembers the stop, and the flow raises
it again before each stage and while it waits for its extraction workers."""

from __future__ import annotations

import signal

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
    with guarded():
        runguard.raise_if_stopped()  # nothing asked for a stop yet
        _dropped(sig)
        with pytest.raises(KeyboardInterrupt) as e:
            PrefectRunner.probe(cfg)  # the next stage does not start
        assert str(e.value) == said  # the CLI prints "stopped (Ctrl-C)" for "", else "stopped (SIGTERM)"
        assert not list(tmp_path.iterdir()), "the stage ran"
        with pytest.raises(KeyboardInterrupt):
            PrefectRunner.extract(cfg, None, None)  # nor does extraction (checked before it plans workers)
    runguard.raise_if_stopped()  # a later run in the same process starts afresh
    assert signal.getsignal(sig) is before
