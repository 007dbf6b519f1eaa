"""Stopping `dflash-pipeline run` during extraction (issue 16): Ctrl-C (SIGINT to the terminal's process group),
SIGTERM and SIGKILL of the CLI, and SIGKILL of an extraction worker. Within STOP_BOUND_S no process the run started
is left (the process tree is walked: extraction workers, their store-writer processes, Prefect's temporary uvicorn
server, the guard), no worker spec file is left, the store verifies, and a rerun completes bit-identical to an
uninterrupted extraction.

The CLI runs from another directory with a relative output_dir: exactly one store is written, where the user meant.
Each forward is slowed down (tests/slowdown) so that the signal surely lands mid-extraction. The stopped run starts
Prefect's temporary server, as a user's first run does (it must be gone too).

The variants share one run (issue 32: the suite's time): each starts the same command in the same directory, so it
resumes what the previous stop left, extracts further and is stopped its own way. The rerun, after the last stop, is
what the CLI tells the user: the same command again (reporting to the session's Prefect server, PREFECT_API_URL, as
with `dflash-pipeline serve`: each stopped run already started a temporary server); what a rerun has to find is the
store the stops left, and that is what the stops decide. (Workers ignore SIGINT and stop on their parent's SIGTERM
after Ctrl-C and SIGTERM alike; after a SIGKILL of the CLI or of the worker, the worker died by SIGKILL, its
parent-death signal.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.verify import verify_version
from tests.helpers import KILL_OVERRIDES, assert_same_store, snapshot
from tests.proctree import alive, descendants, wait_gone

ROOT = Path(__file__).resolve().parents[2]
# Bound on stopping: the flow stops its workers (SIGTERM, SIGKILL after procs.STOP_GRACE_S = 10 s), then Prefect's
# temporary server stops (5 s); after a SIGKILL of the CLI, workers exit within 1 s of their parent's death and the
# guard stops the rest (SIGTERM, SIGKILL after 5 s). Measured on a loaded 2-core machine: see the printed times.
STOP_BOUND_S = 30.0
OVERRIDES = {
    **KILL_OVERRIDES,
    "extract.devices": "cpu",
    "extract.isolation": "process",
    "extract.task_retries": 0,
    "stages": ["prepare", "probe", "extract", "validate"],
    "validate.recompute_samples": 0,
}


def _cli(cwd: Path, tmpdir: Path, slow: bool, api_url: str | None = None) -> subprocess.Popen:
    sets = [f"--set={k}={json.dumps(v)}" for k, v in {**OVERRIDES, "output_dir": "run"}.items()]
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)  # the run's own temporary server, as a user's first run has
    if api_url:
        env["PREFECT_API_URL"] = api_url
    if slow:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "slowdown"), env.get("PYTHONPATH", "")])
        env["DFLASH_TEST_FORWARD_SLEEP"] = "0.4"
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.cli", "run", *sets],
        cwd=cwd,
        env=env,
        stdout=open(cwd / "cli.out", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        preexec_fn=_foreground_signals,  # not the caller's dispositions (a background shell ignores SIGINT)
    )


def _foreground_signals() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job has it (Python then installs its Ctrl-C
    handler; one started from a background shell inherits SIG_IGN and would never see the test's Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _worker_pids(pid: int) -> dict[int, str]:
    return {p: c for p, c in descendants(pid).items() if "extraction.worker_main" in c}


def _committed(store: Store) -> int:
    """Tokens committed to v0001 so far (0 before the run has planned it)."""
    try:
        return sum(store.commit_record("v0001", u)["committed_tokens"] for u in store.units("v0001"))
    except (OSError, KeyError, ValueError):
        return 0


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """The one run the stop variants share (issue 32: the suite's time): each variant starts the same command in the
    same directory, so it resumes what the previous stop left, extracts further and is stopped its own way; after the
    last one, test_the_stopped_run_resumes_bit_identical runs the command again to the end. One store stopped four
    ways and resumed each time, instead of four runs each finished by its own rerun."""
    d = tmp_path_factory.mktemp("stopped_run")
    (d / "tmp").mkdir()
    return d


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill", "worker-sigkill"])
def test_stopping_a_run_leaves_no_process_and_a_clean_store(how, stopped_run):
    tmp_path, tmpdir = stopped_run, stopped_run / "tmp"
    store = Store(tmp_path / "run" / "store")
    before = _committed(store)  # what the previous variants' stops left: this run resumes it
    log = tmp_path / "cli.out"
    offset = log.stat().st_size if log.exists() else 0  # the log of every variant's run, appended
    cli = _cli(tmp_path, tmpdir, slow=True)
    try:
        deadline = time.monotonic() + 300
        while not (workers := _worker_pids(cli.pid)):
            assert cli.poll() is None, (tmp_path / "cli.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "no extraction worker started"
            time.sleep(0.2)
        while _committed(store) <= before:  # this run's worker has extracted and committed more
            assert cli.poll() is None and time.monotonic() < deadline, (tmp_path / "cli.out").read_text()[-3000:]
            time.sleep(0.2)
        started = descendants(cli.pid)  # workers, writer processes, uvicorn, the guard
        assert any("uvicorn" in c for c in started.values()), started
        t0 = time.monotonic()
        if how == "ctrl-c":
            os.killpg(cli.pid, signal.SIGINT)  # what a terminal sends its foreground job
            while b"stopped (" not in log.read_bytes()[offset:] and cli.poll() is None:
                assert time.monotonic() - t0 < STOP_BOUND_S, log.read_bytes()[offset:][-3000:]
                time.sleep(0.05)
            try:  # an impatient second Ctrl-C while it shuts down (was a traceback from Prefect's exit handler)
                os.killpg(cli.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        elif how == "sigterm":
            cli.send_signal(signal.SIGTERM)
        elif how == "sigkill":
            cli.send_signal(signal.SIGKILL)
        else:
            os.kill(next(iter(workers)), signal.SIGKILL)
        rc = cli.wait(timeout=STOP_BOUND_S if how != "worker-sigkill" else 120)
        left = wait_gone(started, timeout=max(0.0, STOP_BOUND_S - (time.monotonic() - t0)))
        elapsed = time.monotonic() - t0
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    out = log.read_bytes()[offset:].decode(errors="replace")  # this variant's run only
    print(f"{how}: CLI exited {rc}, every process it started gone {elapsed:.1f} s after the signal")
    assert not left, f"{how}: still running after {STOP_BOUND_S} s: {left}"
    assert not alive(workers)
    assert not list(tmpdir.glob("*.json")), "a worker spec file was left behind"
    if how in ("ctrl-c", "sigterm"):
        said = "stopped (Ctrl-C)" if how == "ctrl-c" else "stopped (SIGTERM)"
        assert rc == 130 and said in out and "Traceback" not in out and "Exception ignored" not in out, out[-3000:]
        # the stop's one line: not Prefect's failure of the extraction task it stopped, nor a warning about it
        assert "error:" not in out and "stopped extraction workers" not in out, out[-3000:]
    elif how == "sigkill":
        assert rc == -signal.SIGKILL
    else:  # the run fails, naming the worker and its signal
        assert rc == 1 and "error: extraction worker on cpu (pid" in out and "SIGKILL" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    assert store.current() is None  # nothing half-done was published


def test_the_stopped_run_resumes_bit_identical(stopped_run, clean_extraction, prefect_harness):
    """After the stops, what the CLI tells the user: the same command again. It reports to the session's Prefect
    server (PREFECT_API_URL, as with `dflash-pipeline serve`: a temporary server's start-up was proven by each stop)."""
    tmp_path, tmpdir = stopped_run, stopped_run / "tmp"
    store = Store(tmp_path / "run" / "store")
    rerun = _cli(tmp_path, tmpdir, slow=False, api_url=prefect_harness)
    try:
        assert rerun.wait(timeout=400) == 0, (tmp_path / "cli.out").read_text()[-3000:]
    finally:
        if rerun.poll() is None:
            os.killpg(rerun.pid, signal.SIGKILL)
    assert [p.name for p in tmp_path.rglob("store") if p.is_dir()] == ["store"]  # one store, under cwd/run
    assert store.current() == "v0001" and verify_version(store, "v0001").ok
    assert_same_store(snapshot(store, "v0001"), snapshot(Store(clean_extraction.store), "v0001"))
