"""One run per GPU: an exclusive, per-host lock file held by the worker process for its whole life.

flock locks die with their process, so a killed worker never leaves a stale lock behind.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.placement import replica_devices
from dflash_pipeline.storage.commit import exclusive_lock


def lock_dir() -> Path:
    """Shared by every user of the host (the GPUs are): world-writable and sticky, like /tmp itself."""
    d = Path(os.environ.get("DFLASH_LOCK_DIR", "/tmp/dflash-pipeline-locks"))
    d.mkdir(parents=True, exist_ok=True)
    _share(d, 0o1777)
    return d


def _share(path: Path, mode: int) -> None:
    """Give `path` `mode` if this user owns it (only the owner may; another user's is left as it is)."""
    try:
        if path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o7777 != mode:
            path.chmod(mode)
    except FileNotFoundError:
        pass


def _physical_in_worker(device: str, position: int) -> str:
    """The lock is per physical GPU. In the worker process CUDA_VISIBLE_DEVICES lists exactly its replica's
    GPUs, in order (target/procs.child_env), so the replica's `position`-th GPU is that entry."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"gpu{visible.split(',')[position]}" if visible else f"gpu{device.split(':')[1]}"


def _physical_here(device: str, position: int) -> str:
    """A GPU named in this process's own numbering ("cuda" is "cuda:0")."""
    index = int(device.split(":")[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"gpu{visible.split(',')[index].strip()}" if visible else f"gpu{index}"


@contextmanager
def gpu_locks(devices: list[str], doing: str, setting: str, physical=_physical_here) -> Iterator[None]:
    """Hold every GPU in `devices` (CPU entries are skipped: CPU work may share the host) for `doing` (named to
    whoever finds it held). A GPU another run holds is an error naming that run and `setting`, where this run's
    GPUs are chosen: a run fails at once instead of running out of GPU memory half-way."""
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    with ExitStack() as stack:
        for position, d in enumerate(devices):
            if not d.startswith("cuda"):
                continue
            path = lock_dir() / f"{socket.gethostname()}-{physical(d, position)}.lock"
            path.touch(exist_ok=True)
            _share(path, 0o666)  # another user's run must be able to open it to find it held
            stack.enter_context(
                exclusive_lock(
                    path,
                    f"pid {os.getpid()}, {doing}, since {since}",
                    lambda h, d=d: PipelineError(
                        f"{d} is in use by another dflash-pipeline run ({h}); wait for that run, or give this run "
                        f"other GPUs ({setting})"
                    ),
                )
            )
        yield


def device_lock(device: str, store: str):
    """An extraction worker's lock on every GPU of `device` (one, or a split replica's "cuda:0+cuda:1")."""
    return gpu_locks(replica_devices(device), f"store {store}", "extract.devices", physical=_physical_in_worker)


def check_gpus_free(replicas: list[str]) -> None:
    """Extraction's GPUs, taken and released at once in the run's process: one that another run holds fails the run
    before its batch plan is sized (from the memory that run left free) and pinned; the workers then hold them."""
    with gpu_locks([d for r in replicas for d in replica_devices(r)], "checking its GPUs", "extract.devices"):
        pass
