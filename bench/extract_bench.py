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
import rates  # bench/rates.py, beside this script
import torch
from common import (
    SHAPES,
    bench_probe,
    build_model,
    dir_bytes,
    log,
    plan_store,
    synthetic_samples,
    write_manifest_checkpoint,
)
from extract_measure import (
    GIB,
    check_first_batch,
    measure_forward,
    measure_naive,
    measure_pipeline,
    measure_read,
    profile_forward,
    small_scale,
    unit_batches,
    writer_bench,
)
from instruments import Sampler, flops, linear_flops_per_token, matmul_peak

from dflash_pipeline.storage import diskcheck, quant

# (b) variant keys the bench handles itself; any other key is an extract.* setting
BENCH_KEYS = ("threads", "switch", "codec_threads")


# ---- driver ------------------------------------------------------------------------------------------


def run_shape(shape: str, args, peak_tflops: float, sampler: Sampler) -> dict:
    from dflash_pipeline.config import load_config
    from dflash_pipeline.extraction import extract as extract_mod
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
    # The disk check first, while the disk is as the run found it (a fresh cloud disk writes its first blocks slowly)
    disk_test = None
    if args.disk_check_mib:
        work.mkdir(parents=True, exist_ok=True)
        disk_test = diskcheck.measure_write_bandwidth(work, args.disk_check_mib)
        res["disk_test"] = dataclasses.asdict(disk_test)
        log(f"{shape}: {disk_test.line()}")

    t = time.monotonic()
    model = build_model(shape, device, dtype)
    log(
        f"{shape}: built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params on {device} "
        f"in {time.monotonic() - t:.1f} s"
    )
    if args.target_fp8:  # issue 31: the same random weights quantized to the published block-wise FP8 format
        from dflash_pipeline.extraction import fp8_linear

        t = time.monotonic()
        res["fp8_linears"] = fp8_linear.quantize_model(model, (args.fp8_block, args.fp8_block))
        if not res["fp8_linears"]:
            raise SystemExit(f"{shape}: no decoder linear takes {args.fp8_block}-wide blocks (--fp8-block)")
        log(f"{shape}: {res['fp8_linears']} linears quantized to FP8 in {time.monotonic() - t:.1f} s")
        if cuda:
            torch.cuda.empty_cache()
        save = False  # the in-memory model is what (a) and (b) run (the loader is replaced)
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
        # "recommend": (a) and the disk check pick (b)'s precision, as `plan` would on this disk
        **({"extract.store_precision": args.store_precision} if args.store_precision != "recommend" else {}),
    }
    cfg = load_config(None, base)
    report = bench_probe(cfg)
    if args.target_fp8:  # the manifest's config has no quantization_config: say what the model is
        from dflash_pipeline.extraction import quantized

        block = [args.fp8_block, args.fp8_block]
        fmt = {"quantization_config": {"quant_method": "fp8", "weight_block_size": block}}
        report.quantization = {
            **quantized.checkpoint_quantization(fmt, "bench (random weights quantized in memory)"),
            "forward": "fp8",
            "fp8_matmul": quantized.fp8_matmul([device], block),
        }
        res["fp8_matmul"] = report.quantization["fp8_matmul"]
        log(f"{shape}: FP8 linears multiply by {res['fp8_matmul']}")
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
    if disk_test is not None:  # diskcheck.advise as plan runs it, with (a)'s measured rate as the GPU's
        k = len(report.layer_ids) + int(report.capture_last)
        per_token = {p: k * quant.row_bytes(p, report.hidden_size) for p in diskcheck.PREFERENCE}
        advice = diskcheck.advise(
            disk_test.bytes_per_s, a["tokens_per_s"], sum(lengths), per_token, tested_bytes=disk_test.bytes
        )
        res["disk_advice"] = advice.to_dict()
        for line in advice.lines():
            log(f"{shape}: {line}")
        if args.store_precision == "recommend":
            base["extract.store_precision"] = advice.recommended
            cfg = load_config(None, base)
            shutil.rmtree(work / "store")  # the precision is part of the target's identity: a new version
            store, version, units = plan_store(work / "store", report, cfg, sample_ids, lengths, ids, dtype_name)
    res["store_precision"] = cfg.extract.store_precision
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
    b["check_first_batch"] = check_first_batch(store, version, units[0], first, dtype_name, cfg.extract.store_precision)
    if args.read_tokens:
        b["read"] = measure_read(store, version, args.read_tokens)
    res["b"] = b
    log(
        f"{shape}: (b) [{cfg.extract.store_precision}] {b['tokens_per_s']:.0f} tok/s, MFU {b['mfu']:.3f}, "
        f"{json.dumps(b)}"
    )

    # (b) variants: other writer settings; the model is loaded once for all of them (load is excluded anyway)
    variants = [v for v in args.b_variants.split(";") if v] if shape in args.variant_shapes.split(",") else []
    if variants and save:
        model = load_planned(report, device)
        loader_mod.load_planned = lambda *a_, **k_: model
    for spec in variants:
        opts = dict(kv.split("=") for kv in spec.split(","))
        vcfg = load_config(None, {**base, **{f"extract.{k}": v for k, v in opts.items() if k not in BENCH_KEYS}})
        shutil.rmtree(work / "store", ignore_errors=True)
        vstore, vversion, vunits = plan_store(work / "store", report, vcfg, sample_ids, lengths, ids, dtype_name)
        vreport = dataclasses.replace(report, token_budget=int(opts.get("token_budget", report.token_budget)))
        # switch=S: the interpreter's GIL switch interval (default 5 ms) during this run: does the thread
        # launching the forward wait for the GIL behind the writer threads?
        old_switch, old_codec = sys.getswitchinterval(), extract_mod.SHARD_CODEC_THREADS
        sys.setswitchinterval(float(opts.get("switch", old_switch)))
        # codec_threads=T: threads per store-writer process (the cores for writing split into fewer processes)
        extract_mod.SHARD_CODEC_THREADS = int(opts.get("codec_threads", old_codec))
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
            extract_mod.SHARD_CODEC_THREADS = old_codec
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
    p.add_argument(
        "--b-variants",
        default="",
        help="';'-separated extra (b) runs, e.g. 'threads=1;compression=lz4;codec_threads=2'",
    )
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
    p.add_argument(
        "--store-precision",
        default="full",
        choices=(*quant.PRECISIONS, "recommend"),
        help="extract.store_precision of (b); recommend: the disk check's pick (needs --disk-check-mib)",
    )
    p.add_argument(
        "--disk-check-mib",
        type=int,
        default=0,
        help="before anything else, write this many MiB to the work disk (storage/diskcheck.py) and, after (a), "
        "say which precision keeps (b) GPU-bound on it",
    )
    p.add_argument("--target-fp8", action="store_true", help="the target in block-wise FP8 (issue 31), in memory")
    p.add_argument("--fp8-block", type=int, default=128, help="FP8 weight block (published checkpoints: 128)")
    p.add_argument("--work", default="/tmp/dflash-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    if args.store_precision == "recommend" and not args.disk_check_mib:
        p.error("--store-precision recommend needs --disk-check-mib (e.g. 4096)")

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
    # the plan's rates (core/rates.json, core/cost.py): this run's (b) per shape, also into --out
    rates.record_file(
        out / "bench.json", "python bench/extract_bench.py " + " ".join(sys.argv[1:]), copy_to=out / "rates.json"
    )


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
        if "disk_advice" in r:
            d = r["disk_advice"]
            print(
                f"[{shape}] disk {r['disk_test']['bytes_per_s'] / 1e6:,.0f} MB/s ({r['disk_test']['method']}): "
                f"recommended {d['recommended']} ({d['reason']}); (b) ran {r['store_precision']}"
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
