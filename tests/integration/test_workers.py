"""Per-device worker processes: device pinning, one run per GPU, clear errors."""

from __future__ import annotations

import os
import subprocess

import pytest

from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.devicelock import device_lock
from tests.proctree import descendants


def test_gpu_in_use_by_another_run_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with device_lock("cuda:0", "/stores/a"):
        with pytest.raises(
            PipelineError, match=r"cuda:0 is in use by another dflash-pipeline run \(pid \d+, store /stores/a"
        ):
            with device_lock("cuda:0", "/stores/b"):
                pass
    with device_lock("cuda:0", "/stores/b"):  # released with its holder
        pass


def test_a_gpu_is_one_lock_whichever_stage_or_numbering_holds_it(tmp_path, monkeypatch):
    """A nightly extraction while a training runs on the same GPU: the GPU is found held at once (before the batch
    plan is sized from what training left free), named in each process's own numbering. The flow process sees
    GPUs 2,3 as cuda:0,1; an extraction worker given GPU 3 sees it as cuda:0."""
    import sys

    from dflash_pipeline.extraction.devicelock import check_gpus_free, gpu_locks

    monkeypatch.setenv("DFLASH_LOCK_DIR", str(tmp_path))
    hold = (
        "import time\n"
        "from dflash_pipeline.extraction.devicelock import device_lock\n"
        "with device_lock('cuda:0', '/stores/nightly'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3"}
    worker = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert worker.stdout.readline().strip() == "held"
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
        with gpu_locks(["cuda:0", "cpu"], "training /runs/a/drafter", "train.device"):
            pass  # GPU 2 is free
        with pytest.raises(PipelineError, match=r"cuda:1 is in use .*store /stores/nightly.*give this run other GPUs"):
            with gpu_locks(["cuda:1"], "training /runs/a/drafter", "train.device"):
                pass
        with pytest.raises(PipelineError, match=r"cuda:1 is in use .*\(extract.devices\)"):
            check_gpus_free(["cuda:0+cuda:1"])
    finally:
        worker.kill()
        worker.wait()
    check_gpus_free(["cuda:0+cuda:1"])  # free again once the holder is gone
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with gpu_locks(["cuda"], "evaluating /runs/a/drafter/export", "evaluate.device"):  # "cuda" is cuda:0
        with pytest.raises(PipelineError, match=r"cuda:0 is in use .*evaluating /runs/a/drafter/export"):
            with device_lock("cuda:0", "/stores/nightly"):
                pass


def test_hung_worker_is_killed_at_its_timeout(small_store):
    """A worker that does not finish in extract.worker_timeout_s is killed (its whole process group) and
    reported as a crash, which the task retries; here it is still importing torch when time is up."""
    import time

    from dflash_pipeline.extraction.procs import WorkerCrashed, run_in_process
    from dflash_pipeline.extraction.spec import WorkerSpec

    ex = small_store
    spec = WorkerSpec(
        store_root=ex.store,
        version=ex.plan.version,
        units=[],
        report=ex.report,
        extract=ex.cfg.extract,
        store_dtype="float32",
        device="cpu:0",
        threads=1,
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerCrashed, match="did not finish within extract.worker_timeout_s=1 s and was killed"):
        run_in_process(spec, timeout_s=1.0)
    assert time.monotonic() - t0 < 15
    # this test process's own workers only: another pytest-xdist worker may be running its extraction beside it
    leftovers = [c for c in descendants(os.getpid()).values() if "dflash_pipeline.extraction.worker_main" in c]
    assert not leftovers
