"""`dflash-pipeline serve`: a local Prefect server, the `dflash` process work pool, the deployments and a worker,
kept up until a signal stops them.

Plain subprocesses of the `prefect` CLI (no Prefect imports), started and stopped by core/local_prefect.py's
`LocalPrefect` (also used by the end-to-end deployment test); the database's URL is read and checked by
core/prefect_database.py. Every started process runs in its own process group and is stopped again by
`LocalPrefect.stop()` (SIGTERM to the group, SIGKILL after STOP_GRACE_S): the worker's group holds its flow-run
processes, and their extraction workers exit when their flow-run process dies (extraction/worker_main.py).

No run is left Running in the database, holding its deployment's only concurrency slot, because the process that
would have reported its end is gone:
- `serve` stops on SIGINT, SIGTERM and SIGHUP in order: its worker's flow runs first (SIGTERM to each flow-run
  process, with a marker file that says serve is stopping: each saves its checkpoint, publishes its summary, ends
  its task runs and reports itself Crashed, "serve was stopped", which frees its slot; a Prefect worker that stops
  would SIGKILL them), then the worker; what is left after STOP_GRACE_S gets SIGKILL and is set Crashed through the
  API, with its task runs; then the server.
- Every ORPHAN_POLL_S, task runs the database still shows Running (or Pending) whose flow run has ended are set to
  that end (a flow-run process killed by SIGKILL or the OOM killer reports nothing: its worker sets the flow run
  Crashed, and its task runs stayed Running).
- A Prefect worker that dies (killed, OOM) is restarted: its flow runs stop on their own (watch_worker), and
  `settle_runs` sets Crashed those the database still shows active once their processes are gone.
- After a SIGKILL of `serve` nothing could write the database (its server died with it: parent-death signal;
  the guard stops the rest). The next `serve` on this host finds the runs its worker (WORKER_NAME, one name per
  host) had taken and sets them Crashed before it starts a new worker.
- On PostgreSQL (the team server, where workers on other machines run flows) Prefect's zombie detection covers a
  worker machine that dies: flow runs of these deployments send heartbeats every HEARTBEAT_S
  (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, deployments/prefect.yaml) and the automation ZOMBIE_AUTOMATION (a proactive
  trigger of the server's triggers service) sets a run Crashed when ZOMBIE_WITHIN_S pass without one.
Only a dead server ends `serve`.

The server's database is SQLite under the Prefect home (one person, one box) unless a PostgreSQL URL is given
(`serve --database`, or Prefect's own PREFECT_SERVER_DATABASE_CONNECTION_URL / PREFECT_API_DATABASE_CONNECTION_URL):
the team setup, where one server takes many workers' runs. The URL is checked before the server starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
import urllib.error
from pathlib import Path

from dflash_pipeline.deployments import PREFECT_FILE
from dflash_pipeline.local_prefect import ORPHAN_POLL_S, LocalPrefect, signal_group
from dflash_pipeline.prefect_database import database_url, redact

# serve's own worker, one name per host: a restarted serve recognizes the runs its killed predecessor had taken.
WORKER_NAME = f"dflash-serve@{socket.gethostname()}"


class Stop(Exception):  # noqa: N818 - a request, not an error
    """SIGINT / SIGTERM / SIGHUP received: stop what `serve` started."""


def _prefect_command() -> str:
    """How this shell reaches this environment's `prefect`: the bare name when PATH finds this one, else its path
    (a venv that is not activated)."""
    mine = Path(sys.executable).parent / "prefect"
    found = shutil.which("prefect")
    if not mine.exists() or (found and Path(found).resolve() == mine.resolve()):
        return "prefect"
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)


def _end_orphans(lp: LocalPrefect) -> None:
    """The task runs that a killed flow-run process left Running beside its ended flow run end too (best effort)."""
    try:
        lp.end_orphaned_task_runs()
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"could not end the task runs of ended flow runs ({e})", file=sys.stderr, flush=True)


def _raise_stop(signum, frame) -> None:
    raise Stop(signal.Signals(signum).name)


def serve(port: int, home: str | Path | None = None, database: str | None = None, host: str = "127.0.0.1") -> int:
    """`dflash-pipeline serve`: everything for the UI path, until Ctrl-C, SIGTERM or SIGHUP."""
    home = Path(home).expanduser().absolute() if home else None
    lp = LocalPrefect(port=port, home=home, database=database_url(database), host=host, die_with_parent=True)
    # (SIGINT too: a serve started with `&` from a script inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: a fresh-user check's `kill -INT` did nothing)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        lp.start_server()
        # What a killed serve left: the runs its worker had taken, Running in the database with no process.
        for r in lp.settle_runs(WORKER_NAME, "the dflash-pipeline serve that ran it was killed"):
            print(f"flow run {r['name']} ({r['id']}) was left {r['state_type']} by a killed serve: set Crashed")
        lp.apply_deployments()
        if lp.on_postgres:
            lp.ensure_zombie_automation()
        lp.start_worker(WORKER_NAME)
        where = home or os.environ.get("PREFECT_HOME", "~/.prefect")
        db = redact(lp.database) if lp.database else f"SQLite under {where}"
        print(
            f"Prefect UI: http://127.0.0.1:{port}  (API {lp.api_url}; database {db}; Prefect home "
            f"{where}; logs under {lp.log_dir})\n"
            f"deployments: dflash-pipeline/full, extract-only, train-only, nightly (02:00 UTC), from {PREFECT_FILE}\n"
            f"trigger: PREFECT_API_URL={lp.api_url} {_prefect_command()} deployment run "
            "'dflash-pipeline/extract-only' "
            "-p overrides='{\"data.max_samples\": 100}'\nCtrl-C (or SIGTERM / SIGHUP) stops the worker, its runs "
            "(they end Crashed), then the server.",
            flush=True,
        )
        orphans_at = 0.0
        while True:
            time.sleep(1)
            if time.monotonic() - orphans_at >= ORPHAN_POLL_S:  # killed flow-run processes' task runs (issue 50)
                orphans_at = time.monotonic()
                _end_orphans(lp)
            if lp.server is None or lp.server.poll() is not None:
                print(f"the Prefect server exited; stopping (see {lp.log_dir}/server.log)", file=sys.stderr)
                return 1
            worker = lp.worker
            if worker is not None and worker.poll() is not None:
                print(
                    f"the Prefect worker (pid {worker.pid}) exited with {worker.returncode} (see {lp.log_dir}/"
                    "worker.log); its flow runs stop and end Crashed; starting a new one",
                    file=sys.stderr,
                    flush=True,
                )
                lp.procs.remove(worker)
                signal_group(worker.pid, signal.SIGKILL)  # anything left in its group
                # Each flow-run process leads a session of its own and stops when it sees its worker gone
                # (runguard.watch_worker: SIGTERM; Prefect reports it Crashed). What the database still shows
                # active once those processes are gone is set Crashed here, which frees the deployment's slot.
                for r in lp.settle_runs(WORKER_NAME, f"its Prefect worker (pid {worker.pid}) died"):
                    print(f"flow run {r['name']} ({r['id']}) set Crashed", file=sys.stderr, flush=True)
                lp.start_worker(WORKER_NAME)
    except (KeyboardInterrupt, Stop) as e:
        why = "Ctrl-C" if isinstance(e, KeyboardInterrupt) or str(e) == "SIGINT" else e  # (not "KeyboardInterrupt")
        print(f"{why}: stopping the server, the worker and their runs", file=sys.stderr)
        return 0
    finally:
        lp.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
