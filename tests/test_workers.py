"""Per-device worker processes: device pinning, one run per GPU, clear errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pipeline.errors import PipelineError
from pipeline.serve import check_api
from target.devicelock import device_lock
from target.procs import child_env


def test_child_sees_exactly_its_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    env, local = child_env("cuda:1")
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and local == "cuda:0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    env, local = child_env("cuda:2")
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert child_env("cpu:1")[1] == "cpu"


def test_gpu_in_use_by_another_run_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with device_lock("cuda:0", "/stores/a"):
        with pytest.raises(PipelineError, match=r"cuda:0 is in use by another dflash-pipeline run \(pid \d+, store /stores/a"):
            with device_lock("cuda:0", "/stores/b"):
                pass
    with device_lock("cuda:0", "/stores/b"):  # released with its holder
        pass


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_api_url_is_a_clear_error(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/api"
    with pytest.raises(PipelineError, match="unreachable.*dflash-pipeline serve"):
        check_api(url, timeout=2)
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "--set", f"output_dir={tmp_path}"],
                         env={**os.environ, "PREFECT_API_URL": url}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "is unreachable" in res.stderr


def test_hung_worker_is_killed_at_its_timeout(small_store):
    """A worker that does not finish in extract.worker_timeout_s is killed (its whole process group) and
    reported as a crash, which the task retries; here it is still importing torch when time is up."""
    import time

    from target.procs import WorkerCrashed, run_in_process

    ex = small_store
    spec = {"store_root": ex.store, "version": ex.plan.version, "units": [], "report": ex.report.to_dict(),
            "extract": ex.cfg.extract.model_dump(mode="json"), "store_dtype": "float32", "pad_id": 0,
            "attn_implementation": None, "threads": 1}
    t0 = time.monotonic()
    with pytest.raises(WorkerCrashed, match="did not finish within extract.worker_timeout_s=1 s and was killed"):
        run_in_process(spec, "cpu:0", timeout_s=1.0)
    assert time.monotonic() - t0 < 15
    leftovers = subprocess.run(["pgrep", "-f", "target.worker_main"], capture_output=True, text=True).stdout
    assert not leftovers.strip()
