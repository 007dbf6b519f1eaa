"""The pipeline's stages as plain functions, and the paths they resolve.

Each stage takes the run config and earlier stages' typed results and returns a typed result; none imports
Prefect. The order in which they run is core/order.py's `run_pipeline`: flows/pipeline.py passes a runner whose
methods are Prefect tasks (artifacts, retries, one task per device), tests and benchmarks pass `LocalRunner`,
which calls these functions directly.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_pipeline import progress as display
from dflash_pipeline import threads as cpu_threads
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, prepare_dataset, template_fingerprint, tokenizer_fingerprint
from dflash_pipeline.drafter.evaluate import AcceptanceReport, evaluate_export
from dflash_pipeline.drafter.regen_output import reading_regenerated
from dflash_pipeline.drafter.regenerate import RegenProgress
from dflash_pipeline.drafter.regenerate import regenerate as regenerate_responses
from dflash_pipeline.drafter.train import TrainResult
from dflash_pipeline.embedded import resolve_model, resolve_source
from dflash_pipeline.errors import PipelineError, StoreError
from dflash_pipeline.extraction.devicelock import gpu_locks
from dflash_pipeline.extraction.extract import Progress, WorkerResult, run_worker
from dflash_pipeline.extraction.plan import assign_units, pin_token_budget, plan_extraction, store_dtype
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.extraction.probe import probe as probe_target
from dflash_pipeline.extraction.spec import WorkerSpec
from dflash_pipeline.extraction.tokenizer import load_tokenizer
from dflash_pipeline.extraction.validate import ValidationReport
from dflash_pipeline.storage.location import is_resource_error
from dflash_pipeline.storage.store import PlanResult, Store

log = logging.getLogger(__name__)


# ---- paths ------------------------------------------------------------------------------------------------
def _local(path: str) -> str:
    """`~` and $VARS expanded, made absolute against this process's working directory."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(path)))


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """The config with every local path absolute (`~` and environment variables expanded), resolved once in
    the parent, so that no worker, task or deployment run depends on its own working directory. URLs
    (s3://...), hub dataset names and 'embedded' stay as written."""
    target = cfg.target.model_copy(
        update={
            "model_path": cfg.target.model_path
            if cfg.target.model_path == "embedded"
            else _local(cfg.target.model_path),
            "tokenizer_path": cfg.target.tokenizer_path and _local(cfg.target.tokenizer_path),
        }
    )
    source = cfg.data.source
    if source != "embedded" and (os.path.exists(_local(source)) or source.startswith((".", "/", "~", "$"))):
        source = _local(source)
    update: dict[str, Any] = {
        "output_dir": _local(cfg.output_dir),
        "target": target,
        "data": cfg.data.model_copy(update={"source": source}),
        "train": cfg.train.model_copy(update={"output_dir": cfg.train.output_dir and _local(cfg.train.output_dir)}),
    }
    if cfg.store_path and "://" not in cfg.store_path:
        update["store_path"] = _local(cfg.store_path)
    return cfg.model_copy(update=update)


def target_paths(cfg: RunConfig) -> tuple[str, str]:
    """(model directory, tokenizer directory), 'embedded' built on first use."""
    model = resolve_model(cfg.target.model_path)
    return model, resolve_model(cfg.target.tokenizer_path) if cfg.target.tokenizer_path else model


@contextmanager
def writing_output(output_dir: str | Path, writing: str | Path | None = None) -> Iterator[None]:
    """A full, over-quota or read-only filesystem under output_dir is one error naming the file and the fix (an
    output_dir on a full disk was 106 lines of `OSError: [Errno 28]` traceback from writing probe.json)."""
    try:
        yield
    except OSError as e:
        if not is_resource_error(e):
            raise
        path = e.filename or writing or output_dir  # a failed write() names no file: the caller says which
        try:
            free = f"{shutil.disk_usage(output_dir).free / 2**20:.1f} MiB free there"
        except OSError:
            free = "free space unknown"
        raise StoreError(
            f"cannot write {path} ({e.strerror or e}; {free}): free space on that filesystem, or choose another "
            "output_dir (--set output_dir=DIR); a rerun reuses what was finished"
        ) from None


# ---- the stages -------------------------------------------------------------------------------------------
def probe(cfg: RunConfig) -> ProbeReport:
    """What the libraries and the target can do and how to load it; checks model, tokenizer and layer ids
    before any data is touched."""
    model, tokenizer = target_paths(cfg)
    return probe_target(cfg.target, cfg.layers, cfg.extract, model, tokenizer)


def _one_device(spec: str) -> list[str]:
    from dflash_pipeline.drafter.runtime import resolve_device

    return [str(resolve_device(spec))]


def regenerate(cfg: RunConfig, report: ProbeReport, progress: Callable[[RegenProgress], None] | None = None):
    """The dataset's assistant turns rewritten by the target, in this process or by an OpenAI-compatible server
    (regenerate.backend); resumable. Returns RegenerateResult."""
    here = _one_device(cfg.regenerate.device) if cfg.regenerate.backend == "transformers" else []
    with gpu_locks(here, f"regenerating {cfg.regenerated_path}", "regenerate.device"):
        return regenerate_responses(
            resolve_source(cfg.data.source),
            cfg.regenerated_path,
            report,
            cfg.regenerate,
            fmt=cfg.data.format,
            split=cfg.data.split,
            max_samples=cfg.data.max_samples,
            progress=display.tee("regenerate", progress, lambda p: (p.done, p.total), "conversations"),
        )


def regenerated_data(cfg: RunConfig):
    """The data settings of a run once the regenerate stage has written the target's own replies."""
    return cfg.data.model_copy(update={"source": str(cfg.regenerated_path), "format": "messages"})


def prepare(cfg: RunConfig, report: ProbeReport, progress: Callable[[int, float], None] | None = None):
    """Token ids and assistant loss masks (reused when the same preparation exists)."""
    tokenizer = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
    out = Path(cfg.output_dir) / "prepared"
    source = resolve_source(cfg.data.source)
    with writing_output(cfg.output_dir, out), reading_regenerated(source):  # never a half-appended regenerated file
        return prepare_dataset(cfg.data, source, tokenizer, out, progress=progress)


def plan(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult) -> PlanResult:
    """The store version and its units (new, and not yet complete)."""
    tok = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
    return plan_extraction(cfg, report, prepared, tokenizer_fingerprint(tok), template_fingerprint(tok))


def estimate(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult):
    """The pre-flight plan's figures (core/planner.py): samples and tokens kept, store size calibrated on a
    sample, GPU-hours from recorded throughputs, room on the store's disk. Returns StoreEstimate."""
    from dflash_pipeline.planner import estimate as plan_estimate

    return plan_estimate(cfg, report, prepared, store_dtype(cfg, report))


def worker_specs(cfg: RunConfig, report: ProbeReport, plan: PlanResult, devices: list[str] | None = None):
    """One WorkerSpec per device (or split replica), pending units balanced by tokens."""
    devices = devices or report.replicas
    report = pin_token_budget(Store(cfg.store, cfg.store_options), plan.version, report)  # bit-identical resume
    n_cpu = sum(d.startswith("cpu") for d in devices)
    threads = cpu_threads.for_hidden(report.hidden_size) or max(1, (os.cpu_count() or 1) // max(n_cpu, 1))
    return [
        WorkerSpec(
            store_root=cfg.store,
            store_options=cfg.store_options,
            version=plan.version,
            units=units,
            report=report,
            extract=cfg.extract,
            store_dtype=store_dtype(cfg, report),
            device=device,
            threads=threads if device.startswith("cpu") else None,
            spec_dir=str(Path(cfg.output_dir) / "workers"),
        )
        for device, units in assign_units(plan.pending_units, devices).items()
    ]


def extract(spec: WorkerSpec, progress: Callable[[Progress], None] | None = None) -> WorkerResult:
    """One worker: in a child process pinned to its device (extract.isolation=process), else in this one."""
    shown = display.tee("extract", progress, lambda p: (p.tokens_done, p.tokens_total), "tokens", part=spec.name)
    if spec.extract.isolation == "process" and not spec.device.startswith("ray:"):
        from dflash_pipeline.extraction.procs import run_in_process

        return run_in_process(spec, shown, spec.extract.worker_timeout_s)
    return run_worker(spec, shown)


def validate(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, version: str) -> ValidationReport:
    """Check `version` and record the report in the store (validation.json); CURRENT is not moved here."""
    import json

    from dflash_pipeline.extraction.loader import load_compiled
    from dflash_pipeline.extraction.placement import input_device, replica_devices
    from dflash_pipeline.extraction.validate import validate_store

    device = report.replicas[0]  # one GPU, or the GPUs of a split replica
    store = Store(cfg.store, cfg.store_options)
    model = None
    gpus = replica_devices(device) if cfg.validate_.recompute_samples else []
    with gpu_locks(gpus, f"validating store {cfg.store}", "extract.devices"):
        if cfg.validate_.recompute_samples:  # the forward extraction ran (extract.compile), on the same devices
            model, _, _ = load_compiled(report, device, cfg.extract.compile)
        result = validate_store(store, version, prepared, cfg.validate_, model=model, device=input_device(device))
    store.loc.write_atomic(f"{version}/validation.json", json.dumps(result.to_dict(), indent=1).encode())
    return result


def plan_for_validation(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult) -> PlanResult:
    """The version `plan` would continue, found without changing the store (a run that validates without
    extracting never repairs, plans or deletes: Store.survey); validation then reports any damage."""
    from dflash_pipeline.dataprep.prepare import load_prepared
    from dflash_pipeline.extraction.plan import provenance

    tok = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
    prov = provenance(cfg, report, tokenizer_fingerprint(tok), template_fingerprint(tok))
    store = Store(cfg.store, cfg.store_options)
    return store.survey(prov, prepared.fingerprint, list(load_prepared(prepared.path)["sample_id"]))


def _train_world(cfg: RunConfig) -> int:
    """Processes the train stage trains with: every GPU (torchrun) when there are several, else one."""
    import torch

    gpus = torch.cuda.device_count() if cfg.train.device in ("auto", "cuda") else 0
    return gpus if gpus > 1 else 1


def train(cfg: RunConfig, report: ProbeReport, version: str, progress=None) -> TrainResult:
    """Train (resuming from the last checkpoint) and export the drafter: one process on CPU or one GPU,
    torchrun over every GPU otherwise. Refused at once when it would read data that retention deleted; with
    retention.mode=consumed, units are deleted as checkpoints cover their last use (drafter/retention.py)."""
    from dflash_pipeline.drafter.launch import train_with_torchrun
    from dflash_pipeline.drafter.retention import training
    from dflash_pipeline.drafter.train import train as train_drafter

    world = _train_world(cfg)
    gpus = [f"cuda:{i}" for i in range(world)] if world > 1 else _one_device(cfg.train.device)
    with (
        gpu_locks(gpus, f"training {cfg.drafter_dir}", "CUDA_VISIBLE_DEVICES, train.device"),
        training(
            cfg.store,
            cfg.store_options,
            version,
            cfg.train,
            world,
            cfg.drafter_dir,
            cfg.retention.mode,
            cfg.retention.poll_s,
        ),
    ):
        if world > 1:
            return train_with_torchrun(cfg, report, version, world)
        return train_drafter(
            cfg.train,
            cfg.store,
            report,
            cfg.drafter_dir,
            version=version,
            progress=display.tee("train", progress, lambda *a: (a[0], a[1]), "steps"),
            store_options=cfg.store_options,
        )


def retain(cfg: RunConfig, version: str, export_dir: str | None):
    """The retention step after training (retention.mode after_export or consumed; storage/retention.py): first
    the deletions that wait (a reader held a lease, another run held the store lock) or were interrupted, of every
    version; then `after_export` deletes `version`'s hidden states if the export records training from it, and
    `consumed` deletes every unit the training's latest checkpoint covers. A deletion that cannot happen now (a
    reader holds a lease on the version) waits in a request file for the next run. Returns retention.Report."""
    import json

    from dflash_pipeline.storage import retention, retention_record
    from dflash_pipeline.storage.location import LocalLocation

    store = Store(cfg.store, cfg.store_options)
    mode = cfg.retention.mode
    rep = retention.Report(mode, version, store.loc.url_of(f"{version}/{retention_record.RECORD}"))
    rep.swept = [o.line() for o in retention.sweep(store) if o.deleted or o.skipped or o.whole_version]
    if mode == "after_export":
        meta_path = Path(export_dir or "", "dflash_meta.json")
        meta = json.loads(meta_path.read_text()) if export_dir and meta_path.is_file() else {}
        if meta.get("store") != cfg.store or meta.get("store_version") != version:
            rep.note = (
                f"no exported drafter records training from {cfg.store} version {version} (export: {export_dir}, "
                f"which records store {meta.get('store')!r} version {meta.get('store_version')!r})"
            )
        else:
            weights = Path(export_dir, "model.safetensors")
            entry = {
                "mode": "after_export",
                "why": f"a drafter trained from this version ({meta.get('steps')} steps) was exported to "
                f"{export_dir}, and retention.mode=after_export deletes the hidden states it was trained from",
                "export": {
                    "path": str(export_dir),
                    "weights": LocalLocation(weights.parent).digest_of(weights.name),  # size, XXH3-128
                    "steps": meta.get("steps"),
                    "store": meta.get("store"),
                    "store_version": version,
                },
            }
            rep.outcome = retention.retire(store, version, None, entry)
            if rep.outcome.skipped:
                rep.request = retention.request(store, version, None, entry, rep.outcome.skipped)
    elif mode == "consumed":
        from dflash_pipeline.drafter.retention import final_pass

        rep.outcome, left = final_pass(
            cfg.store, cfg.store_options, version, cfg.train, _train_world(cfg), cfg.drafter_dir
        )
        if rep.outcome is not None and rep.outcome.skipped and left:
            entry = {
                "mode": "consumed",
                "why": f"the training writing {cfg.drafter_dir} consumed them (its latest checkpoint covers their "
                "last use)",
                "training": str(cfg.drafter_dir),
            }
            rep.request = retention.request(store, version, left, entry, rep.outcome.skipped)
        elif rep.outcome is None:
            rep.note = "every unit the training consumed was deleted at its checkpoint during training"
    rep.so_far = retention.summary(store, version)
    log.info("%s", rep.line())
    return rep


def evaluate(cfg: RunConfig, report: ProbeReport, export_dir: str) -> AcceptanceReport:
    """Acceptance length of the exported drafter on held-out prompts (and of an untrained one)."""
    if not export_dir or not Path(export_dir).exists():
        raise PipelineError(f"no exported drafter at {export_dir!r}: run the train stage first")
    with gpu_locks(_one_device(cfg.evaluate.device), f"evaluating {export_dir}", "evaluate.device"):
        return evaluate_export(export_dir, report, cfg.evaluate, baseline=True)
