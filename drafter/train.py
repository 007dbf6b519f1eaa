"""Train a DFlash drafter from a hidden-state store (see batching.py for blocks and loss).

One process on CPU or one GPU; several GPUs through torch DDP: launch
`torchrun --nproc_per_node N -m drafter.train job.json` (job.json: {"train": {...TrainConfig},
"store": ..., "target": ..., "output_dir": ..., "version": null, "tokenizer": null}).
Data order comes from DistributedSampler (seed + epoch) and anchors from a generator seeded by
(seed, micro-batch index, rank), so a resumed run replays exactly what an uninterrupted one would.
SIGTERM or Ctrl-C sets a flag; the run saves a checkpoint at the next step boundary and returns interrupted.
An exception that leaves the loop between steps (runtime.LastStepKept) saves the last finished step first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash_pipeline.drafter.batching import block_inputs, block_loss, sample_anchors, segment_bounds, states
from dflash_pipeline.drafter.checkpoint import (
    DATA_KEYS,
    finished_run,
    latest_checkpoint,
    load_checkpoint,
    recorded_data,
    save_checkpoint,
    supersede,
    write_report,
)
from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.drafter.export import export_drafter
from dflash_pipeline.drafter.levers import build_optimizer, lr_schedule
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.precision import ComputeCopy, autocast, compute_dtype
from dflash_pipeline.drafter.precision import resolve as resolve_precision
from dflash_pipeline.drafter.runtime import (
    LastStepKept,
    StopAtStepBoundary,
    lr_lambda,
    micro_batches,
    setup,
    total_steps,
)
from dflash_pipeline.drafter.target_head import draft_spec, load_target_head, mask_token_id, spec_json
from dflash_pipeline.errors import ConfigError
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.handoff import Handoff
from dflash_pipeline.storage import discard

log = logging.getLogger(__name__)
Progress = Callable[[int, int, float, float], None]  # (step, total_steps, loss, tokens_per_s)


@dataclass
class TrainResult:
    output_dir: str
    export_dir: str | None
    start_step: int
    steps: int
    total_steps: int
    interrupted: bool
    first_loss: float | None
    final_loss: float | None
    tokens_per_s: float
    data_wait_fraction: float
    elapsed_s: float
    world_size: int
    device: str
    history: list[dict] = field(default_factory=list)
    metrics_path: str = ""
    plot_path: str = ""
    reused: bool = False  # the run had already finished and exported: nothing trained or exported (finished_run)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Job:
    """What one training process holds: data, frozen target head, drafter (+ DDP wrapper), devices."""

    cfg: TrainConfig
    ds: object
    spec: object
    head: torch.nn.Module
    model: DFlashDrafter  # the float32 masters: optimizer, checkpoints, export
    work: ComputeCopy  # what forward and backward run on (train.precision)
    ddp: torch.nn.Module  # work.module, wrapped in DDP with several processes
    dev: torch.device
    precision: str
    flex: bool

    @property
    def compute(self) -> torch.dtype:
        return compute_dtype(self.precision)


def _build(
    cfg: TrainConfig,
    store_root,
    report: ProbeReport,
    version,
    dev: torch.device,
    store_options: dict | None = None,
) -> _Job:
    from dflash_pipeline.extraction.modelfiles import read_model_config
    from dflash_pipeline.storage.reader import HiddenStateDataset

    # A compact store's rows go to the device as stored (half the bytes) and are dequantized there (_micro_step).
    # retired="index": units that retention.mode=consumed deleted stay in the index (same order on resume).
    ds = HiddenStateDataset(store_root, version, store_options, dequantize=False, retired="index")
    if len(ds) == 0:
        raise ConfigError(f"the store {store_root} (version {ds.version}) holds no committed samples to train on")
    if cfg.distill and not ds.attrs.get("capture_last"):
        raise ConfigError(
            "train.distill=true needs the target's last hidden state in the store: re-extract with "
            "layers.capture_last=true, or set train.distill=false"
        )
    target_path = report.model_path
    tok = None
    if isinstance(cfg.mask_token, str):
        from dflash_pipeline.extraction.tokenizer import load_tokenizer

        tok = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
    mc = read_model_config(target_path)
    vocab = int((mc.get("text_config") or mc)["vocab_size"])
    spec = draft_spec(target_path, ds.layer_ids, cfg, mask_token_id(tok, cfg.mask_token, vocab))
    if int(ds.attrs["hidden_size"]) != spec.hidden_size:
        raise ConfigError(
            f"the store's hidden_size {ds.attrs['hidden_size']} differs from the target's "
            f"{spec.hidden_size} ({target_path}): the store was extracted from another model"
        )
    from dflash_pipeline.drafter import flex

    use_flex = cfg.attention == "flex" or (cfg.attention == "auto" and dev.type == "cuda" and flex.available())
    if use_flex and dev.type != "cuda":
        raise ConfigError("train.attention='flex' needs a CUDA device; use 'sdpa' or 'auto' on CPU")
    if cfg.pack and cfg.batch_size > 1 and not use_flex:
        log.warning(
            "train.pack=true with train.attention=sdpa: the dense mask spans the whole packed row, so attention grows "
            "with the square of batch_size (slower than padding); packing pays with flex attention (CUDA)"
        )
    if cfg.attention_groups > 1 and not use_flex:
        log.warning(
            "train.attention_groups=%d applies to flex attention only (CUDA): sdpa ignores it", cfg.attention_groups
        )
    precision = resolve_precision(cfg.precision, dev)
    head = load_target_head(report, dev, compute_dtype(precision), need_norm=cfg.distill)
    model = DFlashDrafter(spec).to(dev)
    work = ComputeCopy(model, precision)
    if cfg.compile == "pointwise" or (cfg.compile == "auto" and dev.type == "cuda"):
        from dflash_pipeline.drafter.model import compile_pointwise

        compile_pointwise()
    return _Job(cfg, ds, spec, head, model, work, work.module, dev, precision, use_flex)


def _micro_step(job: _Job, batch: dict, seed: int, sync: bool, scale: float) -> tuple[torch.Tensor, dict]:
    """Forward + backward of one micro-batch; returns (loss, {'tokens', 'correct'}) as device tensors (no host
    synchronisation: the step reads them once, at its end), and the host-side counts 'queries', 'attn_pairs'."""
    cfg, dev = job.cfg, job.dev
    starts = batch.get("starts")  # a packed micro-batch (train.pack): one row, its samples one after another
    gen = torch.Generator().manual_seed(seed)
    anchors, keep = sample_anchors(batch["loss_mask"], cfg.anchors_per_sample, gen, starts)
    bs, (rows, t) = job.spec.block_size, batch["input_ids"].shape
    first, end = segment_bounds(anchors, starts, t)
    # The work of this micro-batch, counted on the host (no sync): draft queries, and query-key pairs the
    # attention must compute (a block's bs queries see its sample's context before its anchor and the block itself).
    n = rows * anchors.shape[1] * bs
    work = (n, bs * int(((anchors - first) * keep).sum()) + n * bs)
    b = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
    anchors, keep, first, end = (x.to(dev) for x in (anchors, keep, first, end))
    blk = block_inputs(
        b["input_ids"], b["loss_mask"], anchors, keep, bs, job.spec.mask_token_id, cfg.gamma, (first, end)
    )
    ctx_pos = b["positions"] if starts is not None else torch.arange(t, device=dev).expand(rows, t)
    with contextlib.nullcontext() if sync else job.ddp.no_sync():  # forward and backward inside
        with autocast(job.precision, dev):
            out = job.ddp(
                states(b, "hidden", job.ds.precision, job.ds.logical_torch, job.compute),
                job.head.embed(blk["block_ids"]),
                ctx_pos,
                blk["block_pos"],
                job.model.block_masks(
                    anchors, keep, t, job.flex, first if starts is not None else None, cfg.attention_groups
                ),
            )
            last = (
                states(b, "last_hidden", job.ds.precision, job.ds.logical_torch, job.compute) if cfg.distill else None
            )
            dpace = cfg.dpace_alpha if cfg.position_weight == "dpace" else None
            loss, stats = block_loss(out, job.head, blk, last, dpace)
        (loss * scale).backward()
    return loss.detach(), {**stats, "queries": work[0], "attn_pairs": work[1]}


# The settings that shape a training's course (its learning-rate schedule, what each step samples, the loss):
# a checkpoint made under others is another training. Resuming it would splice two schedules (train.epochs raised
# after a finished run: the rate had decayed to its floor, then climbed again) into a drafter no fresh run with these
# settings makes. The rest (device, workers, checkpoint cadence, attention kernel, compile) can change on a resume.
SCHEDULE_KEYS = (
    "lr", "weight_decay", "warmup_ratio", "min_lr_ratio", "max_grad_norm", "epochs", "max_steps", "batch_size",
    "grad_accum", "pack", "anchors_per_sample", "gamma", "distill", "seed", "position_weight", "dpace_alpha",
    "optimizer", "muon_lr", "muon_weight_decay",
)  # fmt: skip


def _checkpoint_to_resume(out: Path, data: dict, d) -> Path | None:
    """The directory's latest checkpoint, if its training read `data` (store, version, target) under the same
    `data["schedule"]` (SCHEDULE_KEYS; checkpoints from before it was recorded are resumed on data alone). Another
    training's (another store version after a nightly run, another store or target, changed settings) is never
    resumed into this one: rank 0 moves it aside whole (checkpoint.supersede) and this one starts at step 0."""
    ck = latest_checkpoint(out)
    old = recorded_data(out, ck) if ck is not None else None
    if d.world > 1:
        torch.distributed.barrier()  # every rank has read the records before rank 0 moves anything
    if old is None:
        return ck
    # (repairs: only more of them; a repair record deleted since is no repair, and moves no training aside)
    other_data = any(old.get(k) != data[k] for k in DATA_KEYS if k != "repairs") or data["repairs"] > (
        old.get("repairs") or 0
    )
    recorded = old.get("schedule") or {}
    if recorded:  # a setting added since that checkpoint was made: it trained with the setting's default
        recorded = {k: TrainConfig.model_fields[k].default for k in data["schedule"]} | recorded
    changed = {
        k: (was, data["schedule"][k])
        for k, was in recorded.items()
        if k in data["schedule"] and was != data["schedule"][k]
    }
    if not other_data and not changed:
        return ck
    if d.rank == 0:
        moved = supersede(out, old)
        if other_data and all(old.get(k) == data[k] for k in DATA_KEYS if k != "repairs"):
            log.warning(
                "%s held a training on %s version %s from before units of it were discarded as damaged and rebuilt "
                "(the version's repairs.json counts %s repairs now, %s when that training ran): it may have read the "
                "damaged data, so it was moved to %s and training starts at step 0",
                out, data["store"], data["store_version"], data["repairs"], old.get("repairs"), moved,
            )  # fmt: skip
        elif other_data:
            log.warning(
                "%s held a training on %s version %s (target %s); this run trains on %s version %s: moved it to %s "
                "and training starts at step 0",
                out, old.get("store"), old.get("store_version"), old.get("target"), data["store"],
                data["store_version"], moved,
            )  # fmt: skip
        else:
            log.warning(
                "%s held a training with other settings (%s): resuming it would splice two trainings into a drafter no "
                "run with these settings makes, so it was moved to %s and training starts at step 0",
                out, ", ".join(f"train.{k} {a} -> {b}" for k, (a, b) in changed.items()), moved,
            )  # fmt: skip
    if d.world > 1:
        torch.distributed.barrier()
    return None


def train(
    cfg: TrainConfig,
    store_root: str | Path,
    report: ProbeReport,
    output_dir: str | Path | None = None,
    *,
    version: str | None = None,
    progress: Progress | None = None,
    store_options: dict | None = None,
) -> TrainResult:
    """Train (or resume from the latest checkpoint in output_dir) and export to <output_dir>/export.
    `store_root`: a local path or s3://bucket/prefix (with its non-secret `store_options`); `report`: the
    target (its embedding and lm_head, tokenizer, trust_remote_code) as the probe described it."""
    if not (output_dir or cfg.output_dir):
        raise ConfigError("train.output_dir is not set and no output_dir was given")
    out = Path(output_dir or cfg.output_dir)
    d = setup(cfg)
    torch.manual_seed(cfg.seed)
    job = _build(cfg, store_root, report, version, d.device, store_options)
    model = job.model
    opt = build_optimizer(model, cfg, fused=d.device.type == "cuda")
    total = total_steps(len(job.ds), d.world, cfg)
    sched = lr_schedule(opt, lr_lambda(total, cfg.warmup_ratio, cfg.min_lr_ratio))
    sj = spec_json(job.spec)
    repairs = len(discard.repairs(job.ds.store, job.ds.version))
    data = {"store": str(store_root), "store_version": job.ds.version, "target": report.model_path, "repairs": repairs}
    schedule = {k: getattr(cfg, k) for k in SCHEDULE_KEYS}
    start, history = 0, []
    ck = _checkpoint_to_resume(out, {**data, "schedule": schedule}, d)
    if ck is not None:
        state = load_checkpoint(ck, model, opt, sched, sj)
        start, history = int(state["step"]), list(state.get("history", []))
        log.info("resuming from %s (step %d of %d)", ck, start, total)
    job.work.refresh()
    provenance = {"train_config": cfg.model_dump(mode="json"), **data}
    if start >= total and (done := finished_run(out, start, provenance)) is not None:
        log.info("training had finished (step %d of %d, %s): reused, nothing trained", start, total, out / "export")
        if d.owns_group:
            torch.distributed.destroy_process_group()
        names = TrainResult.__dataclass_fields__
        return TrainResult(**{**{k: v for k, v in done.items() if k in names}, "start_step": start, "reused": True})
    if d.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        job.ddp = DistributedDataParallel(
            job.work.module, device_ids=[d.device.index] if d.device.type == "cuda" else None
        )
    batches = micro_batches(job.ds, cfg, d, start * cfg.grad_accum, total * cfg.grad_accum, d.device)

    def save(step: int) -> None:
        if d.rank == 0:
            save_checkpoint(
                out,
                step,
                model,
                opt,
                sched,
                {"spec": sj, "total_steps": total, "history": history, "data": {**data, "schedule": schedule}},
                cfg.keep_checkpoints,
            )
        if d.world > 1:
            torch.distributed.barrier()

    tokens = wait = 0.0
    work = {"supervised": 0.0, "queries": 0, "attn_pairs": 0}  # cumulative, this process (benchmarks' FLOP count)
    t0 = time.perf_counter()
    step, interrupted = start, False
    model.train()
    job.work.module.train()
    with StopAtStepBoundary() as stop, LastStepKept(save, start, stop, alone=d.world == 1) as kept:
        while step < total and not interrupted:
            sums = torch.zeros(5, dtype=torch.float64, device=d.device)  # loss, tokens, supervised, correct, stop
            for micro in range(cfg.grad_accum):
                tw = time.perf_counter()
                try:
                    batch = next(batches)
                    wait += time.perf_counter() - tw
                    seed = (cfg.seed * 1_000_003 + step * cfg.grad_accum + micro) * 1009 + d.rank
                    loss, st = _micro_step(
                        job, batch, seed, d.world == 1 or micro == cfg.grad_accum - 1, 1 / cfg.grad_accum
                    )
                except RuntimeError as e:
                    if not (stop.flag and d.world == 1 and "DataLoader worker" in str(e)):
                        raise
                    # A worker forked in the instant the stop signal reached the process group (before it left the
                    # group: _leave_stopping_to_the_trainer) died of it, and torch's SIGCHLD handler raised that
                    # wherever the main thread was: in next() or in the step's forward. That is the stop, not a
                    # failure: save the last finished step, as at any step boundary (its partial gradients dropped).
                    log.warning("a DataLoader worker died of the stop signal: stopping at step %d", step)
                    interrupted = True
                    break
                sums[0] += loss / cfg.grad_accum
                sums[1] += float(batch["lengths"].sum())
                sums[2] += st["tokens"]
                sums[3] += st["correct"]
                work["queries"] += st["queries"]
                work["attn_pairs"] += st["attn_pairs"]
            if interrupted:
                kept.save(step)
                break
            job.work.fold_grads()
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            kept.updating = True  # until step + 1 is complete, the weights are of no step
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            job.work.refresh()
            step += 1
            kept.finished(step)
            sums[4] = float(stop.flag)
            if d.world > 1:  # one all-reduce: losses, counts and the stop flag agree on every rank
                torch.distributed.all_reduce(sums)
                sums[0] /= d.world
            sums = sums.cpu()  # the step's one host synchronisation
            tokens += float(sums[1])
            work["supervised"] += float(sums[2]) / d.world
            now = time.perf_counter() - t0
            tps = tokens / max(now, 1e-9)
            if step % cfg.log_every == 0 or step == total:
                history.append(
                    {
                        "step": step,
                        "loss": float(sums[0]),
                        "acc": float(sums[3] / max(sums[2], 1)),
                        "lr": sched.get_last_lr()[0],
                        "tokens_per_s": tps,
                        # cumulative since this process started: all ranks' context tokens; this rank's time
                        # waiting for data and its draft work (see bench/train_bench.py for the FLOP count)
                        "tokens": tokens,
                        "elapsed_s": round(now, 4),
                        "data_wait_s": round(wait, 4),
                        **work,
                    }
                )
                if progress and d.rank == 0:
                    progress(step, total, float(sums[0]), tps)
            interrupted = bool(sums[4] > 0)
            if interrupted or step % cfg.checkpoint_every == 0 or step == total:
                kept.save(step)
    elapsed = time.perf_counter() - t0
    last = history[-10:]
    result = TrainResult(
        output_dir=str(out),
        export_dir=None,
        start_step=start,
        steps=step,
        total_steps=total,
        interrupted=interrupted,
        first_loss=history[0]["loss"] if history else None,
        final_loss=sum(h["loss"] for h in last) / len(last) if last else None,
        tokens_per_s=tokens / max(elapsed, 1e-9),
        data_wait_fraction=wait / max(elapsed, 1e-9),
        elapsed_s=elapsed,
        world_size=d.world,
        device=str(d.device),
        history=history,
    )
    if d.rank == 0:
        if not interrupted:
            result.export_dir = str(
                export_drafter(
                    model,
                    out / "export",
                    {**provenance, "steps": step, "final_loss": result.final_loss},
                )
            )
        paths = write_report(out, history, {k: v for k, v in result.to_dict().items() if k != "history"})
        result.metrics_path, result.plot_path = paths["metrics"], paths["plot"]
    if d.owns_group:
        torch.distributed.destroy_process_group()
    return result


@dataclass(frozen=True, kw_only=True)
class TrainJob(Handoff):
    """What `python -m dflash_pipeline.drafter.train JOB.json` trains (torchrun runs one per GPU)."""

    KIND = "train-job"
    VERSION = 1

    train: TrainConfig
    store: str
    store_options: dict | None = None
    report: ProbeReport
    output_dir: str
    version: str | None = None


def main(argv: list[str] | None = None) -> int:
    """torchrun / subprocess entry: `python -m drafter.train job.json`. Exit 143 when stopped by SIGTERM, 130 by
    Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m drafter.train JOB.json", file=sys.stderr)
        return 2
    job = TrainJob.from_json(Path(args[0]).read_text(), where=args[0])
    try:
        res = train(
            job.train, job.store, job.report, job.output_dir, version=job.version, store_options=job.store_options
        )
    except KeyboardInterrupt:  # Ctrl-C: the checkpoint of the step boundary is saved (a second one: not)
        print("stopped (Ctrl-C); run again to resume from the last checkpoint", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        Path(res.output_dir, "result.json").write_text(json.dumps(res.to_dict(), indent=2))
    return 143 if res.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
