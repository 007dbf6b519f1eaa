"""Start a local Prefect server, the `dflash` process work pool, the deployments and a worker.

Plain subprocesses of the `prefect` CLI (no Prefect imports), used by `dflash-pipeline serve` and by the
end-to-end deployment test. Every started process is stopped again by `LocalPrefect.stop()`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.deployments import PREFECT_FILE
from dflash_pipeline.errors import PipelineError

POOL = "dflash"


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


@dataclass
class LocalPrefect:
    port: int = 4200
    home: Path | None = None  # PREFECT_HOME; None = the user's default
    # Where flow runs start, so relative paths in a run's config resolve as they would for `dflash-pipeline run`.
    workdir: Path = field(default_factory=Path.cwd)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "DFLASH_WORKDIR": str(self.workdir),
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
        }
        if self.home:
            env["PREFECT_HOME"] = str(self.home)
        return env

    def _prefect(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "prefect", *args]
        res = subprocess.run(cmd, env=self.env(), cwd=self.workdir, capture_output=True, text=True, timeout=300)
        if check and res.returncode != 0:
            raise PipelineError(f"`prefect {' '.join(args)}` failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def _spawn(self, log_name: str, *args: str) -> subprocess.Popen:
        log_dir = Path(self.home or self.workdir / "runs") / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        out = open(log_dir / f"{log_name}.log", "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "prefect", *args],
            env=self.env(),
            cwd=self.workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(p)
        return p

    def start_server(self, timeout: float = 120) -> None:
        p = self._spawn("server", "server", "start", "--host", "127.0.0.1", "--port", str(self.port))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise PipelineError(
                    f"prefect server exited with {p.returncode}; see its log under "
                    f"{self.home or self.workdir / 'runs'}/logs/server.log (is port {self.port} in use?)"
                )
            try:
                check_api(self.api_url, timeout=2)
                return
            except PipelineError:
                time.sleep(1)
        raise PipelineError(f"prefect server did not answer on {self.api_url} within {timeout:.0f} s")

    def apply_deployments(self) -> None:
        pools = self._prefect("work-pool", "ls", check=False).stdout
        if POOL not in pools:
            self._prefect("work-pool", "create", POOL, "--type", "process")
        self._prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE))

    def start_worker(self) -> None:
        self._spawn("worker", "worker", "start", "--pool", POOL, "--type", "process")

    def run_deployment(self, name: str, overrides: dict | None = None) -> str:
        """Trigger `dflash-pipeline/<name>`; returns the flow-run id."""
        args = ["deployment", "run", f"dflash-pipeline/{name}"]
        if overrides is not None:
            args += ["-p", f"overrides={json.dumps(overrides)}"]
        out = self._prefect(*args).stdout
        for line in out.splitlines():
            if "UUID" in line:
                return line.split()[-1]
        raise PipelineError(f"no flow-run id in the output of `prefect deployment run`:\n{out}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self.procs.clear()


def serve(port: int) -> int:
    """`dflash-pipeline serve`: everything for the UI path, until Ctrl-C."""
    lp = LocalPrefect(port=port)
    try:
        lp.start_server()
        lp.apply_deployments()
        lp.start_worker()
        print(
            f"Prefect UI: http://127.0.0.1:{port}  (API {lp.api_url})\n"
            f"deployments: dflash-pipeline/full, extract-only, train-only, nightly (02:00 UTC)\n"
            f"trigger: PREFECT_API_URL={lp.api_url} prefect deployment run 'dflash-pipeline/extract-only' "
            "-p overrides='{\"data.max_samples\": 100}'\nCtrl-C stops server and worker.",
            flush=True,
        )
        while all(p.poll() is None for p in lp.procs):
            time.sleep(2)
        print("a child process exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        lp.stop()
