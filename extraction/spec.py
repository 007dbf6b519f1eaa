"""The extraction worker's input: everything one worker needs, as one typed, versioned hand-off (written by
the parent, read by `python -m dflash_pipeline.extraction.worker_main SPEC.json`)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_pipeline.extraction.config import ExtractConfig
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.handoff import Handoff


@dataclass(frozen=True, kw_only=True)
class WorkerSpec(Handoff):
    KIND = "extract-worker"
    VERSION = 1

    store_root: str  # absolute local path or s3:// URL
    store_options: dict | None = None  # non-secret options of an s3:// store (RunConfig.store_options)
    version: str  # the store version the units belong to
    units: list[str]  # the units this worker extracts; complete ones are skipped
    report: ProbeReport  # the target and how to load it
    extract: ExtractConfig
    store_dtype: str  # a key of storage.layout.DTYPES
    device: str  # as the worker sees it: "cpu", "cuda:0", or a split replica's GPUs "cuda:0+cuda:1"
    label: str = ""  # the device as the parent named it (logs, GPU lock); defaults to `device`
    threads: int | None = None  # torch CPU threads of a CPU worker
    writers: int | None = None  # overrides the default number of shard writers (benchmarks compare)
    # Where the parent writes this spec for its worker process (`<output_dir>/workers`): a SIGKILL of the run before
    # the worker read it leaves the file there, where the next run's worker of the same store and device replaces
    # it, not in TMPDIR. "" (library use): the system's temporary directory.
    spec_dir: str = ""

    @property
    def name(self) -> str:
        return self.label or self.device
