"""GPU kill-and-resume bit-identity (issue 19): a worker SIGKILLed half-way and resumed with another free-memory
picture (so extract.token_budget=auto plans another batch size) must leave a store bit-identical to an
uninterrupted run's.

1. A random-weight dense checkpoint (saved, so worker processes load it) and synthetic samples.
2. (clean) one uninterrupted worker process, token budget as the probe plans it.
3. (killed) the same, SIGKILLed after its Nth shard write (DFLASH_KILL_AT), then resumed by a worker whose probe
   was given a tighter per-GPU cap, i.e. another auto budget; the version's recorded budget is used
   (extraction/plan.py::pin_token_budget, as dflash_pipeline.stages.worker_specs does).
4. (control) the same kill, resumed with the new budget NOT pinned: shows whether batching alone changes bits.

    python3 bench/gpu_resume_bench.py --out $OUT/resume
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from common import bench_probe, log, plan_store, synthetic_samples, worker_spec

SHAPE = dict(
    model_type="qwen3",
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)


def build_checkpoint(path: Path, small: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = (
        dict(SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=12, head_dim=16) if small else dict(SHAPE)
    )
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def stored(store_root: Path, version: str, units: list[str]) -> dict[str, np.ndarray]:
    import zarr

    out = {}
    for u in units:
        g = zarr.open_group(str(store_root / version / "units" / u), mode="r")
        for name in ("hidden", "last_hidden"):
            if name in g:
                out[f"{u}/{name}"] = g[name][:]
    return out


def same(a: dict, b: dict) -> tuple[bool, int]:
    rows = sum(v.shape[0] for v in a.values())
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), rows


def main() -> int:
    from dflash_pipeline.config import load_config
    from dflash_pipeline.extraction.plan import pin_token_budget
    from dflash_pipeline.extraction.procs import WorkerCrashed, run_in_process
    from dflash_pipeline.storage.store import Store

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=150_000)
    p.add_argument("--kill-after-shard", type=int, default=6)
    p.add_argument("--device", default="cuda:0", help="cpu: a small shape, a dry run of the logic")
    p.add_argument("--work", default="/tmp/dflash-resume")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    work, out = Path(args.work), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    small = args.device == "cpu"
    dtype = "float32" if small else "bfloat16"
    build_checkpoint(work / "model", small)
    base = {
        "output_dir": str(work),
        "target.model_path": str(work / "model"),
        "target.dtype": dtype,
        "extract.devices": args.device,
        "extract.unit_tokens": args.tokens // 2,
        "extract.shard_mib": 0.25 if small else 16,
        "extract.chunk_mib": 0.05 if small else 2,
        **({"extract.token_budget": 2048} if small else {}),
        "layers.capture_last": True,
    }
    cfg = load_config(None, base)
    report = bench_probe(cfg)
    tighter = {"extract.token_budget": 1024} if small else {"extract.max_gpu_memory_gib": report.weights_gib + 1.0}
    tight = bench_probe(load_config(None, {**base, **tighter}))
    log(f"probe budgets: free memory {report.token_budget} tokens/batch, tighter cap {tight.token_budget}")
    samples = synthetic_samples(args.tokens, SHAPE["vocab_size"], seed=3)
    res: dict = {"shape": SHAPE, "tokens": args.tokens, "budgets": [report.token_budget, tight.token_budget]}

    def run(name: str, kill: bool, resume_report) -> dict[str, np.ndarray]:
        root = work / name
        store, v, units = plan_store(root, report, cfg, *samples, dtype)
        t0 = time.monotonic()
        first = pin_token_budget(store, v, report)
        if kill:
            os.environ["DFLASH_KILL_AT"] = f"after_shard_write:{args.kill_after_shard}"
            try:
                run_in_process(worker_spec(root, v, units, first, cfg, dtype, args.device))
                raise AssertionError("the worker was not killed")
            except WorkerCrashed as e:
                log(f"{name}: worker killed as planned ({str(e).splitlines()[0]})")
            finally:
                del os.environ["DFLASH_KILL_AT"]
            committed = sum(Store(root).commit_record(v, u)["committed_tokens"] for u in units)
            again = resume_report(store, v)
            r = run_in_process(worker_spec(root, v, units, again, cfg, dtype, args.device))
            res[name] = {"committed_before_resume": committed, "resume_budget": again.token_budget}
        else:
            r = run_in_process(worker_spec(root, v, units, first, cfg, dtype, args.device))
            res[name] = {"budget": first.token_budget}
        res[name].update(tokens_per_s=r.tokens_per_s, forward_passes=r.forward_passes, wall_s=time.monotonic() - t0)
        log(f"{name}: {res[name]}")
        return stored(root, v, units)

    clean = run("clean", False, None)
    pinned = run("killed_resumed_pinned", True, lambda store, v: pin_token_budget(store, v, tight))
    control = run("killed_resumed_unpinned", True, lambda store, v: tight)
    eq, rows = same(clean, pinned)
    eq_control, _ = same(clean, control)
    res["bit_identical_pinned"], res["bit_identical_unpinned_control"], res["rows_compared"] = eq, eq_control, rows
    log(f"pinned resume bit-identical to clean: {eq} ({rows} rows); unpinned control: {eq_control}")
    (out / "gpu_resume_bench.json").write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps(res, indent=2, default=str))
    return 0 if eq else 1


if __name__ == "__main__":
    raise SystemExit(main())
