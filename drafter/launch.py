"""Drafter training over several GPUs: torchrun, one process per GPU, each reading the same TrainJob."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from dflash_pipeline.config import RunConfig
from dflash_pipeline.drafter.train import TrainJob, TrainResult
from dflash_pipeline.extraction.probe import ProbeReport

log = logging.getLogger(__name__)


def train_with_torchrun(cfg: RunConfig, report: ProbeReport, version: str | None, gpus: int) -> TrainResult:
    out = cfg.drafter_dir
    out.mkdir(parents=True, exist_ok=True)
    job = out / "job.json"
    spec = TrainJob(
        train=cfg.train,
        store=cfg.store,
        store_options=cfg.store_options,
        report=report,
        output_dir=str(out),
        version=version,
    )
    job.write_text(spec.to_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}"]
    cmd += ["-m", "dflash_pipeline.drafter.train", str(job)]
    log.info("launching %s", " ".join(cmd))
    proc = subprocess.run(cmd, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun drafter training exited with {proc.returncode}; a retry resumes from "
            f"the last checkpoint in {out / 'checkpoints'}"
        )
    return TrainResult(**json.loads((out / "result.json").read_text()))
