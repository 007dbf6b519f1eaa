"""Run an extraction worker in its own process, pinned to one device (or one split replica's GPUs).

Why a process per device: a hung or crashed GPU worker (CUDA error, OOM-kill, a kernel that never
returns) can be killed and retried without taking the other devices down, and Prefect's task timeouts
cannot interrupt a thread stuck in a C call. The child reports progress as JSON lines on stdout and its
result (or a user error) at the end; the parent turns a crash or a timeout into an exception the task
retries, and a user error into a PipelineError it does not.

Stopping (docs/USAGE.md, "Resuming, reruns, and what is never lost"): every live worker is registered here.
`stop_workers()` (called by the flow when the run is interrupted: Ctrl-C, SIGTERM, a cancelled flow run) sends
each worker SIGTERM, which makes it stop at its next batch boundary after the shards already handed to its
writers are committed, and SIGKILLs the worker's process group (its store-writer processes too) after
STOP_GRACE_S. A stopped worker is reported as WorkerStopped, a PipelineError, so no task retries it. If this process
dies without stopping them (SIGKILL), each worker notices on its own (worker_main.watch_parent) and exits; its GPU
lock dies with it.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_pipeline import threads
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.extract import Progress, WorkerResult
from dflash_pipeline.extraction.placement import replica_devices
from dflash_pipeline.extraction.spec import WorkerSpec
from dflash_pipeline.storage.commit import write_atomic

PREFIX = "@@dflash "
PARENT_ENV = "DFLASH_WORKER_PARENT"  # the pid the worker watches (worker_main.watch_parent)
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL of a worker's process group when a run is stopped

_live: dict[int, subprocess.Popen] = {}
_live_lock = threading.Lock()
_stopping = threading.Event()


class WorkerCrashed(RuntimeError):
    """The worker process died or hung: transient from the pipeline's point of view (retry resumes)."""


class WorkerStopped(PipelineError):
    """The run was stopped (Ctrl-C, SIGTERM, a cancelled flow run): never retried; a rerun resumes."""


def allow_workers() -> None:
    """A new run in this process may start workers again (after an earlier run was stopped)."""
    _stopping.clear()


def live_workers() -> list[int]:
    with _live_lock:
        return sorted(_live)


def stop_workers(grace_s: float = STOP_GRACE_S) -> list[int]:
    """Stop every worker this process started, and refuse new ones until allow_workers(): SIGTERM, then
    SIGKILL of the process group after `grace_s`. Returns the pids it stopped. Safe from any thread."""
    _stopping.set()
    with _live_lock:
        procs = list(_live.values())
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(p, signal.SIGKILL)  # its writer processes too, even when the worker itself exited
        p.wait()
    return [p.pid for p in procs]


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with status {returncode}"


def child_env(device: str) -> tuple[dict[str, str], str]:
    """Environment and in-process device name for a worker pinned to `device` (a GPU, or the GPUs of a split
    replica, "cuda:2+cuda:3", which the child then sees as cuda:0+cuda:1)."""
    env = dict(os.environ)
    if device.startswith("cuda:"):
        visible = env.get("CUDA_VISIBLE_DEVICES")
        indices = [int(d.split(":")[1]) for d in replica_devices(device)]
        physical = [visible.split(",")[i] if visible else str(i) for i in indices]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(physical)  # the child sees exactly its GPUs, from cuda:0
        return env, "+".join(f"cuda:{i}" for i in range(len(indices)))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1))))
    return env, "cpu"


def spec_file(spec: WorkerSpec, worker: str | None = None) -> Path:
    """`<spec_dir>/<store>-<version>-<worker>.json`, `worker` the name the run gave the worker (its device, or
    `ray:N`: Ray workers on one node all see the same local device). One run at a time holds a store (its lock), so
    the name is this worker's alone while it runs, and the next run's worker of the same store and device replaces
    a file a SIGKILL left behind."""
    store = hashlib.sha256(spec.store_root.encode()).hexdigest()[:12]
    device = re.sub(r"[^A-Za-z0-9.+-]", "_", worker or spec.name)
    return Path(spec.spec_dir) / f"spec-{store}-{spec.version}-{device}.json"


def write_spec(spec: WorkerSpec, worker: str | None = None) -> str:
    """The spec as the worker reads it (it removes the file once read). Under spec_dir (the run's output_dir),
    never TMPDIR: a SIGKILL of the run before the worker read its spec left a file there that nothing removed."""
    if not spec.spec_dir:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(spec.to_json())
            return f.name
    path = spec_file(spec, worker)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, spec.to_json().encode())
    except OSError as e:
        raise PipelineError(
            f"cannot write the extraction worker's spec {path} ({e.strerror or e}): free space on that "
            "filesystem or fix its permissions, or choose another output_dir (--set output_dir=DIR)"
        ) from None
    return str(path)


def run_in_process(
    spec: WorkerSpec, progress: Callable[[Progress], None] | None = None, timeout_s: float | None = None
) -> WorkerResult:
    """Run `spec` (its device named as the parent sees it) in a child pinned to that device."""
    device = spec.device
    if _stopping.is_set():
        raise WorkerStopped(f"extraction worker on {device} not started: the run is being stopped")
    env, local_device = child_env(device)
    env[PARENT_ENV] = str(os.getpid())
    if spec.threads:  # a small model's worker: its threads before torch loads (core/threads.py)
        env.update(threads.env(spec.threads))
    spec_path = write_spec(replace(spec, device=local_device, label=device), worker=spec.name)
    tail: deque[str] = deque(maxlen=40)
    outcome: dict[str, Any] = {}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_pipeline.extraction.worker_main", spec_path],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,  # a terminal's Ctrl-C reaches the parent only; the parent stops the worker
    )
    with _live_lock:
        _live[proc.pid] = proc
    who = f"extraction worker on {device} (pid {proc.pid})"

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PREFIX):
                msg = json.loads(line[len(PREFIX) :])
                if msg["kind"] == "progress" and progress:
                    progress(Progress(**msg["data"]))
                elif msg["kind"] == "log":  # re-emitted under the child's logger name: reaches the UI
                    logging.getLogger(msg["name"]).log(msg["level"], "%s", msg["message"])
                else:
                    outcome.update(msg)
            else:
                tail.append(line.rstrip())
                sys.stderr.write(f"[{device}] {line}")

    # The reader thread runs in a copy of this thread's context, so Prefect's log handler sees the task run.
    reader = threading.Thread(target=contextvars.copy_context().run, args=(pump,), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise WorkerCrashed(
            f"{who} did not finish within extract.worker_timeout_s="
            f"{timeout_s:.0f} s and was killed; a retry resumes from its last commit"
        ) from None
    except BaseException:
        _kill(proc)  # the parent is being cancelled: never leave an orphan holding a GPU
        raise
    finally:
        with _live_lock:
            _live.pop(proc.pid, None)
        try:
            os.unlink(spec_path)  # the worker removes it once read; this covers a worker that died before
        except FileNotFoundError:
            pass
    reader.join(timeout=10)
    if outcome.get("kind") == "user_error":
        raise PipelineError(outcome["message"])
    if proc.returncode != 0 or outcome.get("kind") != "result":
        if _stopping.is_set():
            raise WorkerStopped(
                f"{who} was stopped ({_how(proc.returncode)}) because the run was stopped; "
                "a rerun resumes from its last commit"
            )
        raise WorkerCrashed(
            f"{who} {_how(proc.returncode)}; a retry resumes from its last commit. Last output:\n" + "\n".join(tail)
        )
    return WorkerResult(**outcome["data"])


def _kill(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGKILL)
    proc.wait()
