"""Extraction throughput on one GPU: forward-only ceiling (a), the pipeline's own extraction (b), and the
seed-style naive loop (c), on random-weight models of real shapes. See bench/RESULTS.md.

    python bench/extract_bench.py --out $OUT                 # Qwen3-8B and Qwen3.6-27B shapes on cuda:0
    python bench/extract_bench.py --shapes tiny-dense,tiny-hybrid --device cpu --tokens 4000   # smoke test

Per shape:
- the model is built from its config directly on the device in the compute dtype (random weights). The 8B
  shape is saved as a HF checkpoint on local disk and every stage loads it through target/loader.py. The 27B
  shape (54 GB) is not saved: the GPU host's 64 GiB disk cannot hold it next to the store. Its directory
  holds config.json and a sparse safetensors file (real header, unwritten data), so probe(), provenance
  and fingerprints run unchanged, and run_worker's load_planned is replaced by the model already on the GPU.
  Loading is outside every measured window, so this changes no figure.
- synthetic prepared samples: random token ids, lengths log-normal (median 900) clipped to [200, 4096].
- (a) _Runner.run (hooks, early stop after the highest needed layer, packing on the device) over exactly the
  batches (b) runs, outputs dropped, warmed by one untimed pass, with the extract.compile mode (b) resolves
  to (and any other modes named by --a-compile); (b) Store.plan_units + run_worker into a Zarr store on
  local disk (default config: zstd, 128 MiB shards, token_budget auto, compile auto, writer processes);
  (c) batch 1, output_hidden_states=True, .cpu(), torch.save per sample, eager, on a prefix of the same
  samples (--naive-tokens).
- MFU counts the matmuls actually run (every nn.Linear of the decoder layers up to the last captured one,
  plus QK^T and PV of softmax attention, causal) against a bf16 GEMM measured in the same run. Gated
  DeltaNet's recurrence is not counted, so hybrid MFU is a slight underestimate.
- GPU busy: GPU time inside forwards (CUDA events) / wall time; also NVML utilization sampled every 100 ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import (
    SHAPES,
    bench_probe,
    build_model,
    dir_bytes,
    log,
    plan_store,
    profile_table,
    synthetic_samples,
    worker_spec,
    write_manifest_checkpoint,
)
from instruments import Sampler, flops, linear_flops_per_token, matmul_peak, pss_bytes, rss_bytes, sync

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

    ds = HiddenStateDataset(store.url, version)
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


def check_first_batch(store, version, unit, first: torch.Tensor, dtype_name: str) -> dict:
    """The first batch of (b), read back from the store, against (a)'s: same batch, same kernels."""
    from dflash_pipeline.storage.layout import from_storage

    g = store.open_unit(version, unit)
    got = from_storage(g["hidden"][: first.shape[0]], dtype_name)
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
    from dflash_pipeline.config import ExtractConfig
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
        plan = store.plan_units(
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


# ---- driver ------------------------------------------------------------------------------------------


def run_shape(shape: str, args, peak_tflops: float, sampler: Sampler) -> dict:
    from dflash_pipeline.config import load_config
    from dflash_pipeline.extraction import loader as loader_mod
    from dflash_pipeline.extraction.kernels import use_conv_kernel, use_gdn_forward
    from dflash_pipeline.extraction.loader import compile_modules, load_planned, resolve_compile

    device = args.device
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    dtype_name = "bfloat16" if cuda else "float32"
    work = Path(args.work) / shape
    shutil.rmtree(work, ignore_errors=True)
    ckpt = work / "model"
    res: dict = {"shape": shape}
    n_tokens = (args.tokens_27b if shape == "27b" else 0) or args.tokens or (600_000 if shape == "8b" else 200_000)
    save = (shape == "8b" or small_scale(shape)) and not args.no_save

    t = time.monotonic()
    model = build_model(shape, device, dtype)
    log(
        f"{shape}: built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params on {device} "
        f"in {time.monotonic() - t:.1f} s"
    )
    if save:
        t = time.monotonic()
        model.save_pretrained(ckpt)
        res["save_s"] = time.monotonic() - t
        log(f"{shape}: saved checkpoint ({dir_bytes(ckpt) / 1e9:.1f} GB) in {res['save_s']:.1f} s")
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    else:
        write_manifest_checkpoint(model, ckpt)
    base = {
        "output_dir": str(work),
        "target.model_path": str(ckpt),
        "target.dtype": dtype_name,
        "extract.devices": device,
        "extract.conv_kernel": args.conv_kernel,
        "extract.gdn_forward": args.gdn_forward,
        **({"extract.unit_tokens": args.unit_tokens} if args.unit_tokens else {}),
    }
    cfg = load_config(None, base)
    report = bench_probe(cfg)
    use_conv_kernel(report.conv_kernel)  # (a) and (b) alike; load_planned does this, but the bench may replace it
    res["conv_kernel"] = report.conv_kernel
    res["layer_ids"], res["kernels"], res["token_budget"] = report.layer_ids, report.kernels, report.token_budget
    log(f"{shape}: probe: layers {report.layer_ids}, kernels {report.kernels}, dtype kwarg {report.dtype_kwarg}")

    # The store must fit on the local disk beside the checkpoint (bf16 compresses ~1.4x); shrink if not.
    row_bytes = len(report.layer_ids) * report.hidden_size * 2
    room = shutil.disk_usage(work).free - 4 * GIB
    if n_tokens * row_bytes / 1.3 > room:
        n_tokens = max(10_000, int(room * 1.3 / row_bytes))
        log(f"{shape}: only {room / GIB:.0f} GiB of disk left: {n_tokens} tokens")
    naive_tokens = args.naive_tokens // (3 if shape == "27b" else 1)
    sample_ids, lengths, ids = synthetic_samples(n_tokens, SHAPES[shape]["vocab_size"])
    res["data"] = {
        "samples": len(lengths),
        "tokens": sum(lengths),
        "mean_len": float(np.mean(lengths)),
        "p50": int(np.median(lengths)),
        "p90": int(np.percentile(lengths, 90)),
        "max": max(lengths),
    }
    store, version, units = plan_store(work / "store", report, cfg, sample_ids, lengths, ids, dtype_name)
    batches = unit_batches(store, version, units, report.token_budget)
    log(f"{shape}: {res['data']}, {len(units)} unit(s), {len(batches)} batches")

    if save:
        t = time.monotonic()
        model = load_planned(report, device)
        res["load_s"] = time.monotonic() - t
        log(f"{shape}: loaded through target.loader in {res['load_s']:.1f} s")
    lin, attn = linear_flops_per_token(
        model, max(report.layer_ids + ([report.num_layers - 1] if report.capture_last else []))
    )
    total_flops = flops([len(s) for b in batches for s in b], lin, attn)

    # (a), with the forward (b) will run (extract.compile and extract.gdn_forward as the pipeline resolves them),
    # then other compile modes and other (gdn_forward, compile) pairs
    b_mode = resolve_compile(cfg.extract.compile, cuda, report.layer_types)
    b_gdn = report.gdn_forward
    res["gdn_forward"] = b_gdn
    variants = [(b_gdn, b_mode)] + [(b_gdn, m) for m in args.a_compile.split(",") if m and m != b_mode]
    for v in filter(None, args.a_variants.split(";")):
        kv = dict(item.split("=", 1) for item in v.split(","))
        if (kv.get("gdn", b_gdn), kv.get("compile", b_mode)) not in variants:
            variants.append((kv.get("gdn", b_gdn), kv.get("compile", b_mode)))
    res["a_by_compile"] = {}
    for gdn, mode in variants:
        key = mode if gdn == b_gdn else f"gdn={gdn},compile={mode}"
        t = time.monotonic()
        try:
            fused_layers = use_gdn_forward(model, gdn)
            n = compile_modules(model, mode)
            am = measure_forward(model, report, batches, device, dtype)
        except Exception as e:  # one broken variant must not cost the others' figures
            if (gdn, mode) == (b_gdn, b_mode):
                raise
            res["a_by_compile"][key] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{shape}: (a) gdn_forward={gdn} compile={mode} failed: {type(e).__name__}: {e}")
            continue
        am.update(
            compile=mode,
            gdn_forward=gdn,
            fused_gdn_layers=fused_layers,
            compiled_modules=n,
            warm_and_measure_s=time.monotonic() - t,
            mfu=total_flops / am["seconds"] / 1e12 / peak_tflops,
        )
        if (gdn, mode) == (b_gdn, b_mode):
            first = am.pop("first_batch")
            a = res["a"] = am
        else:
            am.pop("first_batch")
        res["a_by_compile"][key] = am
        log(
            f"{shape}: (a) gdn_forward={gdn} ({fused_layers} fused) compile={mode} ({n} modules): "
            f"{am['tokens_per_s']:.0f} tok/s, MFU {am['mfu']:.3f}, GPU busy {am['gpu_busy']}"
        )
    use_gdn_forward(model, b_gdn)  # what (b)'s worker gets when the model is handed over in memory
    if args.profile_a:
        compile_modules(model, b_mode)
        res["profile_file"] = profile_forward(model, report, batches[: args.profile_a], device, dtype, shape, args.out)
    compile_modules(model, "off")

    # (c) on a prefix of the samples (original, unsorted order: the length mix)
    naive, acc = [], 0
    for s in ids if not args.skip_naive else []:
        if acc >= naive_tokens:
            break
        naive.append(s)
        acc += len(s)
    if naive:
        c = measure_naive(model, report, naive, device, work / "naive")
        shutil.rmtree(work / "naive")
    else:
        c = {"tokens": 0, "seconds": 0, "tokens_per_s": float("nan"), "bytes_per_token": float("nan")}
    res["c"] = c
    log(f"{shape}: (c) {c['tokens_per_s']:.0f} tok/s on {c['tokens']} tokens, {c['bytes_per_token']:.0f} B/token")

    # (b)
    if save:
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    else:
        loader_mod.load_planned = lambda *a_, **k_: model  # the model already on the GPU (see the docstring)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    b = measure_pipeline(store, version, units, report, cfg, device, dtype_name, sampler)
    b["mfu"] = total_flops / b["seconds"] / 1e12 / peak_tflops
    b["check_first_batch"] = check_first_batch(store, version, units[0], first, dtype_name)
    if args.read_tokens:
        b["read"] = measure_read(store, version, args.read_tokens)
    res["b"] = b
    log(f"{shape}: (b) {b['tokens_per_s']:.0f} tok/s, MFU {b['mfu']:.3f}, {json.dumps(b)}")

    # (b) variants: other writer settings; the model is loaded once for all of them (load is excluded anyway)
    variants = [v for v in args.b_variants.split(";") if v] if shape in args.variant_shapes.split(",") else []
    if variants and save:
        model = load_planned(report, device)
        loader_mod.load_planned = lambda *a_, **k_: model
    for spec in variants:
        opts = dict(kv.split("=") for kv in spec.split(","))
        vcfg = load_config(
            None, {**base, **{f"extract.{k}": v for k, v in opts.items() if k not in ("threads", "switch")}}
        )
        shutil.rmtree(work / "store", ignore_errors=True)
        vstore, vversion, vunits = plan_store(work / "store", report, vcfg, sample_ids, lengths, ids, dtype_name)
        vreport = dataclasses.replace(report, token_budget=int(opts.get("token_budget", report.token_budget)))
        # switch=S: the interpreter's GIL switch interval (default 5 ms) during this run: does the thread
        # launching the forward wait for the GIL behind the writer threads?
        old_switch = sys.getswitchinterval()
        sys.setswitchinterval(float(opts.get("switch", old_switch)))
        try:
            vb = measure_pipeline(
                vstore,
                vversion,
                vunits,
                vreport,
                vcfg,
                device,
                dtype_name,
                sampler,
                threads=int(opts["threads"]) if "threads" in opts else None,
            )
        finally:
            sys.setswitchinterval(old_switch)
        vb["variant"] = spec
        if args.read_tokens:
            vb["read"] = measure_read(vstore, vversion, args.read_tokens)
        res.setdefault("b_variants", []).append(vb)
        log(
            f"{shape}: (b) variant {spec}: {vb['tokens_per_s']:.0f} tok/s, {vb['bytes_per_token']:.0f} B/token, "
            f"writer wait {vb['writer_wait_s']:.2f} s, drain {vb['drain_s']:.2f} s, GPU busy {vb['gpu_busy']}"
        )

    loader_mod.load_planned = load_planned
    res["b_over_a"] = b["tokens_per_s"] / a["tokens_per_s"]
    res["b_over_c"] = b["tokens_per_s"] / c["tokens_per_s"]
    model = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8b,27b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", type=int, default=0, help="tokens per measurement (a, b); 0: 600k for 8b, 200k for 27b")
    p.add_argument("--tokens-27b", type=int, default=0, help="overrides --tokens for 27b")
    p.add_argument(
        "--unit-tokens",
        type=int,
        default=0,
        help="extract.unit_tokens (0: the default, 1M); smaller values measure the hand-over between units",
    )
    p.add_argument("--naive-tokens", type=int, default=60_000, help="tokens for (c) (a third for 27b)")
    p.add_argument("--writer-gib", type=float, default=2.5, help="raw GiB per writer-only configuration; 0 skips")
    p.add_argument("--writer-configs", default="zstd:1,zstd:2,zstd:4,zstd:8,lz4:4,none:4")
    p.add_argument("--b-variants", default="", help="';'-separated extra (b) runs, e.g. 'threads=1;compression=lz4'")
    p.add_argument("--variant-shapes", default="8b,tiny-dense")
    p.add_argument(
        "--a-compile",
        default="",
        help="also measure (a) with these extract.compile modes, e.g. 'off,layers' ((a) always runs the mode (b) uses)",
    )
    p.add_argument("--profile-a", type=int, default=0, help="torch.profiler over this many of (a)'s batches")
    p.add_argument(
        "--a-variants",
        default="",
        help="';'-separated extra (a) runs, each 'gdn=fused|transformers,compile=MODE' (hybrid targets)",
    )
    p.add_argument("--no-save", action="store_true", help="8b too: no checkpoint on disk, loader replaced (quick runs)")
    p.add_argument("--skip-naive", action="store_true", help="skip (c)")
    p.add_argument("--read-tokens", type=int, default=0, help="after each (b): reader tokens/s over this many tokens")
    p.add_argument("--conv-kernel", default="auto", help="extract.conv_kernel: auto, fla or transformers")
    p.add_argument("--gdn-forward", default="auto", help="extract.gdn_forward: auto, fused or transformers")
    p.add_argument("--work", default="/tmp/dflash-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()

    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
        "args": vars(args),
        "gpu": torch.cuda.get_device_name(args.device) if cuda else None,
    }
    try:
        import fla  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401

        info["fla"] = "ok"
    except Exception as e:  # noqa: BLE001
        info["fla"] = f"not importable: {type(e).__name__}: {e}"
    Path(args.work).mkdir(parents=True, exist_ok=True)
    du = shutil.disk_usage(args.work)
    info["disk_free_gib"] = du.free / GIB
    log("env", json.dumps(info))
    results = {"env": info}

    def dump():
        (out / "bench.json").write_text(json.dumps(results, indent=1, default=str))

    results["matmul_tflops"] = peak = matmul_peak(args.device)
    log(f"matmul peak: {peak:.0f} TFLOP/s")
    if args.writer_gib > 0:
        k, h = (5, 4096) if cuda else (5, 256)
        cfgs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.writer_configs.split(",")]
        results["writer"] = writer_bench(Path(args.work), k, h, args.writer_gib, cfgs)
        dump()
    sampler = Sampler(args.device)
    sampler.start()
    for shape in args.shapes.split(","):
        try:
            results[shape] = run_shape(shape, args, peak, sampler)
        except Exception as e:  # noqa: BLE001 - keep the other shape's figures
            import traceback

            traceback.print_exc()
            results[shape] = {"error": f"{type(e).__name__}: {e}"}
        dump()
    sampler.stop()
    summary(results)
    dump()


def summary(results):
    print("\n==== summary ====")
    print(
        f"matmul peak {results['matmul_tflops']:.0f} TFLOP/s; {results['env'].get('gpu')}; fla {results['env']['fla']}"
    )
    for w in results.get("writer", []):
        print(f"writer-only {w['codec']:>4} x{w['threads']}: {w['raw_GB_per_s']:.2f} GB/s raw, ratio {w['ratio']:.2f}")
    for shape, r in results.items():
        if not isinstance(r, dict) or "shape" not in r:
            if isinstance(r, dict) and "error" in r:
                print(shape, "ERROR", r["error"])
            continue
        a, b, c = r["a"], r["b"], r["c"]
        print(
            f"[{shape}] a {a['tokens_per_s']:.0f} tok/s (MFU {a['mfu']:.3f}, busy {a['gpu_busy']}) | "
            f"b {b['tokens_per_s']:.0f} tok/s (MFU {b['mfu']:.3f}, busy {b['gpu_busy']}, nvml {b['nvml_util']}) | "
            f"c {c['tokens_per_s']:.0f} tok/s | b/a {r['b_over_a']:.3f} b/c {r['b_over_c']:.2f}"
        )
        print(
            f"[{shape}] bytes/token b {b['bytes_per_token']:.0f} c {c['bytes_per_token']:.0f} | peak GPU "
            f"{b['peak_gpu_gib']:.1f} GiB | RSS before {b['rss_before_gib']:.2f} peak {b['rss_peak_gib']:.2f} GiB, "
            f"PSS growth with writer processes {b['pss_with_writers_delta_gib']:.2f} GiB "
            f"(bound {b['host_buffer_gib']:.2f}) | writer wait {b['writer_wait_s']:.2f} s, drain "
            f"{b['drain_s']:.2f} s, copy wait {b['copy_wait_s']:.2f} s | check {b['check_first_batch']}"
        )
        for v in r.get("b_variants", []):
            print(
                f"[{shape}] b[{v['variant']}] {v['tokens_per_s']:.0f} tok/s, {v['bytes_per_token']:.0f} B/token, "
                f"writer wait {v['writer_wait_s']:.2f} s, GPU busy {v['gpu_busy']}, copy wait {v['copy_wait_s']:.2f} s"
                + (f", read {v['read']['tokens_per_s']:.0f} tok/s" if "read" in v else "")
            )
        if "read" in b:
            print(f"[{shape}] b read {b['read']['tokens_per_s']:.0f} tok/s ({b['read']['dtype']})")


if __name__ == "__main__":
    main()
