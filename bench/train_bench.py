"""Drafter training at steady state, from a store the pipeline's extractor wrote on local disk (issue 19, item 3).

    python bench/train_bench.py --out $OUT --minutes 10                    # 8B shape on cuda:0, one long run
    python bench/train_bench.py --out $OUT --minutes 1.5 --variants "compile=off;compile=layers" --profile-steps 5
    python bench/train_bench.py --cpu-smoke --out /tmp/tb                  # tiny shape on CPU (checks the bench)

1. A random-weight target of the shape is saved as a HF checkpoint under --work (kept: --reuse skips 1-2).
2. The pipeline's worker (extraction/procs.run_in_process, its own process) extracts --tokens synthetic tokens
   (lengths log-normal, median 900, clipped to [200, 4096]; every token supervised) into a Zarr store, with the
   default extraction config (zstd, 128 MiB shards) and --precision.
3. Each variant trains `drafter.train.train` (the pipeline's own training: store reader with DataLoader workers,
   anchors, flex attention, the chunked lm_head loss) with the DFlash defaults: 5 draft layers, block 16, 512
   anchors, batch 1, AdamW, a bf16 copy of fp32 master weights (train.precision). It runs for --minutes, then SIGTERM
   (the user's stop: a checkpoint at the next step boundary, into /dev/shm so the disk write stays out of the
   figures' window, which ends at the last step anyway).
4. Steady state = the steps after the first --warmup-minutes (compilation, cache warm-up): from train's per-step
   history (cumulative tokens, time, data wait, work counts) the bench takes the differences over that window.

FLOP count (useful work; a step's counts come from the training loop's history, see drafter/train.py):
  C context tokens, Q draft queries (anchors x block), P attention query-key pairs (each block's queries see the
  context before its anchor plus their own block), S supervised positions (rows through the lm_head);
  H hidden, I MLP width, nh/nkv heads of head_dim d, K captured target layers, V vocabulary, L draft layers.
  - fc (K*H -> H): 2*C*K*H*H forward + the same for its weight gradient (the stored states need no gradient).
  - each draft layer, forward: q and o 2*Q*H*nh*d each; k and v over context + block 2*(C+Q)*H*nkv*d each;
    MLP 3 * 2*Q*H*I; attention QK^T and PV 4*nh*d*P. Times 3 for forward + input gradient + weight gradient
    (the first layer's q_proj needs no input gradient: counted anyway, < 0.3% of the total).
  - frozen lm_head: 2*S*H*V forward + 2*S*H*V input gradient (no weight gradient); embedding lookups: 0.
  - norms, rotary, softmax and the optimizer: not counted.
MFU = FLOPs / time / peak, peak = a bf16 8192^3 GEMM measured in the same run (datasheet 989 TFLOP/s beside it).
Data wait = time the training loop blocked on the next batch / wall time of the window.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import rates  # bench/rates.py, beside this script
import torch
from common import SHAPES, log, plan_store, profile_table, publish_store, saved_target, synthetic_samples, worker_spec
from instruments import kernel_busy, matmul_peak

DATASHEET_TFLOPS = 989.0


def step_flops(spec, c: float, q: float, p: float, s: float) -> float:
    """Useful FLOPs of the work counted (see the module docstring)."""
    h, i, nh, nkv, d = (
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.head_dim,
    )
    k, v, layers = len(spec.target_layer_ids), spec.vocab_size, spec.num_hidden_layers
    fc = 2 * (2 * c * k * h * h)
    layer = 2 * 2 * q * h * nh * d + 2 * 2 * (c + q) * h * nkv * d + 3 * 2 * q * h * i + 4 * nh * d * p
    head = 2 * (2 * s * h * v)
    return fc + 3 * layers * layer + head


def make_store(args, work: Path, device: str, dtype_name: str) -> dict:
    from dflash_pipeline.extraction.procs import run_in_process

    overrides = {"extract.devices": device, "extract.store_precision": args.precision}
    if args.shape in IN_MEMORY or args.in_memory_target:
        cfg, report, vocab, r, version = _in_memory_store(args, work, device, dtype_name, overrides)
        ids = synthetic_samples(args.tokens, vocab, seed=1)
    else:
        cfg, report, vocab = saved_target(args.shape, device, dtype_name, work, overrides)
        ids = synthetic_samples(args.tokens, vocab, seed=1)
        _, version, units = plan_store(work / "store", report, cfg, *ids, dtype_name)
        r = run_in_process(worker_spec(work / "store", version, units, report, cfg, dtype_name, device))
    log(f"store: {r.tokens} tokens at {r.tokens_per_s:,.0f} tokens/s (version {version})")
    publish_store(work / "store", version, cfg, *ids)
    meta = {
        "version": version,
        "vocab": vocab,
        "tokens": r.tokens,
        "extract_tokens_per_s": r.tokens_per_s,
        "report": report.to_json(),
        "precision": args.precision,
        "store_bytes": _bytes(work / "store"),
    }
    (work / "bench_store.json").write_text(json.dumps(meta, indent=2))
    return meta


IN_MEMORY = {"27b"}  # a 54 GB checkpoint would not fit the GPU host's disk beside the store


def _in_memory_store(args, work: Path, device: str, dtype_name: str, overrides: dict):
    """The 27B shape: the random-weight target stays on the GPU (the extraction worker runs in this process with
    the loader replaced, as extract_bench does), and only what training reads of it goes to disk: config.json and
    a safetensors file with the embedding and lm_head. The states are the pipeline worker's own extraction."""
    from common import bench_probe, build_model, write_manifest_checkpoint
    from safetensors.torch import save_file

    from dflash_pipeline.config import load_config
    from dflash_pipeline.extraction import loader as loader_mod
    from dflash_pipeline.extraction.extract import run_worker

    t = time.monotonic()
    # The probe reads every tensor's header and plans on the device's free memory, so it runs before the weights
    # take the GPU (after, a 27B target on an 80 GB H100 left 28.5 GiB "free" for its own 52.5: refused).
    write_manifest_checkpoint(build_model(args.shape, "meta", getattr(torch, dtype_name)), work / "model")
    cfg = load_config(None, {"output_dir": str(work), "target.model_path": str(work / "model"),
                             "target.dtype": dtype_name, **overrides})  # fmt: skip
    report = bench_probe(cfg)
    model = build_model(args.shape, device, getattr(torch, dtype_name))
    vocab = model.config.vocab_size
    ids = synthetic_samples(args.tokens, vocab, seed=1)
    _, version, units = plan_store(work / "store", report, cfg, *ids, dtype_name)
    load = loader_mod.load_planned
    loader_mod.load_planned = lambda *a_, _model=model, **k_: _model
    try:
        r = run_worker(worker_spec(work / "store", version, units, report, cfg, dtype_name, device))
    finally:
        loader_mod.load_planned = load
    sd = model.state_dict()
    keep = [k for k in sd if k.endswith("embed_tokens.weight") or k == "lm_head.weight"]
    save_file({k: sd[k].contiguous().cpu() for k in keep}, str(work / "model" / "model.safetensors"))
    del model, sd
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"{args.shape}: target on the GPU, store extracted, head saved ({keep}) in {time.monotonic() - t:.0f} s")
    return cfg, report, vocab, r, version


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_settings(overrides: dict) -> tuple[dict, contextlib.AbstractContextManager]:
    """A variant's bench-only keys (not TrainConfig fields), applied for its run: `flex=PATH` the FlexAttention
    tiles of bench/flex_tune.py's flex_best.json; `ce=eager` the loss's per-chunk softmax uncompiled (the code
    before issue 30)."""
    from dflash_pipeline.drafter import flex, head_loss
    from dflash_pipeline.drafter.model import eager_pointwise

    rest = {k: v for k, v in overrides.items() if k not in ("flex", "ce")}
    stack = contextlib.ExitStack()
    if "flex" in overrides:
        best = json.loads(Path(overrides["flex"]).read_text())
        old = flex.MASK_BLOCK, flex.KERNEL_OPTIONS
        flex.MASK_BLOCK, flex.KERNEL_OPTIONS = tuple(best["mask_block"]), best["kernel_options"]
        stack.callback(lambda: setattr(flex, "MASK_BLOCK", old[0]) or setattr(flex, "KERNEL_OPTIONS", old[1]))
    if overrides.get("ce") == "eager":
        real = head_loss.compile_chunk
        head_loss.compile_chunk = lambda enabled: real(False)
        stack.callback(lambda: setattr(head_loss, "compile_chunk", real))
    stack.callback(eager_pointwise)  # the next variant starts from eager again (its train() compiles if asked)
    return rest, stack


def run_variant(name: str, overrides: dict, args, work: Path, meta: dict, device: str, peak: float) -> dict:
    from dflash_pipeline.drafter.config import TrainConfig
    from dflash_pipeline.drafter.train import train
    from dflash_pipeline.extraction.probe import ProbeReport

    overrides, settings = bench_settings(overrides)

    report = ProbeReport.from_json(meta["report"])
    small = args.cpu_smoke
    tc = TrainConfig(
        **{
            "block_size": 8 if small else 16,
            "anchors_per_sample": 64 if small else 512,
            "epochs": 10_000,
            "batch_size": 1,
            "num_workers": 4,
            "checkpoint_every": 10**9,
            "log_every": 1,
            "device": device,
            "mask_token": meta["vocab"] - 1,  # the bench target has no tokenizer: an id inside the embedding
            **overrides,
        }
    )
    out = Path("/dev/shm" if Path("/dev/shm").is_dir() and not small else work) / f"train-{name}"
    shutil.rmtree(out, ignore_errors=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    prof, marks = None, {}
    warm_s = args.warmup_minutes * 60

    def progress(step, total, loss, tps):
        nonlocal prof
        now = time.perf_counter()
        marks.setdefault("first", now)
        if args.profile_steps and prof is None and now - marks["first"] > warm_s:
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            )
            prof.start()
            marks["prof_step"] = step
        elif prof is not None and "prof_end" not in marks and step >= marks["prof_step"] + args.profile_steps:
            prof.stop()
            marks["prof_end"] = step

    timer = threading.Timer(args.minutes * 60, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with settings:
            r = train(tc, str(work / "store"), report, out, version=meta["version"], progress=progress)
    finally:
        timer.cancel()
    hist = r.history
    spec = _spec_of(tc, report, meta)
    start = next((h for h in hist if h["elapsed_s"] >= warm_s), hist[len(hist) // 3])
    end = hist[-1]
    dt = end["elapsed_s"] - start["elapsed_s"]
    if dt <= 0:
        raise SystemExit(
            f"variant {name}: {len(hist)} logged step(s), none after the {warm_s:.0f} s warm-up: nothing to measure; "
            "give more --minutes (or fewer --warmup-minutes)"
        )

    def delta(k):
        return end[k] - start[k]

    fl = step_flops(spec, delta("tokens"), delta("queries"), delta("attn_pairs"), delta("supervised"))
    res = {
        "variant": name,
        "overrides": overrides,
        "steps_total": r.steps,
        "window_steps": end["step"] - start["step"],
        "window_s": dt,
        "tokens_per_s": delta("tokens") / dt,
        "samples_per_s": (end["step"] - start["step"]) * tc.batch_size * tc.grad_accum / dt,
        "tflops": fl / dt / 1e12,
        "mfu": fl / dt / 1e12 / peak,
        "mfu_datasheet": fl / dt / 1e12 / DATASHEET_TFLOPS,
        "data_wait_fraction": delta("data_wait_s") / dt,
        "flops_per_step": fl / max(end["step"] - start["step"], 1),
        "queries_per_step": delta("queries") / max(end["step"] - start["step"], 1),
        "supervised_per_step": delta("supervised") / max(end["step"] - start["step"], 1),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "loss_first": r.first_loss,
        "loss_last": end["loss"],
        "whole_run_tokens_per_s": r.tokens_per_s,
        "elapsed_s": r.elapsed_s,
        "interrupted": r.interrupted,
        "loss_by_step": [round(h["loss"], 5) for h in hist],  # the overlay of variants (same seed, same data)
    }
    if prof is not None:
        if "prof_end" not in marks:
            prof.stop()
        (Path(args.out) / f"profile_{name}.txt").write_text(profile_table(prof))
        res["profile_steps"] = [marks.get("prof_step"), marks.get("prof_end")]
        res["profile_gpu_busy"] = kernel_busy(prof)  # the rest: the GPU waiting on the host in those steps
    shutil.rmtree(out, ignore_errors=True)
    log(
        f"[{name}] {res['tokens_per_s']:,.0f} tokens/s, MFU {res['mfu']:.3f} (datasheet {res['mfu_datasheet']:.3f}), "
        f"data wait {res['data_wait_fraction']:.1%}, GPU busy in the profile {res.get('profile_gpu_busy')}, "
        f"peak {res['peak_gpu_gib'] or 0:.1f} GiB, "
        f"{res['window_steps']} steps in {dt:.0f} s"
    )
    return res


def _spec_of(tc, report, meta):
    from dflash_pipeline.drafter.target_head import draft_spec
    from dflash_pipeline.storage.reader import HiddenStateDataset

    ds = HiddenStateDataset(meta["store_root"], meta["version"])
    return draft_spec(report.model_path, ds.layer_ids, tc, meta["vocab"] - 1)


def _value(text: str):
    """A variant's value: JSON where it parses (numbers, true/false, null, lists), else the plain string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'compile=off;compile=layers,attention=sdpa' -> [(name, {field: value})]; '' -> the defaults."""
    out = []
    for part in [p for p in text.split(";") if p.strip()] or ["defaults"]:
        kv = {}
        if part != "defaults":
            for item in part.split(","):
                k, v = item.split("=", 1)
                kv[k.strip()] = _value(v.strip())
        name = "+".join(f"{k}-{Path(str(v)).stem if '/' in str(v) else v}" for k, v in kv.items()) or "defaults"
        out.append((name, kv))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=400_000, help="tokens in the store")
    p.add_argument("--precision", default="full", help="extract.store_precision of the store")
    p.add_argument("--minutes", type=float, default=10.0, help="training time per variant (warm-up included)")
    p.add_argument("--warmup-minutes", type=float, default=1.0, help="excluded from the steady-state window")
    p.add_argument(
        "--variants", default="", help="';'-separated TrainConfig overrides, e.g. 'compile=off;compile=layers'"
    )
    p.add_argument("--profile-steps", type=int, default=0, help="torch.profiler over this many steps after warm-up")
    p.add_argument("--reuse", action="store_true", help="reuse the target and store in --work from an earlier run")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU: checks the bench, measures nothing")
    p.add_argument("--in-memory-target", action="store_true", help="as the 27B shape: the target not saved (smoke)")
    p.add_argument("--work", default="/tmp/dflash-train-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    if args.cpu_smoke:
        args.shape = "tiny-dense"
    device = "cpu" if args.cpu_smoke else "cuda:0"
    dtype_name = "float32" if args.cpu_smoke else "bfloat16"
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.reuse and (work / "bench_store.json").is_file():
        meta = json.loads((work / "bench_store.json").read_text())
        log(f"reusing the store of an earlier run: {meta['tokens']} tokens, version {meta['version']}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        meta = make_store(args, work, device, dtype_name)
    meta["store_root"] = str(work / "store")
    peak = matmul_peak(device)
    log(f"matmul peak {peak:.0f} TFLOP/s")
    res = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "matmul_peak_tflops": peak,
        "store": {k: v for k, v in meta.items() if k != "report"},
        "variants": [],
    }
    for name, overrides in parse_variants(args.variants):
        try:
            res["variants"].append(run_variant(name, overrides, args, work, meta, device, peak))
        except Exception as e:  # noqa: BLE001 - one variant's failure (an OOM, a kernel the compiler rejects) is its result
            log(f"[{name}] failed: {type(e).__name__}: {str(e)[:500]}")
            res["variants"].append({"variant": name, "overrides": overrides, "error": f"{type(e).__name__}: {e}"})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        (out / "train_bench.json").write_text(json.dumps(res, indent=2, default=str))
    # the plan's rates (core/rates.json, core/cost.py): each variant's steady rate and whole run, also into --out
    rates.record_file(
        out / "train_bench.json", "python bench/train_bench.py " + " ".join(sys.argv[1:]), copy_to=out / "rates.json"
    )
    print("\nvariant | tokens/s | MFU | data wait | peak GiB | steps in window")
    for v in res["variants"]:
        if "error" in v:
            print(f"{v['variant']} | failed: {v['error'].splitlines()[0][:120]}")
            continue
        print(
            f"{v['variant']} | {v['tokens_per_s']:,.0f} | {v['mfu']:.3f} | {v['data_wait_fraction']:.2%} | "
            f"{v['peak_gpu_gib'] or 0:.1f} | {v['window_steps']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
