"""LocalPrefect: the Prefect server, work pool, deployments and worker as process groups it starts and stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.deployments import PREFECT_FILE
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.prefect_database import check_database
from dflash_pipeline.runguard import _descendants, _stat, _still, parent_death_signal

POOL = "dflash"
STOP_GRACE_S = 20.0
ACTIVE_STATES = ("PENDING", "RUNNING", "CANCELLING")
ACTIVE_TASK_STATES = ("PENDING", "RUNNING", "SCHEDULED", "CANCELLING", "PAUSED")
# The flow runs whose unfinished task runs are orphans to end: a Completed or Failed run's process lived to end its
# own, and a task's last state can reach the server a moment after its flow run's (Prefect records task-run states
# as events), so forcing those could turn a finished task Crashed.
ORPHANING_STATES = ("CRASHED", "CANCELLED")
FLOW_NAME = "dflash-pipeline"  # the flow's name (flows/pipeline.py): orphans of other flows on a shared server stay
ORPHAN_POLL_S = 2.0  # how often serve ends the task runs that killed flow-run processes left Running
# Zombie detection (PostgreSQL only): the heartbeat period is set for the deployments' flow runs in
# deployments/prefect.yaml (job variable env); a run is crashed after ZOMBIE_WITHIN_S without a heartbeat (Prefect's
# default period is 180 s: the automation matches only runs tagged `dflash`, whose deployments set HEARTBEAT_S).
HEARTBEAT_S = 30
ZOMBIE_WITHIN_S = 120
ZOMBIE_AUTOMATION = "dflash: crash flow runs whose heartbeats stopped"

# SQLite under the server's start-up burst (migrations, services, the CLI's first calls) answers "database is
# locked" when a writer waits longer than the driver's timeout; give it room, and skip the services we never use.
SERVER_DEFAULTS = {
    "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "30",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_LOGGER_ENABLED": "false",
}
# On PostgreSQL the triggers service runs: zombie detection is an automation (core/serve.py's docstring).
POSTGRES_DEFAULTS = {**SERVER_DEFAULTS, "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true"}


def check_api(url: str, timeout: float = 5.0) -> None:
    """Raise a clear error when PREFECT_API_URL points nowhere (instead of a long hang in the flow)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as r:
            if r.status == 200:
                return
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise PipelineError(
            f"the Prefect API at PREFECT_API_URL={url} is unreachable ({e}). Start a server "
            "(dflash-pipeline serve), fix the URL, or unset PREFECT_API_URL to run with a "
            "temporary local server"
        ) from None
    raise PipelineError(f"the Prefect API at {url} answered /health with an error")


def check_port_free(host: str, port: int) -> None:
    """Bind `host:port` as the server will (SO_REUSEADDR, as uvicorn does); in use is an error naming the fix."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PipelineError(
                f"port {port} on {host} is in use ({e.strerror}): another Prefect server or `serve` is running "
                "there; stop it, or choose another port with --port"
            ) from None


@dataclass
class LocalPrefect:
    port: int = 4200
    home: Path | None = None  # PREFECT_HOME; None = the user's default
    database: str | None = None  # the server's PostgreSQL URL (see `database_url`); None = SQLite under home
    host: str = "127.0.0.1"  # the server's bind address: 0.0.0.0 for workers on other machines
    # Where flow runs start, so relative paths in a run's config resolve as they would for `dflash-pipeline run`.
    workdir: Path = field(default_factory=Path.cwd)
    # serve's own: what it starts gets SIGTERM from the kernel when serve dies, even by SIGKILL (spawn from the
    # main thread only: the signal follows the thread that started the child).
    die_with_parent: bool = False
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def on_postgres(self) -> bool:
        return bool(self.database and self.database.startswith("postgresql"))

    def env(self) -> dict[str, str]:
        env = {
            **(POSTGRES_DEFAULTS if self.on_postgres else SERVER_DEFAULTS),
            **os.environ,
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "DFLASH_WORKDIR": str(self.workdir),
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_SERVER_API_HOST": self.host,
            # created when serve stops: its runs then say "serve was stopped" (tasks/common.py, serve_stopping)
            "DFLASH_SERVE_STOPPING_FILE": str(self.stopping_marker),
        }
        if self.home:
            env["PREFECT_HOME"] = str(self.home)
        if self.database:
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.database
        return env

    def _prefect(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "prefect", *args]
        res = subprocess.run(cmd, env=self.env(), cwd=self.workdir, capture_output=True, text=True, timeout=300)
        if check and res.returncode != 0:
            raise PipelineError(f"`prefect {' '.join(args)}` failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    @property
    def stopping_marker(self) -> Path:
        """Exists while this serve stops its runs (they name the cause: tasks/common.py, serve_stopping)."""
        return self.log_dir / f"serve-{os.getpid()}-stopping"

    @property
    def log_dir(self) -> Path:
        return Path(self.home or self.workdir / "runs") / "logs"

    def _spawn(self, log_name: str, *args: str, death_signal: int = signal.SIGTERM) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{log_name}.log", "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "prefect", *args],
            env=self.env(),
            cwd=self.workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_signal(os.getpid(), death_signal) if self.die_with_parent else None,
        )
        self.procs.append(p)
        return p

    def start_server(self, timeout: float = 120) -> None:
        if self.database:
            check_database(self.database)
        check_port_free(self.host, self.port)  # else the health check below would find the server holding it
        p = self._spawn("server", "server", "start", "--host", self.host, "--port", str(self.port))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise PipelineError(
                    f"prefect server exited with {p.returncode}; see its log {self.log_dir}/server.log "
                    f"(is port {self.port} in use? choose another with --port)"
                )
            try:
                check_api(self.api_url, timeout=2)
                return
            except PipelineError:
                time.sleep(1)
        raise PipelineError(
            f"prefect server did not answer on {self.api_url} within {timeout:.0f} s; see {self.log_dir}/server.log "
            "(a loaded machine: try again, or start it once by hand with `prefect server start`)"
        )

    def apply_deployments(self) -> None:
        pools = self._prefect("work-pool", "ls", check=False).stdout
        if POOL not in pools:
            self._prefect("work-pool", "create", POOL, "--type", "process")
        self._prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE))

    @property
    def server(self) -> subprocess.Popen | None:
        return next((p for p in self.procs if p.args[3:5] == ["server", "start"]), None)

    @property
    def worker(self) -> subprocess.Popen | None:
        return next((p for p in reversed(self.procs) if p.args[3:5] == ["worker", "start"]), None)

    def start_worker(self, name: str | None = None) -> subprocess.Popen:
        """A process worker of the pool; `name` (Prefect's label `prefect.worker.name` on the runs it takes). A
        worker that serve started gets SIGKILL when serve dies (SIGTERM only makes it wait for its runs): its flow
        runs then stop on their own (runguard.watch_worker)."""
        named = ["--name", name] if name else []
        return self._spawn(
            "worker", "worker", "start", "--pool", POOL, "--type", "process", *named, death_signal=signal.SIGKILL
        )

    # ---- the database's view of runs whose processes are gone -------------------------------------------------
    def api_call(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> object:
        """One call of the server's REST API (no Prefect import: serve stays a plain supervisor)."""
        req = urllib.request.Request(
            f"{self.api_url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
        return json.loads(data) if data else None

    def active_runs(self, worker_name: str) -> list[dict]:
        """Flow runs of the pool that the worker `worker_name` took and that are not final (Pending, Running,
        Cancelling)."""
        body = {
            "flow_runs": {"state": {"type": {"any_": list(ACTIVE_STATES)}}},
            "work_pools": {"name": {"any_": [POOL]}},
            "limit": 200,
        }
        runs = self.api_call("POST", "/flow_runs/filter", body) or []
        return [r for r in runs if (r.get("labels") or {}).get("prefect.worker.name") == worker_name]

    def crash_run(self, run: dict, message: str) -> bool:
        """Set a run Crashed (not forced: a run that reported its own end meanwhile keeps it). Leaving Running or
        Pending frees its deployment concurrency slot (Prefect's ReleaseFlowConcurrencySlots)."""
        body = {"state": {"type": "CRASHED", "name": "Crashed", "message": message}, "force": False}
        res = self.api_call("POST", f"/flow_runs/{run['id']}/set_state", body) or {}
        if res.get("status") != "ACCEPT":
            return False
        self.end_task_runs(run["id"], "CRASHED", f"its flow run was set Crashed: {message}")
        return True

    def end_task_runs(self, flow_run_id: str, state_type: str, message: str) -> int:
        """Set the task runs of a flow run that the database still shows unfinished to `state_type` (forced): a
        flow-run process that was killed left them Running beside its final flow run (issue 50). Returns how many."""
        body = {
            "flow_runs": {"id": {"any_": [str(flow_run_id)]}},
            "task_runs": {"state": {"type": {"any_": list(ACTIVE_TASK_STATES)}}},
            "limit": 200,
        }
        name = state_type.capitalize()
        state = {"state": {"type": state_type, "name": name, "message": message}, "force": True}
        tasks = self.api_call("POST", "/task_runs/filter", body) or []
        for t in tasks:
            self.api_call("POST", f"/task_runs/{t['id']}/set_state", state)
        return len(tasks)

    def end_orphaned_task_runs(self) -> int:
        """Task runs left unfinished by flow runs that ended (their process was killed, by SIGKILL or the OOM killer,
        and the worker reported the flow run Crashed): set to their flow run's final state, naming it. serve does
        this every ORPHAN_POLL_S (and each run does at its start); returns how many it set."""
        body = {
            "flows": {"name": {"any_": [FLOW_NAME]}},
            "flow_runs": {"state": {"type": {"any_": list(ORPHANING_STATES)}}},
            "task_runs": {"state": {"type": {"any_": list(ACTIVE_TASK_STATES)}}},
            "limit": 200,
        }
        tasks = self.api_call("POST", "/task_runs/filter", body) or []
        ends: dict[str, dict] = {}
        for t in tasks:
            fid = t.get("flow_run_id")
            if fid and fid not in ends:
                ends[fid] = (self.api_call("GET", f"/flow_runs/{fid}") or {}).get("state") or {}
        done = 0
        for fid, st in ends.items():
            kind = "CANCELLED" if st.get("type") == "CANCELLED" else "CRASHED"
            why = st.get("message") or st.get("name") or "ended"
            done += self.end_task_runs(fid, kind, f"its flow run ended {st.get('name', '')} while it ran: {why}")
        return done

    def settle_runs(self, worker_name: str, why: str, grace_s: float = STOP_GRACE_S) -> list[dict]:
        """The runs of a worker that is gone: wait up to `grace_s` for their processes to end (they notice the
        worker's death: runguard.watch_worker), SIGKILL what is left, and set Crashed every run the database still
        shows active. Returns the runs set Crashed. Only for a worker known dead (no live worker of that name)."""
        try:
            runs = self.active_runs(worker_name)
        except (urllib.error.URLError, OSError, ValueError) as e:
            print(f"could not read the runs of worker {worker_name} ({e})", file=sys.stderr)
            return []
        pids = {r["id"]: pid for r in runs if (pid := _flow_run_process(r))}
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {i: p for i, p in pids.items() if _flow_run_process_alive(p, i)}
            time.sleep(0.5)
        for run_id, pid in pids.items():
            if _flow_run_process_alive(pid, run_id):
                signal_group(pid, signal.SIGKILL)  # a flow-run process leads its own session
        try:
            return [r for r in self.active_runs(worker_name) if self.crash_run(r, f"Crashed: {why}")]
        except (urllib.error.URLError, OSError, ValueError) as e:
            print(f"could not mark the runs of worker {worker_name} Crashed ({e})", file=sys.stderr)
            return []

    def ensure_zombie_automation(self) -> None:
        """Prefect's zombie detection for the deployments' runs, created once (PostgreSQL only; core/serve.py)."""
        found = self.api_call("POST", "/automations/filter", {"automations": {"name": {"any_": [ZOMBIE_AUTOMATION]}}})
        if found:
            return
        final = ["prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled"]
        self.api_call(
            "POST",
            "/automations/",
            {
                "name": ZOMBIE_AUTOMATION,
                "description": f"A flow run of the dflash deployments sends a heartbeat every {HEARTBEAT_S} s "
                f"(PREFECT_FLOWS_HEARTBEAT_FREQUENCY); none for {ZOMBIE_WITHIN_S} s: its process is gone.",
                "enabled": True,
                "trigger": {
                    "type": "event",
                    "posture": "Proactive",
                    "match": {"prefect.resource.id": "prefect.flow-run.*"},
                    "match_related": {"prefect.resource.id": "prefect.tag.dflash", "prefect.resource.role": "tag"},
                    "after": ["prefect.flow-run.heartbeat"],
                    "expect": ["prefect.flow-run.heartbeat", *final, "prefect.flow-run.Crashed"],
                    "for_each": ["prefect.resource.id"],
                    "threshold": 1,
                    "within": ZOMBIE_WITHIN_S,
                },
                "actions": [
                    {
                        "type": "change-flow-run-state",
                        "state": "CRASHED",
                        "message": f"Crashed: no heartbeat for {ZOMBIE_WITHIN_S} s (its worker or machine died)",
                    }
                ],
            },
        )

    def run_deployment(self, name: str, overrides: dict | None = None, job_env: dict[str, str] | None = None) -> str:
        """Trigger `dflash-pipeline/<name>` the way the README does (`-p overrides=...`); returns the flow-run id.
        `job_env`: extra environment of this run's flow-run process (a job variable of the process pool)."""
        args = ["deployment", "run", f"dflash-pipeline/{name}"]
        if overrides is not None:
            args += ["-p", f"overrides={json.dumps(overrides)}"]
        if job_env:
            args += ["--job-variable", f"env={json.dumps(job_env)}"]
        out = self._prefect(*args).stdout
        for line in out.splitlines():
            if "UUID" in line:
                return line.split()[-1]
        raise PipelineError(f"no flow-run id in the output of `prefect deployment run`:\n{out}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Workers first, then the server, so that every run can still report its end: SIGTERM to each worker's
        group and SIGINT to the worker (a Prefect worker turns SIGTERM into waiting for its runs; Ctrl-C stops it at
        once). Its flow-run processes (each in a session of its own) notice and stop (runguard.watch_worker); what
        is left after `grace_s` gets SIGKILL, and runs the server still shows active with their processes gone are
        set Crashed (which frees their deployment's slot). Then the server the same way."""
        server = self.server
        workers = [p for p in reversed(self.procs) if p is not server]
        runs: dict[int, int] = {}  # the workers' flow-run processes: pid -> start time
        for p in workers:
            runs.update(_descendants(p.pid))
        deadline = time.monotonic() + grace_s
        # The flow-run processes first, each told by SIGTERM (it leads a session of its own): a Prefect worker that
        # stops kills its runs with SIGKILL, so they could neither save a checkpoint nor publish their summary nor
        # end their task runs (issue 50). The marker tells them why (the summary says "serve was stopped").
        flow_runs = {p: s for p, s in runs.items() if _is_flow_run_process(p)}
        if flow_runs:
            try:
                self.stopping_marker.parent.mkdir(parents=True, exist_ok=True)
                self.stopping_marker.touch()
            except OSError:
                pass
            for pid in flow_runs:
                _kill(pid, signal.SIGTERM)
            while _still(flow_runs) and time.monotonic() < deadline:
                time.sleep(0.2)
        _stop_groups(workers, deadline)
        while _still(runs) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _still(runs):
            signal_group(pid, signal.SIGKILL)
            _kill(pid)
        if server is not None and server.poll() is None and runs:
            self._crash_gone(set(runs))
        if server is not None:
            _stop_groups([server], time.monotonic() + grace_s)
        self.procs.clear()
        try:
            self.stopping_marker.unlink(missing_ok=True)
        except OSError:
            pass

    def _crash_gone(self, pids: set[int]) -> None:
        """Set Crashed the active runs whose flow-run process was one of `pids` (all gone by now)."""
        try:
            body = {"flow_runs": {"state": {"type": {"any_": list(ACTIVE_STATES)}}}, "limit": 200}
            for r in self.api_call("POST", "/flow_runs/filter", body) or []:
                if _flow_run_process(r) in pids:
                    self.crash_run(r, "Crashed: dflash-pipeline serve stopped its worker")
        except (urllib.error.URLError, OSError, ValueError) as e:
            print(f"could not mark the stopped runs Crashed ({e}); the next serve does", file=sys.stderr)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _is_flow_run_process(pid: int) -> bool:
    """Whether `pid` is a Prefect flow-run process (its environment names its flow run)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return any(v.startswith(b"PREFECT__FLOW_RUN_ID=") for v in env.split(b"\0"))


def _stop_groups(procs: list[subprocess.Popen], deadline: float) -> None:
    """SIGTERM to each leader's group and SIGINT to the leader; SIGKILL to the group at `deadline`."""
    for p in procs:
        signal_group(p.pid, signal.SIGTERM)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        signal_group(p.pid, signal.SIGKILL)  # what the leader left in its group
        p.wait()


def _flow_run_process(run: dict) -> int | None:
    """The pid of a run's flow-run process (its `infrastructure_pid`, as a Prefect process worker sets it)."""
    try:
        return int(str(run.get("infrastructure_pid") or "").rsplit(":", 1)[-1])
    except ValueError:
        return None


def _flow_run_process_alive(pid: int, run_id: str) -> bool:
    """Whether `pid` is still the flow-run process of `run_id` on this host (not a reused pid)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"PREFECT__FLOW_RUN_ID={run_id}".encode() in env.split(b"\0") and _stat(pid) is not None
