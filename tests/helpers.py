"""Test helpers: the pipeline's stages composed without Prefect (the same logic the tasks call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.config import RunConfig, load_config
from dflash_pipeline.dataprep.prepare import PrepareResult
from dflash_pipeline.extraction.extract import WorkerResult
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.validate import ValidationReport
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.storage.layout import ARRAYS
from dflash_pipeline.storage.store import PlanResult, Store


@dataclass
class Extracted:
    cfg: RunConfig
    prepared: PrepareResult
    report: ProbeReport
    plan: PlanResult
    result: WorkerResult
    validation: ValidationReport | None = None  # extract_local(..., validate=True): the report that published it

    @property
    def store(self) -> str:
        return str(self.cfg.store)


def config(out: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    base = {"output_dir": str(out), "extract.devices": "cpu", "extract.isolation": "thread"}
    return load_config(None, {**base, **(overrides or {})})


def extract_local(out: Path, overrides: dict[str, Any] | None = None, validate: bool = False) -> Extracted:
    """prepare + extract through the pipeline's own stage order, without Prefect, the worker in this process.
    The version is extracted, not validated: the default reader refuses it (read it with unvalidated="warn").
    `validate=True` adds the validate stage, which publishes the version (CURRENT) the way a run does: a store
    that readers and training read by default."""
    stages = ["prepare", "extract", "validate"] if validate else ["prepare", "extract"]
    cfg = config(out, {"stages": stages, **(overrides or {})})
    runner = LocalRunner()
    run_pipeline(cfg, runner)
    r = runner.results
    workers = r.get("extract") or [WorkerResult(device="cpu", units=[])]
    return Extracted(cfg, r["prepare"], r["probe"], r["plan"], workers[0], r.get("validate"))


# The kill tests' extraction: several units, several 273-token shards each, several batches per shard.
KILL_OVERRIDES = {
    "data.max_samples": 40,
    "layers.preset": "explicit",
    "layers.ids": [1, 3, 5],
    "layers.capture_last": True,
    "extract.unit_tokens": 1500,
    "extract.shard_mib": 0.2,
    "extract.chunk_mib": 0.05,
    "extract.token_budget": 300,
}


def run_extract_proc(out: Path, overrides: dict[str, Any], kill_at: str | None = None) -> subprocess.CompletedProcess:
    """extract_local in a subprocess (tests/extract_proc.py), SIGKILLed at `kill_at` (storage.commit.crash_point)."""
    env = {**os.environ}
    if kill_at:
        env["DFLASH_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "tests.extract_proc", str(out), json.dumps(overrides)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )


def snapshot(store: Store, version: str) -> dict:
    """Every unit's arrays (raw stored values), sample table and commit record."""
    snap = {}
    for u in store.units(version):
        g = store.open_unit(version, u)
        snap[u] = {k: g[k][:] for k in ARRAYS if k in g}
        snap[u]["samples"] = g.attrs["samples"]
        snap[u]["commit"] = store.commit_record(version, u)
    return snap


def assert_same_store(a: dict, b: dict) -> None:
    """Two snapshots hold the same units, samples, commit records and bit-identical arrays."""
    assert a.keys() == b.keys()
    for u in a:
        assert a[u]["samples"] == b[u]["samples"] and a[u]["commit"] == b[u]["commit"], u
        arrays = [k for k in a[u] if k not in ("samples", "commit")]
        assert arrays == [k for k in b[u] if k not in ("samples", "commit")], u
        for k in arrays:
            assert np.array_equal(a[u][k], b[u][k]), (u, k)  # bit-identical (raw stored bytes)
