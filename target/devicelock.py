"""One run per GPU: an exclusive, per-host lock file held by the worker process for its whole life.

flock locks die with their process, so a killed worker never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.errors import PipelineError


def lock_dir() -> Path:
    d = Path(os.environ.get("DFLASH_LOCK_DIR", "/tmp/dflash-pipeline-locks"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _physical(device: str) -> str:
    """The lock is per physical GPU: map cuda:i through CUDA_VISIBLE_DEVICES as the parent saw it."""
    if not device.startswith("cuda:"):
        return device.replace(":", "")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"gpu{visible.split(',')[0]}" if visible else f"gpu{device.split(':')[1]}"


@contextmanager
def device_lock(device: str, store: str) -> Iterator[None]:
    if device.startswith("cpu"):  # CPU workers may share the host
        yield
        return
    path = lock_dir() / f"{socket.gethostname()}-{_physical(device)}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise PipelineError(f"{device} is in use by another dflash-pipeline run ({f.read().strip()}); "
                                "choose other devices with extract.devices or wait for that run") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}, store {store}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
