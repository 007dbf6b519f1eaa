"""The pre-flight plan's calibration (core/planner.py): store bytes per token measured on a sample of the prepared
dataset, written into a scratch store under <output_dir>/plan by the pipeline's own planner and writer with the run's
precision, store dtype, compression and chunking. The rows are the target's real hidden states (the extraction
worker on the CPU) when its weights are small (plan.calibration=auto: under CALIBRATE_FORWARD_MAX_GIB), else
synthetic ones: Gaussian values with log-normal per-channel scales (sigma 0.5) in the store dtype, the statistics
of hidden states that decide how well they compress. A calibration with the same key is read back, not redone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from dflash_pipeline import threads as cpu_threads
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, load_prepared
from dflash_pipeline.extraction.plan import target_identity
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.storage import quant
from dflash_pipeline.storage.commit import crash_points_off, write_atomic
from dflash_pipeline.storage.discard import discard_units
from dflash_pipeline.storage.layout import DTYPES, FORMAT_VERSION, to_storage
from dflash_pipeline.storage.planning import plan_units
from dflash_pipeline.storage.shardio import pid_alive
from dflash_pipeline.storage.store import Store

CALIBRATE_FORWARD_MAX_GIB = 2.0  # plan.calibration=auto runs the real target on the CPU up to this size
CALIBRATION_VERSION = 2  # in the calibration's key: a change to how it is measured measures again (2: int8 group steps)


def _pick(lengths: list[int], tokens: int, seed: int = 0) -> list[int]:
    """Random prepared rows until `tokens` tokens are picked (at least one)."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    picked, total = [], 0
    for i in order:
        if picked and total >= tokens:
            break
        picked.append(i)
        total += lengths[i]
    return picked


def _synthetic_rows(n: int, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    channel = torch.exp(0.5 * torch.randn(shape, generator=gen))
    return (torch.randn((n, *shape), generator=gen) * channel).to(dtype)


def _write_synthetic(store: Store, version: str, unit: str, report: ProbeReport, logical: str, precision: str):
    from dflash_pipeline.storage.writer import UnitWriter

    w = UnitWriter(store.unit_location(version, unit))
    gen = torch.Generator().manual_seed(0)
    k, h, dtype = len(report.layer_ids), report.hidden_size, DTYPES[logical][1]
    try:
        for s0 in range(0, w.n_tokens, 4096):
            n = min(4096, w.n_tokens - s0)
            rows = {"hidden": _synthetic_rows(n, (k, h), dtype, gen)}
            if report.capture_last:
                rows["last_hidden"] = _synthetic_rows(n, (h,), dtype, gen)
            if precision == "full":
                out = {a: to_storage(r, logical) for a, r in rows.items()}
            else:
                out = {}
                for a, r in rows.items():
                    q, s = quant.quantize(r, precision)
                    out[a], out[quant.SCALE_OF[a]] = q.numpy(), s.numpy()
            w.add(s0, out.pop("hidden"), out.pop("last_hidden", None), **out)
        w.finish()
    finally:
        w.close()


def _file_bytes(root: Path) -> tuple[int, int]:
    """(bytes of data chunks and shards, bytes of every other file) under a store version."""
    data = meta = 0
    for p in root.rglob("*"):
        if p.is_file():
            if "/c/" in p.relative_to(root).as_posix() or p.relative_to(root).as_posix().startswith("c/"):
                data += p.stat().st_size
            else:
                meta += p.stat().st_size
    return data, meta


def calibrate(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, logical: str) -> tuple[float, float, str]:
    """(data bytes per token, metadata bytes per sample, how it was measured): a calibration sample written into
    a scratch store as the run would write it (see the module doc). Metadata (zarr.json files with the sample
    tables, plan and commit records) is counted per sample: it grows with the sample tables."""
    return calibrate_reused(cfg, report, prepared, logical)[:3]


def calibration_key(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, logical: str, mode: str) -> str:
    """What decides a calibration's figures: the target and what is stored of it (target_identity), the prepared
    dataset (its rows are the sample), how many tokens are sampled and how (forward or synthetic), and the store's
    compression and chunking."""
    x = cfg.extract
    what = {
        "calibration": CALIBRATION_VERSION,
        "identity": target_identity(cfg, report, logical),
        "prepared": prepared.fingerprint,
        "mode": mode,
        "tokens": cfg.plan.calibration_tokens,
        "store": [x.compression, x.chunk_mib, x.shard_mib],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def plan_dir(cfg: RunConfig) -> Path:
    """Where the planner keeps its calibrations and, while it measures, its scratch store: under the run's
    output_dir (never the system's temporary directory, which a SIGKILLed run would leave it in)."""
    return Path(cfg.output_dir) / "plan"


def calibrate_reused(
    cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, logical: str
) -> tuple[float, float, str, bool]:
    """`calibrate`'s figures and whether they were reused: a calibration with the same key (calibration_key) is
    read back from <output_dir>/plan/calibration-KEY.json instead of writing its sample again (a rerun, `plan`
    then `run`)."""
    mode = cfg.plan.calibration
    if mode == "auto":
        mode = "forward" if report.weights_gib <= CALIBRATE_FORWARD_MAX_GIB else "synthetic"
    root = plan_dir(cfg)
    record = root / f"calibration-{calibration_key(cfg, report, prepared, logical, mode)}.json"
    try:
        done = json.loads(record.read_text())
        return float(done["bytes_per_token"]), float(done["metadata_bytes_per_sample"]), done["how"], True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ds = load_prepared(prepared.path)
    rows = _pick(list(ds["seq_len"]), cfg.plan.calibration_tokens)
    with scratch_dir(root) as scratch, crash_points_off(), _quiet(scratch):
        # crash_points_off: a scratch store; the kill tests' fault injection counts the real one only
        per_token, meta, how = _calibrate_into(scratch, cfg, report, prepared, logical, ds, rows, mode)
    if "failed" not in how:  # a forward that fell back to synthetic rows is measured again next time
        doc = {"bytes_per_token": per_token, "metadata_bytes_per_sample": meta, "how": how}
        write_atomic(record, json.dumps(doc, indent=1).encode())
    return per_token, meta, how, False


@contextlib.contextmanager
def scratch_dir(root: Path) -> Iterator[Path]:
    """A scratch directory `root/scratch-PID-*`, removed at the end; one that a killed process left behind (its pid
    is gone) is removed first."""
    root.mkdir(parents=True, exist_ok=True)
    for left in root.glob("scratch-*"):
        pid = left.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"scratch-{os.getpid()}-", dir=root))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _NotAbout(logging.Filter):
    """Drops the INFO records of the calibration's own store and worker (they are not the run's store)."""

    def __init__(self, thread: int):
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.thread != self.thread


@contextlib.contextmanager
def _quiet(scratch: Path) -> Iterator[None]:
    flt = _NotAbout(threading.get_ident())
    loggers = [logging.getLogger(f"dflash_pipeline.{n}") for n in ("storage.store", "extraction.extract")]
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


def _calibrate_into(scratch: Path, cfg, report, prepared, logical, ds, rows, mode) -> tuple[float, float, str]:
    from dflash_pipeline.extraction.extract import run_worker
    from dflash_pipeline.extraction.spec import WorkerSpec

    x, precision = cfg.extract, cfg.extract.store_precision
    store = Store(scratch / "store")
    prov = {
        "format_version": FORMAT_VERSION,
        "layer_ids": report.layer_ids,
        "hidden_size": report.hidden_size,
        "capture_last": report.capture_last,
        "logical_dtype": logical,
        **quant.precision_attrs(precision),
        "compute_dtype": report.compute_dtype,
    }
    version = store.resolve_version(prov, prepared.fingerprint, new_version=False, incremental=False)
    sub = ds.select(rows)

    def fetch(idx: list[int]):
        part = sub.select(idx)
        return part["input_ids"], part["loss_mask"]

    ids, lens = list(sub["sample_id"]), list(sub["seq_len"])
    plan = plan_units(store, version, ids, lens, fetch, 1 << 62, x.chunk_mib, x.shard_mib, x.compression)
    unit, n = plan.new_units[0].name, plan.new_units[0].n_tokens
    fallback = ""
    if mode == "forward":
        # On the CPU: the GPU-only kernels a GPU run's report may name are swapped for their portable twins.
        attn = report.attn_implementation
        cpu_report = replace(
            report,
            replicas=["cpu"],
            conv_kernel="transformers",
            gdn_forward="transformers",
            attn_implementation="sdpa" if attn and "flash" in attn else attn,
        )
        spec = WorkerSpec(
            store_root=str(store.url),
            version=version,
            units=[unit],
            report=cpu_report,
            extract=x.model_copy(update={"store_writers": "threads", "compile": "off"}),
            store_dtype=logical,
            device="cpu",
            threads=cpu_threads.for_hidden(report.hidden_size) or os.cpu_count() or 1,
        )
        try:
            run_worker(spec)
            how = "the target's own hidden states (extraction on the CPU)"
        except Exception as e:  # noqa: BLE001 - a plan must not fail on its calibration: say so, use synthetic
            fallback = f" (the CPU forward failed: {type(e).__name__}: {str(e)[:200]})"
            mode = "synthetic"
            discard_units(store, version, [unit])  # recreated empty from its plan record
            plan_units(store, version, ids, lens, fetch, 1 << 62, x.chunk_mib, x.shard_mib, x.compression)
    if mode != "forward":
        _write_synthetic(store, version, unit, report, logical, precision)
        how = "synthetic rows (Gaussian, log-normal channel scales)" + fallback
    data, meta = _file_bytes(scratch / "store" / version)
    return data / n, meta / len(rows), f"{how}, {len(rows)} samples, {n:,} tokens, written with the run's settings"
