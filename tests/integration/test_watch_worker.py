"""A flow-run process stops when the Prefect worker that started it dies (runguard.watch_worker): a Prefect 3.9
process worker starts each flow run in a session of its own, so nothing else reaches it after a SIGKILL of the
worker. Here a stand-in worker starts a stand-in flow-run process (PREFECT__FLOW_RUN_ID set, in its own session,
inside `stops_remembered` as the flow is) and is SIGKILLed; the child gets SIGTERM, as from a cancel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.proctree import wait_gone

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from dflash_pipeline import runguard
    def stopped(signum, frame):
        print("SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stopped)
    with runguard.stops_remembered():
        print("watching", flush=True)
        time.sleep(60)
    print("not stopped", flush=True)
    """
)
WORKER = textwrap.dedent(
    """
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, "PREFECT__FLOW_RUN_ID": "x"},
                             stdout=open(sys.argv[2], "w"), start_new_session=True)
    print(child.pid, flush=True)
    child.wait()
    """
)


def test_a_flow_run_process_stops_when_its_worker_is_killed(tmp_path):
    out = tmp_path / "child.out"
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, CHILD, str(out)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(worker.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while "watching" not in out.read_text():
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        t0 = time.monotonic()
        worker.kill()
        worker.wait()
        left = wait_gone([child], timeout=10)
        print(f"flow-run stand-in stopped {time.monotonic() - t0:.1f} s after its worker's SIGKILL")
        assert not left
        assert out.read_text().split() == ["watching", "SIGTERM"], out.read_text()
    finally:
        for pid in (worker.pid, child):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
