"""Entry point of an extraction worker process: `python -m dflash_pipeline.extraction.worker_main SPEC.json`.

Speaks to its parent (extraction/procs.py) through stdout lines prefixed with `@@dflash `: progress events,
then either the result or a user error. Holds an exclusive lock on its GPU for its whole life, so a
second run cannot silently share the device.

Stopping: SIGTERM (from procs.stop_workers) raises SystemExit at the next bytecode boundary of the main thread
(after the current batch's forward), and unwinding waits for the shards already handed to the writers, so
what was committed stays committed. The worker never outlives its parent: the kernel sends it SIGKILL when
the parent dies (PR_SET_PDEATHSIG, Linux), and a watcher thread checks the parent's pid where that is not
available. The spec file is removed as soon as it is read.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from dflash_pipeline import PACKAGE_LOGGER
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.devicelock import device_lock
from dflash_pipeline.extraction.extract import Progress, run_worker
from dflash_pipeline.extraction.procs import PARENT_ENV, PREFIX
from dflash_pipeline.extraction.spec import WorkerSpec


def _send(kind: str, **payload) -> None:
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, **payload}) + "\n")
    sys.stdout.flush()


class _ToParent(logging.Handler):
    """Forward this process's log records of the pipeline's packages to the parent (and the Prefect UI)."""

    def emit(self, record: logging.LogRecord) -> None:
        _send("log", name=record.name, level=record.levelno, message=record.getMessage())


PR_SET_PDEATHSIG = 1


def watch_parent() -> None:
    """Exit when the parent that started this worker dies, whatever killed it."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent:
        return
    if sys.platform.startswith("linux"):
        try:  # the kernel's parent-death signal: works even while this process holds the GIL in a C call
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def poll() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=poll, name="watch-parent", daemon=True).start()


def _stop_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
    raise SystemExit(128 + signum)


def main(spec_path: str) -> int:
    watch_parent()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it sends SIGTERM
    text = Path(spec_path).read_text()
    Path(spec_path).unlink(missing_ok=True)
    import torch

    from dflash_pipeline.progress import hide_gpu_notes_without_gpu

    hide_gpu_notes_without_gpu()  # transformers' notes on GPU kernels, on a machine without a GPU
    handler = _ToParent(level=logging.INFO)
    logging.getLogger(PACKAGE_LOGGER).addHandler(handler)
    logging.getLogger(PACKAGE_LOGGER).setLevel(logging.INFO)

    try:
        spec = WorkerSpec.from_json(text, where=spec_path)
        if spec.device == "cpu" and spec.threads:
            torch.set_num_threads(spec.threads)
        with device_lock(spec.name, spec.store_root):

            def progress(p: Progress) -> None:
                _send("progress", data={**asdict(p), "device": spec.name})

            result = run_worker(spec, progress=progress)
        result.device = spec.name
        _send("result", data=result.to_dict())
        return 0
    except PipelineError as e:
        _send("user_error", message=str(e))
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
