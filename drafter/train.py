"""Train a DFlash drafter from a hidden-state store (see batching.py for blocks and loss).

One process on CPU or one GPU; several GPUs through torch DDP: launch
`torchrun --nproc_per_node N -m drafter.train job.json` (job.json: {"train": {...TrainConfig},
"store": ..., "target": ..., "output_dir": ..., "version": null, "tokenizer": null}).
Data order comes from DistributedSampler (seed + epoch) and anchors from a generator seeded by
(seed, micro-batch index, rank), so a resumed run replays exactly what an uninterrupted one would.
SIGTERM sets a flag; the run saves a checkpoint at the next step boundary and returns interrupted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from drafter.batching import block_inputs, block_loss, collate, sample_anchors
from drafter.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, write_report
from drafter.config import TrainConfig
from drafter.export import export_drafter
from drafter.model import DFlashDrafter
from drafter.target_head import draft_spec, load_target_head, mask_token_id, spec_json
from pipeline.errors import ConfigError

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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Dist:
    rank: int
    world: int
    device: torch.device
    owns_group: bool = False


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} asked for, but no GPU is visible; use 'cpu' or 'auto'")
    return torch.device(spec)


def _setup(cfg: TrainConfig) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return _Dist(0, 1, resolve_device(cfg.device))
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dev = torch.device(f"cuda:{local}")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return _Dist(dist.get_rank(), dist.get_world_size(), dev, owns)


class _StopOnSigterm:
    """SIGTERM -> flag (checked at step boundaries). Only the main thread may install handlers."""

    def __init__(self):
        self.flag, self._prev = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM: saving a checkpoint at the next step boundary")
        self.flag = True

    def __exit__(self, *exc):
        if self._prev is not None:
            signal.signal(signal.SIGTERM, self._prev)


def _micro_batches(ds, cfg: TrainConfig, d: _Dist, start: int, device: torch.device) -> Iterator[dict]:
    """Micro-batches from global micro index `start` on, epoch after epoch."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(ds, num_replicas=d.world, rank=d.rank, shuffle=True, seed=cfg.seed)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        idx = list(sampler)
        batches = [idx[i:i + cfg.batch_size] for i in range(0, len(idx), cfg.batch_size)]
        skip = min(max(start - epoch * len(batches), 0), len(batches))
        if skip < len(batches):
            yield from DataLoader(ds, batch_sampler=batches[skip:], collate_fn=collate, num_workers=cfg.num_workers,
                                  pin_memory=device.type == "cuda", prefetch_factor=4 if cfg.num_workers else None)
        epoch += 1


def micro_per_epoch(n: int, world: int, batch_size: int) -> int:
    return math.ceil(math.ceil(n / world) / batch_size)


def lr_lambda(total: int, warmup_ratio: float, floor: float) -> Callable[[int], float]:
    warm = math.ceil(warmup_ratio * total)

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, total - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def train(cfg: TrainConfig, store_root: str | Path, target_path: str, output_dir: str | Path | None = None, *,
          version: str | None = None, tokenizer_path: str | None = None, progress: Progress | None = None) -> TrainResult:
    """Train (or resume from the latest checkpoint in output_dir) and export to <output_dir>/export."""
    from storage.reader import HiddenStateDataset

    out = Path(output_dir or cfg.output_dir or "")
    if not str(output_dir or cfg.output_dir or ""):
        raise ConfigError("train.output_dir is not set and no output_dir was given")
    d = _setup(cfg)
    dev = d.device
    torch.manual_seed(cfg.seed)
    ds = HiddenStateDataset(store_root, version)
    if len(ds) == 0:
        raise ConfigError(f"the store {store_root} (version {ds.version}) holds no committed samples to train on")
    if cfg.distill and "last_hidden" not in ds[0]:
        raise ConfigError("train.distill=true needs the target's last hidden state in the store: re-extract with "
                          "layers.capture_last=true, or set train.distill=false")
    tok = None
    if isinstance(cfg.mask_token, str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path or target_path)
    from target.modelfiles import read_model_config

    mc = read_model_config(target_path)
    vocab = int((mc.get("text_config") or mc)["vocab_size"])
    spec = draft_spec(target_path, ds.layer_ids, cfg, mask_token_id(tok, cfg.mask_token, vocab))
    if int(ds.attrs["hidden_size"]) != spec.hidden_size:
        raise ConfigError(f"the store's hidden_size {ds.attrs['hidden_size']} differs from the target's "
                          f"{spec.hidden_size} ({target_path}): the store was extracted from another model")
    compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = load_target_head(target_path, dev, compute)
    model = DFlashDrafter(spec).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            fused=dev.type == "cuda")
    mpe = micro_per_epoch(len(ds), d.world, cfg.batch_size)
    total = math.ceil(math.ceil(cfg.epochs * mpe) / cfg.grad_accum)
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup_ratio, cfg.min_lr_ratio))
    sj = spec_json(spec)
    start, history = 0, []
    ck = latest_checkpoint(out)
    if ck is not None:
        state = load_checkpoint(ck, model, opt, sched, sj)
        start, history = int(state["step"]), list(state.get("history", []))
        log.info("resuming from %s (step %d of %d)", ck, start, total)
    ddp = model
    if d.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()

    batches = _micro_batches(ds, cfg, d, start * cfg.grad_accum, dev)
    meta = {"spec": sj, "total_steps": total}

    def save(step: int) -> None:
        if d.rank == 0:
            save_checkpoint(out, step, model, opt, sched, {**meta, "history": history}, cfg.keep_checkpoints)
        if d.world > 1:
            torch.distributed.barrier()

    tokens = wait = 0.0
    t0 = time.perf_counter()
    step, interrupted = start, False
    model.train()
    with _StopOnSigterm() as stop:
        while step < total:
            sums = torch.zeros(5, dtype=torch.float64)  # loss, tokens, supervised, correct, stop
            for micro in range(cfg.grad_accum):
                tw = time.perf_counter()
                batch = next(batches)
                wait += time.perf_counter() - tw
                gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + (step * cfg.grad_accum + micro)) * 1009 + d.rank)
                anchors, keep = sample_anchors(batch["loss_mask"], cfg.anchors_per_sample, gen)
                b = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
                anchors, keep = anchors.to(dev), keep.to(dev)
                blk = block_inputs(b["input_ids"], b["loss_mask"], anchors, keep, spec.block_size,
                                   spec.mask_token_id, cfg.gamma)
                t = b["input_ids"].shape[1]
                ctx_pos = torch.arange(t, device=dev).expand(len(anchors), t)
                sync = d.world == 1 or micro == cfg.grad_accum - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():  # forward and backward inside
                    with autocast():
                        o = ddp(b["hidden"].to(compute), head.embed(blk["block_ids"]), ctx_pos, blk["block_pos"],
                                model.block_masks(anchors, keep, t))
                        loss, st = block_loss(o, head, blk, b["last_hidden"].to(compute) if cfg.distill else None)
                    (loss / cfg.grad_accum).backward()
                sums += torch.tensor([loss.item() / cfg.grad_accum, float(batch["lengths"].sum()), st["tokens"],
                                      st["correct"], 0.0], dtype=torch.float64)
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            sums[4] = float(stop.flag)
            if d.world > 1:
                s = sums.to(dev)
                torch.distributed.all_reduce(s)
                sums = s.cpu()
                sums[0] /= d.world
            tokens += float(sums[1])
            tps = tokens / max(time.perf_counter() - t0, 1e-9)
            if step % cfg.log_every == 0 or step == total:
                history.append({"step": step, "loss": float(sums[0]), "acc": float(sums[3] / max(sums[2], 1)),
                                "lr": sched.get_last_lr()[0], "tokens_per_s": tps})
                if progress and d.rank == 0:
                    progress(step, total, float(sums[0]), tps)
            if sums[4] > 0:
                interrupted = True
                save(step)
                break
            if step % cfg.checkpoint_every == 0 or step == total:
                save(step)
    elapsed = time.perf_counter() - t0
    result = TrainResult(
        output_dir=str(out), export_dir=None, start_step=start, steps=step, total_steps=total, interrupted=interrupted,
        first_loss=history[0]["loss"] if history else None,
        final_loss=sum(h["loss"] for h in history[-10:]) / len(history[-10:]) if history else None,
        tokens_per_s=tokens / max(elapsed, 1e-9), data_wait_fraction=wait / max(elapsed, 1e-9), elapsed_s=elapsed,
        world_size=d.world, device=str(dev), history=history)
    if d.rank == 0:
        if not interrupted:
            result.export_dir = str(export_drafter(model, out / "export", {
                "train_config": cfg.model_dump(mode="json"), "store": str(store_root), "store_version": ds.version,
                "target": target_path, "steps": step, "final_loss": result.final_loss}))
        paths = write_report(out, history, {k: v for k, v in result.to_dict().items() if k != "history"})
        result.metrics_path, result.plot_path = paths["metrics"], paths["plot"]
    if d.owns_group:
        torch.distributed.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    """torchrun / subprocess entry: `python -m drafter.train job.json`. Exit 143 when stopped by SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m drafter.train JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(args[0]).read_text())
    res = train(TrainConfig.model_validate(job.get("train", {})), job["store"], job["target"], job.get("output_dir"),
                version=job.get("version"), tokenizer_path=job.get("tokenizer"))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(res.output_dir, "result.json").write_text(json.dumps(res.to_dict(), indent=2))
    return 143 if res.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
