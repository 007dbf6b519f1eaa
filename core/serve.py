"""Start a local Prefect server, the `dflash` process work pool, the deployments and a worker.

Plain subprocesses of the `prefect` CLI (no Prefect imports), used by `dflash-pipeline serve` and by the
end-to-end deployment test. Every started process runs in its own process group and is stopped again by
`LocalPrefect.stop()` (SIGTERM to the group, SIGKILL after STOP_GRACE_S): the worker's group holds its flow-run
processes, and their extraction workers exit when their flow-run process dies (extraction/worker_main.py).

`serve` stops everything on SIGINT, SIGTERM and SIGHUP. A Prefect worker that dies (killed, OOM) is restarted;
its flow-run processes get SIGTERM (they end Crashed, stopping their extraction workers). Only a dead server ends
`serve`.

The server's database is SQLite under the Prefect home (one person, one box) unless a PostgreSQL URL is given
(`serve --database`, or Prefect's own PREFECT_SERVER_DATABASE_CONNECTION_URL / PREFECT_API_DATABASE_CONNECTION_URL):
the team setup, where one server takes many workers' runs. The URL is checked before the server starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.deployments import PREFECT_FILE
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.runguard import parent_death_signal

POOL = "dflash"
STOP_GRACE_S = 20.0

# SQLite under the server's start-up burst (migrations, services, the CLI's first calls) answers "database is
# locked" when a writer waits longer than the driver's timeout; give it room, and skip the services we never use.
SERVER_DEFAULTS = {
    "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "30",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_LOGGER_ENABLED": "false",
}


DATABASE_ENV = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


def database_url(url: str | None = None) -> str | None:
    """The PostgreSQL URL the server is to use, in the form Prefect takes (`postgresql+asyncpg://`): `url`, else
    Prefect's own setting from the environment; None = Prefect's default (SQLite under PREFECT_HOME). A plain
    `postgresql://` or `postgres://` URL (what psql and most tools print) gets the async driver Prefect needs."""
    url = url or next((os.environ[k] for k in DATABASE_ENV if os.environ.get(k)), None)
    if not url:
        return None
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise PipelineError(
            f"--database {url!r} is not a URL; give postgresql://USER:PASSWORD@HOST:PORT/DATABASE "
            "(or leave it out for SQLite)"
        )
    if scheme in ("postgres", "postgresql", "postgresql+asyncpg"):
        return f"postgresql+asyncpg://{rest}"
    if scheme.startswith("sqlite"):
        return url
    raise PipelineError(
        f"--database {redact(url)}: unsupported scheme {scheme!r}; Prefect's server runs on PostgreSQL "
        "(postgresql://USER:PASSWORD@HOST:PORT/DATABASE) or SQLite (the default: leave --database out)"
    )


def redact(url: str) -> str:
    """`url` with its password replaced by ***, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_database(url: str, timeout: float = 10.0) -> None:
    """Connect once to a PostgreSQL URL (asyncpg, the driver Prefect's server uses) and raise one clear line
    naming the URL and the fix when that fails, instead of a server that dies with a traceback in its log."""
    if not url.startswith("postgresql"):
        return
    try:
        import asyncpg
    except ImportError:
        raise PipelineError(
            "a PostgreSQL database needs the asyncpg driver: pip install 'dflash-pipeline[postgres]'"
        ) from None
    import asyncio

    async def connect():
        conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1), timeout=timeout)
        await conn.close()

    try:
        asyncio.run(asyncio.wait_for(connect(), timeout + 5))
    except Exception as e:  # noqa: BLE001 - any failure to connect is the user's to fix, with this message
        reason = f"{type(e).__name__}: {e}".strip().rstrip(":")
        raise PipelineError(
            f"the database {redact(url)} is unreachable ({reason}). Start PostgreSQL, create the user and database "
            "(README: 'One box (SQLite) or a team (PostgreSQL)'), or fix --database or "
            "PREFECT_SERVER_DATABASE_CONNECTION_URL"
        ) from None


class Stop(Exception):  # noqa: N818 - a request, not an error
    """SIGTERM / SIGHUP received: stop what `serve` started."""


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

    def env(self) -> dict[str, str]:
        env = {
            **SERVER_DEFAULTS,
            **os.environ,
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "DFLASH_WORKDIR": str(self.workdir),
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_SERVER_API_HOST": self.host,
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
    def log_dir(self) -> Path:
        return Path(self.home or self.workdir / "runs") / "logs"

    def _spawn(self, log_name: str, *args: str) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{log_name}.log", "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "prefect", *args],
            env=self.env(),
            cwd=self.workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_signal(os.getpid(), signal.SIGTERM) if self.die_with_parent else None,
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

    def start_worker(self) -> subprocess.Popen:
        return self._spawn("worker", "worker", "start", "--pool", POOL, "--type", "process")

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
        """SIGTERM to every group this started (worker first: its flow runs end before the server), and SIGINT to
        each leader (a Prefect worker that has run a flow ignores SIGTERM: measured, it held serve's stop for the
        whole grace; Ctrl-C stops it at once); SIGKILL to any group still there after `grace_s`."""
        for p in reversed(self.procs):
            _signal_group(p.pid, signal.SIGTERM)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(p.pid, signal.SIGKILL)  # what the leader left in its group (flow-run processes)
            p.wait()
        self.procs.clear()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _raise_stop(signum, frame) -> None:
    raise Stop(signal.Signals(signum).name)


def serve(port: int, home: str | Path | None = None, database: str | None = None, host: str = "127.0.0.1") -> int:
    """`dflash-pipeline serve`: everything for the UI path, until Ctrl-C, SIGTERM or SIGHUP."""
    home = Path(home).expanduser().absolute() if home else None
    lp = LocalPrefect(port=port, home=home, database=database_url(database), host=host, die_with_parent=True)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        lp.start_server()
        lp.apply_deployments()
        lp.start_worker()
        where = home or os.environ.get("PREFECT_HOME", "~/.prefect")
        db = redact(lp.database) if lp.database else f"SQLite under {where}"
        print(
            f"Prefect UI: http://127.0.0.1:{port}  (API {lp.api_url}; database {db}; Prefect home "
            f"{where}; logs under {lp.log_dir})\n"
            f"deployments: dflash-pipeline/full, extract-only, train-only, nightly (02:00 UTC)\n"
            f"trigger: PREFECT_API_URL={lp.api_url} {_prefect_command()} deployment run "
            "'dflash-pipeline/extract-only' "
            "-p overrides='{\"data.max_samples\": 100}'\nCtrl-C (or SIGTERM / SIGHUP) stops server and worker.",
            flush=True,
        )
        while True:
            time.sleep(1)
            if lp.server is None or lp.server.poll() is not None:
                print(f"the Prefect server exited; stopping (see {lp.log_dir}/server.log)", file=sys.stderr)
                return 1
            worker = lp.worker
            if worker is not None and worker.poll() is not None:
                print(
                    f"the Prefect worker (pid {worker.pid}) exited with {worker.returncode}; starting a new one "
                    f"(its runs are reported crashed; see {lp.log_dir}/worker.log)",
                    file=sys.stderr,
                    flush=True,
                )
                lp.procs.remove(worker)
                # Its flow-run processes are in its process group: stop them (they report Crashed and stop their
                # extraction workers) rather than leave them orphaned, logging into a closed pipe.
                _signal_group(worker.pid, signal.SIGTERM)
                lp.start_worker()
    except (KeyboardInterrupt, Stop) as e:
        print(f"{e.__class__.__name__ if isinstance(e, KeyboardInterrupt) else e}: stopping", file=sys.stderr)
        return 0
    finally:
        lp.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
