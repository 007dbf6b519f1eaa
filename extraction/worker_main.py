"""Entry point of an extraction worker process: `python -m target.worker_main SPEC.json`.

Speaks to its parent (target/procs.py) through stdout lines prefixed with `@@dflash `: progress events,
then either the result or a user error. Holds an exclusive lock on its GPU for its whole life, so a
second run cannot silently share the device.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from dflash_pipeline import PACKAGE_LOGGER
from dflash_pipeline.errors import PipelineError
from dflash_pipeline.extraction.devicelock import device_lock
from dflash_pipeline.extraction.extract import Progress, run_worker
from dflash_pipeline.extraction.procs import PREFIX
from dflash_pipeline.extraction.spec import WorkerSpec


def _send(kind: str, **payload) -> None:
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, **payload}) + "\n")
    sys.stdout.flush()


class _ToParent(logging.Handler):
    """Forward this process's log records of the pipeline's packages to the parent (and the Prefect UI)."""

    def emit(self, record: logging.LogRecord) -> None:
        _send("log", name=record.name, level=record.levelno, message=record.getMessage())


def main(spec_path: str) -> int:
    import torch

    handler = _ToParent(level=logging.INFO)
    logging.getLogger(PACKAGE_LOGGER).addHandler(handler)
    logging.getLogger(PACKAGE_LOGGER).setLevel(logging.INFO)

    try:
        spec = WorkerSpec.from_json(Path(spec_path).read_text(), where=spec_path)
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
