"""A throwaway PostgreSQL cluster: initdb into a temp dir, pg_ctl start on a free loopback port, stop and remove.

Used by the e2e layer (the session fixture `postgres`) and by bench/prefect_load_bench.py. PostgreSQL refuses to
run as root, so under root the cluster belongs to an unprivileged system user (`postgres` where Debian's package
created it, else `nobody`) and lives in a directory of its own under the system temp dir (pytest's tmp dirs are
private to root). Password authentication (scram) on 127.0.0.1 only; no Unix socket outside the cluster's dir.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SUPERUSER = "dflash"


def find_bindir() -> Path | None:
    """The directory with initdb and pg_ctl: $PG_BINDIR, Debian's /usr/lib/postgresql/<newest>/bin, or PATH."""
    candidates = [os.environ.get("PG_BINDIR", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    if shutil.which("initdb"):
        candidates.append(str(Path(shutil.which("initdb")).resolve().parent))
    for c in candidates:
        if c and (Path(c) / "initdb").exists() and (Path(c) / "pg_ctl").exists():
            return Path(c)
    return None


def missing_reason() -> str | None:
    """Why no cluster can be started here (None: one can)."""
    if find_bindir() is None:
        return (
            "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql "
            "(.ci/run does), or set PG_BINDIR"
        )
    if os.geteuid() == 0 and _system_user() is None:
        return "running as root and no unprivileged user (postgres, nobody) to own a PostgreSQL cluster"
    return None


def _system_user() -> pwd.struct_passwd | None:
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThrowawayPostgres:
    """`with ThrowawayPostgres() as pg: pg.create_database("x")` -> a postgresql+asyncpg:// URL; the cluster is
    stopped (fast shutdown, then SIGKILL) and its directory removed on exit, whatever happened."""

    def __init__(self, fsync: bool = True):
        self.bindir = find_bindir()
        if self.bindir is None:
            raise RuntimeError(missing_reason())
        self.fsync = fsync
        self.port = _free_port()
        self.password = secrets.token_hex(12)
        self.dir: Path | None = None
        self._user = _system_user() if os.geteuid() == 0 else None

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def log(self) -> Path:
        return self.dir / "postgres.log"

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def _run(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        kw = {}
        if self._user is not None:
            kw = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.dir),
            "LC_ALL": "C.UTF-8",
            "PGPASSWORD": self.password,
        }
        res = subprocess.run(
            [str(self.bindir / cmd[0]), *cmd[1:]],
            cwd=self.dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,  # Ctrl-C in the terminal reaches pytest, which stops the cluster itself
            **kw,
        )
        if res.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd[:2])} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}\n{log}")
        return res

    def start(self) -> ThrowawayPostgres:
        self.dir = Path(tempfile.mkdtemp(prefix="dflash-pg-"))
        try:
            if self._user is not None:
                os.chown(self.dir, self._user.pw_uid, self._user.pw_gid)
            pwfile = self.dir / "pw"
            pwfile.write_text(self.password + "\n")
            if self._user is not None:
                os.chown(pwfile, self._user.pw_uid, self._user.pw_gid)
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                SUPERUSER,
                "--pwfile",
                str(pwfile),
                "--auth",
                "scram-sha-256",
                "-E",
                "UTF8",
                "--no-instructions",
            )
            pwfile.unlink()
            opts = (
                f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.dir} "
                f"-c max_connections=200 -c fsync={'on' if self.fsync else 'off'}"
            )
            self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "120", "start")
        except BaseException:
            self.stop()
            raise
        return self

    def create_database(self, name: str) -> str:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, name)
        return self.url(name)

    def server_log(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.dir is None:
            return
        pid = self.postmaster_pid()
        if pid is not None:
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop", timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            try:  # still there (a hung shutdown): the postmaster's group goes, its children with it
                os.kill(pid, 0)
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                time.sleep(0.5)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> ThrowawayPostgres:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
