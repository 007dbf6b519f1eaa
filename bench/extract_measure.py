"""The measurements of bench/extract_bench.py (its docstring says what each one is): the pipeline's batches,
(a) the forward alone, (b) the pipeline, (c) the naive loop, reads, and the shard writer alone."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch
from common import dir_bytes, log, profile_table, worker_spec
from instruments import pss_bytes, rss_bytes, sync

from dflash_pipeline.storage.layout import SHARDED_ARRAYS

GIB = 2**30


# ---- batches as the pipeline makes them ------------------------------------------------------------


def small_scale(shape: str) -> bool:
    return shape.startswith("tiny")


def unit_batches(store, version, units, budget):
    """(unit, [lengths of each batch's samples], token arrays) exactly as run_worker batches them."""

    from dflash_pipeline.extraction.batching import plan_batches

    out = []
    for u in units:
        samples = store.unit_attrs(version, u)["samples"]
        ids = store.open_unit(version, u)["input_ids"][:]
        lengths = [s[2] for s in samples]
        for a, b in plan_batches(lengths, budget):
            out.append([ids[samples[i][1] : samples[i][1] + samples[i][2]] for i in range(a, b)])
    return out


# ---- the three measurements --------------------------------------------------------------------------


def measure_forward(model, report, batches, device, dtype, warm: bool = True) -> dict:
    """(a): the pipeline's own forward (_Runner: pinned inputs, hooks, early stop, packing), outputs dropped."""
    from dflash_pipeline.extraction.capture import LayerCapture
    from dflash_pipeline.extraction.extract import _Runner

    capture = LayerCapture(model, report.layer_ids, report.capture_last)
    if warm:
        # One untimed pass over the same batches. Triton (flash-linear-attention, torch.compile) autotunes
        # and compiles per batch size and per sequence-length specialisation on first use, which took the
        # hybrid's (a) from ~9k to 4k tokens/s when only a few short batches warmed it up.
        warm_runner = _Runner(capture, device, 0, dtype)
        for b in batches:
            warm_runner.run(b)
        sync(device)
    runner = _Runner(capture, device, 0, dtype)
    first = None
    t0 = time.monotonic()
    for i, b in enumerate(batches):
        h = runner.run(b)["hidden"]
        if i == 0:
            first = h  # compared with what (b) stores; copied to the host after the timed loop
    sync(device)
    wall = time.monotonic() - t0
    first = first.to("cpu")
    toks = sum(len(s) for b in batches for s in b)
    gpu = runner.gpu_seconds()
    return {
        "tokens": toks,
        "seconds": wall,
        "tokens_per_s": toks / wall,
        "gpu_busy": gpu / wall if gpu else None,
        "first_batch": first,
    }


def profile_forward(model, report, batches, device, dtype, shape: str, out: str) -> str:
    """torch.profiler over (a)'s forward on `batches` (already warm): the kernel table, into OUT/profile_SHAPE.txt."""
    from dflash_pipeline.extraction.capture import LayerCapture
    from dflash_pipeline.extraction.extract import _Runner

    runner = _Runner(LayerCapture(model, report.layer_ids, report.capture_last), device, 0, dtype)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if "cuda" in device else [])
    with torch.profiler.profile(activities=acts) as prof:
        for b in batches:
            runner.run(b)
        sync(device)
    path = Path(out) / f"profile_{shape}.txt"
    path.write_text(profile_table(prof))
    return path.name


def measure_naive(model, report, samples, device, out_dir: Path) -> dict:
    """(c): seed-style: one sample at a time, output_hidden_states=True, .cpu(), torch.save per sample."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = False

    def one(i, ids):
        x = torch.from_numpy(ids.astype(np.int64))[None].to(device)
        with torch.inference_mode():
            out = model(input_ids=x, output_hidden_states=True, use_cache=False)
        hs = torch.stack([out.hidden_states[j + 1][0] for j in report.layer_ids], dim=1).cpu()
        torch.save({"input_ids": x[0].cpu(), "hidden_states": hs}, out_dir / f"hs_{i}.pt")

    one(-1, samples[0][:256])  # warm-up
    (out_dir / "hs_-1.pt").unlink()
    t0 = time.monotonic()
    for i, s in enumerate(samples):
        one(i, s)
    wall = time.monotonic() - t0
    toks = sum(len(s) for s in samples)
    return {"tokens": toks, "seconds": wall, "tokens_per_s": toks / wall, "bytes_per_token": dir_bytes(out_dir) / toks}


def measure_pipeline(store, version, units, report, cfg, device, dtype_name, sampler, threads=None) -> dict:
    """(b): run_worker into the store, end to end (model load excluded from tokens/s, as in WorkerResult)."""
    from dflash_pipeline.extraction.extract import default_store_writers, run_worker, uses_writer_processes

    procs = uses_writer_processes(cfg.extract.store_writers, device)
    rss0, pss0 = rss_bytes(), pss_bytes()
    t_call = time.monotonic()
    r = run_worker(worker_spec(store.url, version, units, report, cfg, dtype_name, device, writers=threads))
    t_end = time.monotonic()
    loop_wall = r.tokens / r.tokens_per_s
    rss_peak, pss_peak, util = sampler.window(t_end - loop_wall, t_end)
    vdir = Path(store.url) / version / "units"
    stored = sum(dir_bytes(p) for a in SHARDED_ARRAYS for p in vdir.rglob(a))  # data and, if compact, scales
    return {
        "tokens": r.tokens,
        "seconds": loop_wall,
        "tokens_per_s": r.tokens_per_s,
        "load_s": r.seconds - loop_wall,
        "call_s": t_end - t_call,
        "gpu_busy": r.gpu_busy_fraction or None,
        "nvml_util": util,
        "bytes_per_token": stored / r.tokens,
        "peak_gpu_gib": r.peak_gpu_gib,
        "rss_before_gib": rss0 / GIB,
        "rss_peak_gib": rss_peak / GIB,
        "rss_delta_gib": (rss_peak - rss0) / GIB,
        "pss_with_writers_delta_gib": (pss_peak - pss0) / GIB,
        "host_buffer_gib": r.host_buffer_gib,
        "writer_wait_s": r.writer_wait_s,
        "drain_s": r.drain_s,
        "copy_wait_s": r.copy_wait_s,
        "forward_passes": r.forward_passes,
        "oom_splits": r.oom_splits,
        "store_writers": f"{threads or default_store_writers(device, procs)} {cfg.extract.store_writers}",
    }


def measure_read(store, version: str, n_tokens: int, seed: int = 0) -> dict:
    """What training's data loader does per sample, in one process: HiddenStateDataset.__getitem__ (every
    committed file's size checked at first open, chunks decompressed, a compact store dequantized into the
    logical dtype) over samples in random order until n_tokens are read; the files were just written, so
    they come from the page cache (the same for every precision)."""
    import random

    from dflash_pipeline.storage.reader import HiddenStateDataset

    ds = HiddenStateDataset(store.url, version, unvalidated="warn")  # just extracted, not validated
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    toks, t0 = 0, time.monotonic()
    for i in order:
        item = ds[i]
        toks += item["hidden"].shape[0]
        if toks >= n_tokens:
            break
    wall = time.monotonic() - t0
    return {"tokens": toks, "seconds": wall, "tokens_per_s": toks / wall, "dtype": str(item["hidden"].dtype)}


def check_first_batch(store, version, unit, first: torch.Tensor, dtype_name: str, precision: str = "full") -> dict:
    """The first batch of (b), read back from the store, against (a)'s: same batch, same kernels (bit-equal for
    precision "full"; a compact precision's rel_err is its quantization error)."""
    from dflash_pipeline.storage.reader import read_rows

    g = store.open_unit(version, unit)
    got = read_rows(g, "hidden", slice(0, first.shape[0]), dtype_name, precision)
    ref = first.to(got.dtype)
    rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    return {
        "bit_equal": bool(torch.equal(got, ref)),
        "rel_err": rel,
        "finite": bool(torch.isfinite(got).all()),
        "zero_rows": int((got.float().abs().amax(dim=(1, 2)) == 0).sum()),
    }


# ---- writer alone ------------------------------------------------------------------------------------


def writer_bench(work: Path, k: int, h: int, total_gib: float, configs: list[tuple[str, int]]) -> list[dict]:
    """Store-writer throughput without a GPU: bf16 rows of random normal values (compress like hidden
    states: ratio ~1.45 with zstd), fed through UnitWriter.add in 16k-token batches."""
    from dflash_pipeline.extraction.config import ExtractConfig
    from dflash_pipeline.storage.planning import plan_units
    from dflash_pipeline.storage.store import Store
    from dflash_pipeline.storage.writer import UnitWriter

    batch = 16384 if total_gib >= 1 else 512
    src = torch.randn(batch, k, h).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    n_tokens = int(total_gib * GIB // (k * h * 2)) // batch * batch
    out = []
    for codec, threads in configs:
        root = work / f"writer_{codec}_{threads}"
        x = ExtractConfig(compression=codec)
        store = Store(root)
        v = store.resolve_version(
            {
                "format_version": 1,
                "layer_ids": list(range(k)),
                "hidden_size": h,
                "logical_dtype": "bfloat16",
                "capture_last": False,
            },
            "w",
            True,
            False,
        )
        ids = [np.zeros(n_tokens, np.int32)]
        plan = plan_units(
            store,
            v,
            ["x"],
            [n_tokens],
            lambda rows, ids=ids: (ids, [np.ones(n_tokens, np.uint8)]),
            n_tokens,
            x.chunk_mib,
            x.shard_mib,
            codec,
        )
        w = UnitWriter(store.unit_location(v, plan.new_units[0].name), threads=threads)
        t0 = time.monotonic()
        for s in range(0, n_tokens, batch):
            w.add(s, src)
        w.finish()
        w.close()
        dt = time.monotonic() - t0
        raw = n_tokens * k * h * 2
        disk = dir_bytes(Path(store.url) / v / "units" / plan.new_units[0].name / "hidden")
        row = {
            "codec": codec,
            "threads": threads,
            "raw_GB_per_s": raw / dt / 1e9,
            "ratio": raw / disk,
            "tokens_per_s_8b_rows": n_tokens / dt,
            "producer_blocked_s": w.blocked_s,
            "seconds": dt,
        }
        log("writer", row)
        out.append(row)
        shutil.rmtree(root)
    return out
