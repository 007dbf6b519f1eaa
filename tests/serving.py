"""`dflash-pipeline serve` as a user starts it, for tests and benchmarks: a handle for its API and CLI, stopped
whatever happens (SIGTERM to serve, which stops its server, worker and their runs; SIGKILL of every process
group it started if that did not end it)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.local_prefect import POOL, LocalPrefect
from tests.proctree import descendants, wait_gone

ROOT = Path(__file__).resolve().parents[1]
# For an installed package (tests/e2e/conftest.py: wheel_env): nothing of a checkout on the path.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

# What a server on a healthy database never logs: SQLite's lock, PostgreSQL connection trouble, a full pool.
DB_ERRORS = re.compile(
    r"database is locked|OperationalError|InterfaceError|ConnectionDoesNotExist|TooManyConnections|"
    r"too many clients|could not connect|Connection refused|connection was closed|QueuePool limit|"
    r"CannotConnectNow|DeadlockDetected|deadlock detected",
    re.IGNORECASE,
)
# What a worker or the CLI logs when an API call failed (after Prefect's own retries, or before them).
API_ERRORS = re.compile(
    r"HTTPStatusError|Server error '5\d\d|status code 5\d\d|ReadTimeout|ConnectError|RemoteProtocolError"
)


# Run overrides for the tiny embedded target on CPU: extraction without recompute, and a two-step training.
SMALL = {"extract.devices": "cpu", "layers.num_draft_layers": 2, "validate.recompute_samples": 0}
TINY_TRAINING = {
    "train.max_steps": 2,
    "train.block_size": 4,
    "train.anchors_per_sample": 8,
    "train.num_workers": 0,
    "evaluate.num_prompts": 1,
    "evaluate.max_new_tokens": 4,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(
    home: Path,
    database: str | None = None,
    env: dict[str, str | None] | None = None,
    timeout: float = 400,
    python: str | Path = sys.executable,
    workdir: Path = ROOT,
    sigint_ignored: bool = False,
) -> Iterator[LocalPrefect]:
    """`dflash-pipeline serve [--database URL]` on a free port with its own Prefect home, run by `python` (another
    environment's, e.g. a wheel's) from `workdir`; `env` adds to (None: removes from) this environment. Yields a
    LocalPrefect for the same server (its `serve_proc`, `startup_s`; `start_worker()` adds workers that `stop()`
    ends). `sigint_ignored`: started as a shell script's `serve &` is, with SIGINT ignored."""
    lp = LocalPrefect(port=free_port(), home=home, workdir=workdir)
    log = home / "serve.out"
    cmd = [str(python), "-m", "dflash_pipeline.cli", "serve", "--port", str(lp.port), "--home", str(home)]
    if database:
        cmd += ["--database", database]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=workdir,
        env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
    )
    lp.serve_proc = proc
    try:
        while "Prefect UI:" not in log.read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"serve did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        lp.startup_s = time.monotonic() - t0
        yield lp
    finally:
        stop_serve(lp)


def stop_serve(lp: LocalPrefect) -> None:
    """SIGTERM to serve (it stops what it started), then make sure: every process below it is gone."""
    lp.stop()  # workers this handle added
    proc = lp.serve_proc
    if proc.poll() is None:
        started = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in wait_gone(started, timeout=30):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def logs(lp: LocalPrefect) -> dict[str, str]:
    """Every log this server's processes wrote: name -> text."""
    return {p.name: p.read_text(errors="replace") for p in sorted(lp.log_dir.glob("*.log"))}


def api(lp: LocalPrefect, fn):
    """Call `fn(client)` against this server, whatever else the process has configured (a pytest session's
    ephemeral harness sets PREFECT_API_URL in a settings context, above the environment)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go():
        async with get_client() as client:
            return await fn(client)

    def run():
        with temporary_settings(updates={PREFECT_API_URL: lp.api_url}):
            return asyncio.run(go())

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    with ThreadPoolExecutor(1) as pool:  # inside a running loop (Playwright's sync API has one): a thread of its own
        return pool.submit(run).result()


def wait_final(lp: LocalPrefect, run_ids: list, timeout: float) -> list:
    """The flow runs, once every one is in a final state (TimeoutError naming those that are not)."""

    async def go(client):
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        deadline = time.monotonic() + timeout
        while True:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(run_ids))))
            if len(runs) == len(run_ids) and all(r.state and r.state.is_final() for r in runs):
                return runs
            if time.monotonic() > deadline:
                left = {str(r.id): r.state.name for r in runs if not (r.state and r.state.is_final())}
                raise TimeoutError(f"{len(left)} flow runs not final after {timeout:.0f} s: {left}")
            await asyncio.sleep(0.5)

    return api(lp, go)


# The load: tiny extractions (4 samples of the embedded data, 2 layers, the worker in the flow's process).
LOAD_OVERRIDES = {
    "data.max_samples": 4,
    "extract.devices": "cpu",
    "extract.isolation": "thread",
    "layers.num_draft_layers": 2,
    "validate.recompute_samples": 0,
}
# A waiting run asks for the deployment's slot again after this many seconds (Prefect's default: 30).
LOAD_SERVER_ENV = {"PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "5"}
STORE_BUSY = "is in use by another run"  # the one failure a run of this load may have: its store's lock


@dataclass
class LoadResult:
    runs: int
    workers: int
    stores: list[Path]
    wall_s: float
    states: dict[str, int]  # final state name -> runs
    failures: dict[str, str]  # run id -> state message, for runs that did not complete
    not_final: dict[str, str]  # run id -> state name (lost or stuck runs: none expected)
    max_running: int  # most runs running at one instant (from their start and end times)
    db_errors: list[str]  # server log lines naming database lock / connection trouble
    api_errors: list[str]  # worker log lines naming failed API calls

    def figures(self) -> dict:
        return {
            "runs": self.runs,
            "workers": self.workers,
            "wall_s": round(self.wall_s, 1),
            "s_per_run": round(self.wall_s / self.runs, 2),
            "states": self.states,
            "max_running": self.max_running,
            "not_final": len(self.not_final),
            "db_errors": len(self.db_errors),
            "api_errors": len(self.api_errors),
        }


def run_load(
    lp: LocalPrefect, out: Path, runs: int = 20, workers: int = 3, stores: int = 10, timeout: float = 1500
) -> LoadResult:
    """`runs` flow runs of the extract-only deployment, submitted at once, on `workers` Prefect workers (serve's
    and workers-1 more), `runs / stores` runs per store. The deployment's limit is raised to `workers`, as an
    operator does for a team (UI: Deployments > extract-only > Edit): two runs on one store may then meet, and
    the second fails at once on the store's lock, naming the first."""
    from prefect.client.schemas.actions import DeploymentUpdate

    for i in range(workers - 1):
        lp._spawn(f"worker-extra{i + 1}", "worker", "start", "--pool", POOL, "--type", "process")
    dirs = [out / f"store{i}" for i in range(stores)]

    async def submit(client):
        d = await client.read_deployment_by_name("dflash-pipeline/extract-only")
        await client.update_deployment(d.id, DeploymentUpdate(concurrency_limit=workers))
        ids = []
        for i in range(runs):
            params = {"overrides": {**LOAD_OVERRIDES, "output_dir": str(dirs[i % stores])}}
            ids.append(str((await client.create_flow_run_from_deployment(d.id, parameters=params)).id))
        return ids

    t0 = time.monotonic()
    ids = api(lp, submit)
    try:
        final = wait_final(lp, ids, timeout=timeout)  # generous: a shared 2-core machine can be 5x slower
    except TimeoutError:
        final = []
    wall = time.monotonic() - t0

    async def read(client):
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        return await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))

    found = final or api(lp, read)
    not_final = {str(r.id): r.state.name for r in found if not r.state.is_final()}
    not_final |= {i: "lost" for i in set(ids) - {str(r.id) for r in found}}
    states: dict[str, int] = {}
    for r in found:
        states[r.state.name] = states.get(r.state.name, 0) + 1
    failures = {str(r.id): r.state.message or "" for r in found if r.state.is_final() and not r.state.is_completed()}
    events = sorted(
        [(r.start_time, 1) for r in found if r.start_time] + [(r.end_time, -1) for r in found if r.end_time]
    )
    running = max_running = 0
    for _, step in events:
        running += step
        max_running = max(max_running, running)
    texts = logs(lp)
    db_errors = [line for line in texts.get("server.log", "").splitlines() if DB_ERRORS.search(line)]
    api_errors = [
        f"{name}: {line}"
        for name, text in texts.items()
        if name.startswith("worker")
        for line in text.splitlines()
        if API_ERRORS.search(line)
    ]
    return LoadResult(runs, workers, dirs, wall, states, failures, not_final, max_running, db_errors, api_errors)
