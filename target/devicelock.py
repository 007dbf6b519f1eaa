"""One run per GPU: an exclusive, per-host lock file held by the worker process for its whole life.

flock locks die with their process, so a killed worker never leaves a stale lock behind.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.errors import PipelineError
from storage.commit import exclusive_lock


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
    holder = f"pid {os.getpid()}, store {store}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    with exclusive_lock(path, holder, lambda h: PipelineError(
            f"{device} is in use by another dflash-pipeline run ({h}); choose other devices with "
            "extract.devices or wait for that run")):
        yield
