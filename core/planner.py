"""The pre-flight plan: what a run will keep, how much disk its store takes, how many GPU-hours its extraction
and training take, and whether the output disk has room (`dflash-pipeline plan`; `run` computes the same and
refuses to start extraction when the store does not fit, unless plan.disk_check=false).

Store size = tokens x bytes per token measured on a calibration sample (plus each unit's metadata files): a few
thousand tokens of the prepared dataset written into a scratch store as the run would write them, and the bytes of
the files that result counted (core/calibration.py).

GPU-hours come from the rates the benchmarks recorded in core/rates.json (written by bench/rates.py from the raw
bench files, never typed by hand; core/cost.py, docs/COST.md): the whole recipe's stages per GPU kind, for the GPUs
the run uses (plan.gpus), each line naming the record it rests on and how it was scaled.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_pipeline import cost
from dflash_pipeline.calibration import calibrate_reused
from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, load_prepared
from dflash_pipeline.errors import StoreError
from dflash_pipeline.extraction.modelfiles import read_model_config
from dflash_pipeline.extraction.plan import target_identity
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.progress import counted
from dflash_pipeline.storage import diskcheck, quant, retention_record
from dflash_pipeline.storage.identity import other_dataset, same_identity
from dflash_pipeline.storage.layout import DTYPES
from dflash_pipeline.storage.store import Store

REFUSED = "a run with these settings will be refused: "  # the note that makes `plan` exit 1
GPU_PEAK_TFLOPS = cost.GPU_PEAK_TFLOPS  # dense bf16 peak per GPU kind (vendors' data sheets)


@dataclass
class StoreEstimate:
    """The plan's figures (what `dflash-pipeline plan` prints and `run` publishes as an artifact)."""

    samples: int
    tokens: int
    supervised_tokens: int
    rows_read: int
    quarantined: int
    dropped: dict[str, int]
    precision: str
    logical_dtype: str
    compression: str
    layers: list[int]
    hidden_size: int
    capture_last: bool
    raw_bf16_bytes_per_token: int  # hidden (+ last) in bf16, uncompressed: the reference the issue measures by
    bytes_per_token: float  # calibrated, on disk (data, scales, ids, mask)
    metadata_bytes_per_sample: float  # zarr.json files (sample tables), plan and commit records
    units: int
    store_bytes: int
    calibration: str
    store: str
    already_committed_tokens: int
    needed_bytes: int
    free_bytes: int | None
    free_source: str
    fits: bool
    gpu: str | None
    gpu_source: str
    extract_tokens_per_s: float | None = None
    small_target: bool = False  # under SMALL_TARGET parameters per token: the rates above are lower bounds of time,
    # not printed (to_dict keeps them)
    extract_gpu_hours: float | None = None
    train_tokens_per_s: float | None = None
    train_gpu_hours: float | None = None
    throughput_basis: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    calibration_reused: bool = False  # read back from an earlier calibration with the same key (calibration.plan_dir)
    # plan.write_test_mib: the store disk's measured write bandwidth against each precision (storage/diskcheck.py)
    disk_advice: dict | None = None
    disk_lines: list[str] = field(default_factory=list)
    gpus: int = 1  # GPUs the cost is planned for (plan.gpus)
    cost: list[dict] = field(default_factory=list)  # per GPU kind: core/cost.py's Cost.to_dict
    cost_lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def of_raw_bf16(self) -> float:
        return self.bytes_per_token / self.raw_bf16_bytes_per_token

    def lines(self) -> list[str]:
        gib = 2**30
        if self.small_target:  # (a fresh-user check: "863,577,085 tokens/s per H100" for the embedded target)
            hours = (
                "not estimated: the target is too small for rates scaled by FLOPs from large targets (per-batch "
                "overheads bound its speed; a short run measures it)"
            )
        elif self.extract_gpu_hours is None:
            hours = "not estimated"
        else:
            hours = (
                f"extraction {self.extract_gpu_hours:.3g} GPU-hours ({self.extract_tokens_per_s:,.0f} tokens/s per "
                f"{self.gpu}), training {self.train_gpu_hours:.3g} GPU-hours ({self.train_tokens_per_s:,.0f} tokens/s)"
            )
        free = f"{self.free_bytes / gib:,.3f} GiB free ({self.free_source})" if self.free_bytes is not None else ""
        room = (
            f"{'fits' if self.fits else 'DOES NOT FIT'}: "
            + (f"needs {self.needed_bytes / gib:,.3f} GiB" if self.needed_bytes else "nothing left to write")
            + f", {free}"
            if self.free_bytes is not None
            else f"not checked ({self.free_source})"
        )
        return [
            f"data: {self.samples:,} samples kept of {self.rows_read:,} rows read ({self.quarantined:,} quarantined, "
            f"dropped {self.dropped or 'none'}); {self.tokens:,} tokens, {self.supervised_tokens:,} supervised",
            f"store: layers {self.layers} x hidden {self.hidden_size}{' + last' if self.capture_last else ''}, "
            f"precision {self.precision} ({self.logical_dtype} on read), compression {self.compression}",
            f"bytes per token: {self.bytes_per_token:,.1f} on disk = {self.of_raw_bf16:.3f} of raw bf16 "
            f"({self.raw_bf16_bytes_per_token:,}); calibrated: {self.calibration}"
            + (" (an earlier calibration with the same inputs, reused)" if self.calibration_reused else ""),
            f"store size: {self.store_bytes / gib:,.3f} GiB ({self.store_bytes:,} bytes, "
            f"{counted(self.units, 'unit')}) at {self.store}",
            f"disk: {room}",
            f"GPU ({self.gpu or '-'}, {self.gpu_source}): {hours}",
            *(f"throughput basis: {b}" for b in ([] if self.small_target else self.throughput_basis)),
            *self.cost_lines,
            *(f"note: {n}" for n in self.notes),
            *self.disk_lines,
        ]

    def to_markdown(self) -> str:
        """The plan as markdown (the preflight task's artifact): the lines, the cost table as a table."""
        table = [x for x in self.cost_lines if x.startswith("|")]
        rest = [x for x in self.lines() if x not in table]
        at = next((i for i, x in enumerate(rest) if x.startswith("GPU cost of the recipe")), None)
        items = [f"- {x}" for x in rest]
        if at is not None and table:
            items[at + 1 : at + 1] = ["", *table, ""]
        return "# Pre-flight plan\n\n" + "\n".join(items) + "\n"


# ---- GPU-hours ---------------------------------------------------------------------------------------------
def params_per_token(report: ProbeReport) -> float:
    """Parameters of the decoder layers a token passes through during extraction (up to the highest captured
    layer: the forward stops there), from the checkpoint's config.json; MoE layers count their active experts."""
    return _target(report)["params_per_token"]


def _text_config(report: ProbeReport) -> dict:
    mc = read_model_config(report.model_path)
    return mc.get("text_config") or mc


def _target(report: ProbeReport) -> dict:
    return cost.target_shape(_text_config(report), report.layer_types, report.layer_ids, report.capture_last)


def _gpus(cfg: RunConfig, report: ProbeReport) -> tuple[int, str]:
    """GPUs the cost is planned for: plan.gpus, else the GPU workers this run would start here (at least 1)."""
    if cfg.plan.gpus:
        return cfg.plan.gpus, "plan.gpus"
    n = sum(r.startswith("cuda") for r in report.replicas)
    return max(n, 1), ("the GPU workers extract.devices gives here" if n else "no GPU here; plan.gpus=N plans for N")


def work_of(
    cfg: RunConfig,
    report: ProbeReport,
    prepared: PrepareResult,
    committed: int,
    gpus: int,
    disk_bytes_per_s: float | None = None,
) -> cost.Work:
    """What the run does, in the amounts core/cost.py prices: tokens left to extract, tokens x epochs trained (the
    packing and batch of train.*), conversations regenerated, prompts evaluated."""
    t, k = _text_config(report), len(report.layer_ids)
    tc, stages = cfg.train, set(cfg.stages)
    regen = cfg.regenerate.enabled and "regenerate" in stages
    return cost.Work(
        target=_target(report),
        drafter=cost.drafter_shape(t, tc.num_draft_layers or k, k, tc.block_size, tc.anchors_per_sample),
        tokens=max(prepared.n_tokens - committed, 0) if "extract" in stages else 0,
        samples=prepared.n_samples,
        supervised=prepared.n_supervised_tokens,
        epochs=tc.epochs if "train" in stages else 0.0,
        batch_size=tc.batch_size,
        grad_accum=tc.grad_accum,
        pack=tc.pack,
        max_steps=tc.max_steps,
        fp8_target=(report.quantization or {}).get("forward") == "fp8",
        regenerate=prepared.n_samples if regen else 0,
        max_new_tokens=cfg.regenerate.max_new_tokens,
        regen_batch=cfg.regenerate.batch_size,
        eval_prompts=(cfg.evaluate.num_prompts or 0) if "evaluate" in stages else 0,
        eval_new_tokens=cfg.evaluate.max_new_tokens,
        validate="validate" in stages,
        gpus=gpus,
        flops_bound=_target(report)["params_per_token"] >= SMALL_TARGET,
        per_sample=_sample_work(prepared, tc.anchors_per_sample, tc.block_size),
        checkpoint_every=tc.checkpoint_every,
        disk_bytes_per_s=disk_bytes_per_s,
    )


def _sample_work(prepared: PrepareResult, anchors: int, block: int) -> dict | None:
    """The training work per sample of the prepared data (core/cost.py's sample_work): anchors from each sample's
    length, at the dataset's share of supervised tokens."""
    try:
        lengths = load_prepared(prepared.path)["seq_len"]
    except (OSError, ValueError, KeyError):
        return None
    share = prepared.n_supervised_tokens / max(prepared.n_tokens, 1)
    return cost.sample_work(lengths, share, anchors, block)


def _gpu_name(cfg: RunConfig, report: ProbeReport) -> tuple[str | None, str]:
    if cfg.plan.gpu != "auto":
        name = cfg.plan.gpu
        return name, "named by plan.gpu"
    gpus = [d.kind for d in report.devices if d.name.startswith("cuda")]
    if not gpus:
        return None, "no GPU visible here: name the GPU the run will use with plan.gpu (e.g. H100)"
    return gpus[0], f"detected: {len(gpus)} x {gpus[0]}"


def _peak(name: str) -> float | None:
    return cost.peak(cost.gpu_kind(name))


# ---- the estimate ------------------------------------------------------------------------------------------
def _free_bytes(cfg: RunConfig) -> tuple[int | None, str]:
    if cfg.plan.disk_quota_gib is not None:
        return int(cfg.plan.disk_quota_gib * 2**30), "plan.disk_quota_gib"
    if "://" in cfg.store:
        return None, "object storage: its free space is not known here"
    p = Path(cfg.store)
    existing = next((a for a in (p, *p.parents) if a.exists()), Path("/"))
    return shutil.disk_usage(existing).free, f"free space of the filesystem of {existing}"


def _continued(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, logical: str) -> tuple[int, str | None]:
    """(tokens of this dataset's samples that the version this run continues (the newest with its identity; none
    with extract.new_version) already committed, why the run will be refused that version for its dataset or None).
    A resumed run writes only the rest. Samples of other datasets, and units whose data retention deleted (a rerun
    writes them again), do not count. As storage/store.py's resolve_version decides, reading only."""
    if "://" not in cfg.store and not Path(cfg.store).exists():
        return 0, None
    try:
        store = Store(cfg.store, cfg.store_options)
        identity = target_identity(cfg, report, logical)  # format_version included
        kept = [v for v in store.versions() if not retention_record.read_record(store, v).get("prune")]
        v = next((v for v in reversed(kept) if same_identity(store.attrs(v), identity)), None)
        if v is None:
            return 0, None
        held = store.attrs(v).get("dataset_fingerprints") or []
        if prepared.fingerprint not in held and not cfg.extract.incremental:
            return 0, other_dataset(store.loc.url_of(v), held, prepared.fingerprint)
        if cfg.extract.new_version:
            return 0, None
        units = store.units(v)
        gone = retention_record.retired(retention_record.read_record(store, v), units)
        ours, total = None, 0
        for u in units:
            committed = store.commit_record(v, u).get("committed_tokens", 0)
            if not committed or u in gone:
                continue
            ours = ours if ours is not None else set(load_prepared(prepared.path)["sample_id"])
            total += sum(
                n for sid, start, n in store.unit_attrs(v, u)["samples"] if start + n <= committed and sid in ours
            )
        return total, None
    except (OSError, ValueError):
        return 0, None


def estimate(cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, logical: str) -> StoreEstimate:
    """Every figure of the plan; nothing here touches a GPU."""
    per_token, sample_meta, how, reused = calibrate_reused(cfg, report, prepared, logical)
    tokens, k, h = prepared.n_tokens, len(report.layer_ids), report.hidden_size
    units = max(1, math.ceil(tokens / cfg.extract.unit_tokens))
    store_bytes = int(per_token * tokens + sample_meta * prepared.n_samples)
    committed, refusal = _continued(cfg, report, prepared, logical)
    committed = min(committed, tokens)
    needed = int(store_bytes * (tokens - committed) / max(tokens, 1))
    free, free_source = _free_bytes(cfg)
    gpu, gpu_source = _gpu_name(cfg, report)
    notes = []
    if cfg.regenerate.enabled and str(cfg.data.source) != str(cfg.regenerated_path):
        notes.append(  # `plan` (a run prepares and measures the regenerated replies, once they exist)
            "regenerate is on: the figures count the replies of data.source; the regenerated replies "
            f"(at most regenerate.max_new_tokens={cfg.regenerate.max_new_tokens} tokens each) replace them, so "
            "the run prepares that set anew"
        )
    if refusal:
        notes.append(f"{REFUSED}{refusal}")
    if committed:
        notes.append(f"{committed:,} tokens are already committed in the store: only the rest is written")
    est = StoreEstimate(
        samples=prepared.n_samples,
        tokens=tokens,
        supervised_tokens=prepared.n_supervised_tokens,
        rows_read=prepared.n_rows,
        quarantined=prepared.quarantined,
        dropped=dict(prepared.dropped),
        precision=cfg.extract.store_precision,
        logical_dtype=logical,
        compression=cfg.extract.compression,
        layers=list(report.layer_ids),
        hidden_size=h,
        capture_last=report.capture_last,
        raw_bf16_bytes_per_token=2 * h * (k + (1 if report.capture_last else 0)),
        bytes_per_token=store_bytes / max(tokens, 1),
        metadata_bytes_per_sample=sample_meta,
        units=units,
        store_bytes=store_bytes,
        calibration=how,
        store=cfg.store,
        already_committed_tokens=committed,
        needed_bytes=needed,
        free_bytes=free,
        free_source=free_source,
        fits=free is None or needed <= free,
        gpu=gpu,
        gpu_source=gpu_source,
        notes=notes,
        calibration_reused=reused,
    )
    _gpu_cost(est, cfg, report, prepared, committed)
    est.disk_advice, est.disk_lines = disk_check(cfg, report, est, logical)
    written = ((est.disk_advice or {}).get("write_test") or {}).get("bytes_per_s")
    if written:  # the disk's measured speed prices the drafter's checkpoints too
        _gpu_cost(est, cfg, report, prepared, committed, written)
    return est


def _gpu_cost(
    est: StoreEstimate,
    cfg: RunConfig,
    report: ProbeReport,
    prepared: PrepareResult,
    committed: int,
    disk_bytes_per_s: float | None = None,
):
    """The recipe's GPU-hours per GPU kind (core/cost.py), and the plan's older GPU line for plan.gpu from them;
    disk_bytes_per_s: the output disk's measured write speed (the drafter's checkpoints)."""
    records = cost.load_rates()
    est.gpus, how = _gpus(cfg, report)
    work = work_of(cfg, report, prepared, committed, est.gpus, disk_bytes_per_s)
    kind = cost.gpu_kind(est.gpu)
    if est.gpu and kind not in {r.get("gpu") for r in records} and cost.peak(kind) is None:
        unknown = f"; no recorded rate or bf16 peak for {est.gpu!r} (known: {', '.join(GPU_PEAK_TFLOPS)})"
        if unknown not in est.gpu_source:  # (priced twice when the disk's speed was measured)
            est.gpu_source += unknown
        kind = None
    costs = [cost.estimate(records, work, k) for k in cost.kinds(records, kind)]
    est.cost = [c.to_dict() for c in costs]
    est.small_target = bool(est.gpu) and not work.flops_bound
    if not any(s.gpu_hours is not None for c in costs for s in c.stages):
        why = (
            "the target is too small for rates scaled by FLOPs from other shapes, and no bench measured its shape"
            if not work.flops_bound
            else "no record in core/rates.json fits this run"
        )
        est.cost_lines = [f"GPU cost of the recipe: not estimated ({why}; docs/COST.md)"]
    else:
        est.cost_lines = cost.table_lines(costs) + [f"cost GPUs: {est.gpus} ({how})"]
        if est.gpus > 1 and not any(s.scaling for c in costs for s in c.stages):
            est.cost_lines.append("cost scaling: the stages estimated run on one GPU")
    mine = next((c for c in costs if c.gpu == kind), None)
    if mine is None:
        return
    by = {s.stage: s for s in mine.stages}
    ex, tr = by.get("extract"), by.get("train")
    if ex is None or ex.gpu_hours is None or tr is None or tr.gpu_hours is None:
        return
    est.small_target = False  # rates of its own shape, or scaled between FLOPs-bound targets
    est.extract_gpu_hours, est.train_gpu_hours = ex.gpu_hours, tr.gpu_hours
    est.extract_tokens_per_s = work.tokens / max(ex.gpu_hours * 3600, 1e-9)
    est.train_tokens_per_s = work.train_tokens / max(tr.gpu_hours * 3600, 1e-9)
    est.throughput_basis = [ex.basis, f"{tr.basis}; {work.epochs:g} epochs"]


def precision_bytes_per_token(est: StoreEstimate, logical: str) -> dict[str, float]:
    """Bytes per token on disk of each precision (PRECISIONS order): the run's own precision as calibrated, the
    others from their formats uncompressed (an upper bound: quantized values compress little, bf16 ~1.45x), each
    with the ids, the mask and the calibrated metadata per token."""
    rows = len(est.layers) + (1 if est.capture_last else 0)
    extra = 4 + 1 + est.metadata_bytes_per_sample * est.samples / max(est.tokens, 1)  # input_ids, loss_mask
    out = {}
    for p in quant.PRECISIONS:
        if p == est.precision:
            out[p] = est.bytes_per_token
            continue
        try:
            out[p] = rows * quant.row_bytes(p, est.hidden_size, DTYPES[logical][0].itemsize) + extra
        except ValueError:  # int4 on an odd hidden size
            continue
    return out


# Parameters per token under which a target's speed is bound by per-batch overheads, not FLOPs: rates scaled from
# the recorded large targets say nothing about it.
SMALL_TARGET = 0.5e9


def disk_check(cfg: RunConfig, report: ProbeReport, est: StoreEstimate, logical: str) -> tuple[dict | None, list[str]]:
    """(diskcheck.advise's figures, the plan's lines about them): plan.write_test_mib MiB written to the store's
    disk, compared with what each precision would produce at the estimated extraction rate of every GPU worker."""
    mib = cfg.plan.write_test_mib
    if not mib:
        return None, [
            "disk write speed: not measured (plan.write_test_mib=0; e.g. 4096 measures it and says which store "
            "precision keeps extraction GPU-bound)"
        ]
    if "://" in cfg.store:
        return None, ["disk write speed: not measured (object storage)"]
    p = Path(cfg.store)
    where = next((a for a in (p, *p.parents) if a.exists()), Path("/"))
    try:
        test = diskcheck.measure_write_bandwidth(where, mib)
    except OSError as e:
        return None, [f"disk write speed: the write test in {where} failed ({e.strerror or e}); not compared"]
    lines = [f"disk write speed: {test.line()}"]
    if est.small_target:  # (a fresh-user check: "863,577,085 tokens/s per H100", then int4)
        return None, [
            *lines,
            "disk vs GPU: not compared (the target is small: the extraction rate scaled from large targets "
            "overstates its speed, and so the bytes per second it would write)",
        ]
    if not est.extract_tokens_per_s:
        return None, [*lines, "disk vs GPU: not compared (no GPU throughput estimate: name the GPU with plan.gpu)"]
    workers = max(1, sum(r.startswith("cuda") for r in report.replicas))
    advice = diskcheck.advise(
        test.bytes_per_s,
        est.extract_tokens_per_s * workers,
        est.tokens,
        precision_bytes_per_token(est, logical),
        tested_bytes=test.bytes,
    )
    lines += advice.lines()
    if advice.recommended != est.precision:
        pick = next(o for o in advice.options if o.precision == advice.recommended)
        why = "to keep extraction GPU-bound on this disk" if pick.gpu_bound else "to wait least for this disk"
        lines.append(f"set extract.store_precision={advice.recommended} {why}")
    return {**advice.to_dict(), "write_test": test.__dict__, "workers": workers}, lines


def check_room(est: StoreEstimate, cfg: RunConfig) -> None:
    """Raise StoreError when the store cannot fit (unless plan.disk_check is off)."""
    if est.fits or not cfg.plan.disk_check:
        return
    gib = 2**30
    raise StoreError(
        f"the store needs about {est.needed_bytes / gib:,.3f} GiB ({est.tokens:,} tokens x "
        f"{est.bytes_per_token:,.0f} bytes, precision {est.precision}, compression {est.compression}) but "
        f"{cfg.store} has {est.free_bytes / gib:,.3f} GiB ({est.free_source}). Free space, choose another "
        "store_path, set extract.store_precision=fp8 (about half of bf16) or int4 (about a quarter), or start "
        "anyway with plan.disk_check=false (the extraction then stops with an error when the disk is full, and "
        "resumes once there is room)"
    )
