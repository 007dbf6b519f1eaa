"""An extraction worker never outlives its parent, and its GPU lock dies with it (issue 16). No GPU needed: the
lock is taken for "cuda:0" with CUDA_VISIBLE_DEVICES naming a physical GPU, which is all device_lock reads."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.devicelock import device_lock
from dflash_pipeline.extraction.procs import PARENT_ENV
from tests.proctree import wait_gone

WORKER = """
import time
from dflash_pipeline.extraction.worker_main import watch_parent
from dflash_pipeline.extraction.devicelock import device_lock
watch_parent()
with device_lock("cuda:0", "a-store"):
    print("locked", flush=True)
    time.sleep(600)
"""

PARENT = f"""
import os, subprocess, sys, time
env = dict(os.environ, {PARENT_ENV}=str(os.getpid()))
p = subprocess.Popen([sys.executable, "-c", {WORKER!r}], env=env, start_new_session=True, stdout=sys.stdout)
print(p.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_worker_exits_when_its_parent_dies_and_releases_the_gpu_lock(how, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "locked"
        with pytest.raises(PipelineError, match=f"in use by another dflash-pipeline run \\(pid {worker}"):
            with device_lock("cuda:0", "another-store"):
                pass
        t0 = time.monotonic()
        parent.send_signal(how)  # the CLI or a flow-run process dying without stopping its worker
        parent.wait(timeout=10)
        assert not wait_gone([worker], timeout=5), "the worker outlived its parent"
        print(f"worker gone {time.monotonic() - t0:.2f} s after its parent got {how.name}")
        with device_lock("cuda:0", "another-store"):  # free again
            pass
    finally:
        parent.kill()
        parent.wait()
