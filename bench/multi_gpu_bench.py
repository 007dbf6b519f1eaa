"""Scaling over the GPUs of one host, and drafter-training throughput from a store on local disk.

    python bench/multi_gpu_bench.py --out $OUT                      # every visible GPU, Qwen3-8B shape
    python bench/multi_gpu_bench.py --cpu-smoke --out /tmp/mg       # tiny shape, two CPU workers

1. A random-weight model of the shape is saved as a HF checkpoint on local disk.
2. One GPU: the pipeline's worker (target/procs.run_in_process: its own process, pinned with
   CUDA_VISIBLE_DEVICES) extracts --tokens-per-gpu synthetic tokens into a Zarr store.
3. All GPUs: N workers, one process each, run concurrently on N x --tokens-per-gpu tokens, units
   balanced by tokens (target/plan.assign_units). Scaling = aggregate tokens/s / one-GPU tokens/s, where a
   worker's tokens/s excludes its model load (WorkerResult.tokens_per_s) and the aggregate is their sum;
   the wall-clock figure (loads included) is reported beside it.
4. Drafter training (drafter.train, 5 draft layers, block 16) on cuda:0 reads the N-GPU store from disk
   through the store reader with DataLoader workers; reported: tokens/s and the share of step time spent
   waiting for data (GPU busy = 1 - that share).

With --split, steps 3-4 are replaced by one replica split across the first two devices: the probe is told
each GPU has room for only 3/4 of the weights (extract.max_gpu_memory_gib), so it must decide on a split
("cuda:0+cuda:1", target/placement.py); that replica's worker extracts the same samples as step 2, and its
store is compared with step 2's, array by array (bit-equal expected: same kernels, same batches).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import bench_probe, log, plan_store, publish_store, saved_target, synthetic_samples, worker_spec


def split_replica(
    args, work: Path, report, dtype_name: str, vocab: int, one, one_store: Path, devices: list[str]
) -> dict:
    import numpy as np
    import zarr

    from dflash_pipeline.config import load_config
    from dflash_pipeline.extraction.procs import run_in_process

    # Same batches as the one-GPU run, and room for 3/4 of the weights per GPU: one GPU cannot hold a replica.
    cap = report.working_gib + report.weights_gib * 0.75
    scfg = load_config(
        None,
        {
            "output_dir": str(work),
            "target.model_path": report.model_path,
            "target.dtype": dtype_name,
            "extract.devices": ",".join(devices),
            "extract.unit_tokens": max(args.tokens_per_gpu // 4, 1000),
            "extract.max_gpu_memory_gib": cap,
            "extract.token_budget": report.token_budget,
        },
    )
    sreport = bench_probe(scfg)
    log(f"probe with {cap:.1f} GiB per GPU: {sreport.placement}; token budget {sreport.token_budget}")
    assert sreport.replicas == ["+".join(devices)], sreport.replicas
    ids = synthetic_samples(args.tokens_per_gpu, vocab, seed=1)
    store, v, units = plan_store(work / "store_split", sreport, scfg, *ids, dtype_name)
    r = run_in_process(worker_spec(work / "store_split", v, units, sreport, scfg, dtype_name, sreport.replicas[0]))
    log(f"split replica {sreport.replicas[0]}: {r.tokens_per_s:,.0f} tokens/s, peak {r.peak_gpu_gib:.1f} GiB/GPU")
    equal, compared = True, 0
    for u in units:
        a = zarr.open_array(str(one_store / "units" / u / "hidden"), mode="r")[:]
        b = zarr.open_array(str(work / "store_split" / v / "units" / u / "hidden"), mode="r")[:]
        equal &= a.shape == b.shape and bool(np.array_equal(a, b))
        compared += a.shape[0]
    log(f"stored states of the split replica bit-equal to one GPU's: {equal} ({compared} tokens)")
    return {
        "placement": sreport.placement,
        "max_gpu_memory_gib": cap,
        "weights_gib": sreport.weights_gib,
        "tokens": r.tokens,
        "tokens_per_s": r.tokens_per_s,
        "vs_one_gpu": r.tokens_per_s / one.tokens_per_s,
        "peak_gpu_gib_max_over_replica": r.peak_gpu_gib,
        "gpu_busy": r.gpu_busy_fraction,
        "bit_equal_to_one_gpu": equal,
        "tokens_compared": compared,
    }


def main() -> int:
    from dflash_pipeline.extraction.plan import assign_units
    from dflash_pipeline.extraction.procs import run_in_process

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b")
    p.add_argument("--tokens-per-gpu", type=int, default=400_000)
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny-dense shape, two CPU worker processes")
    p.add_argument("--split", action="store_true", help="one replica split across two GPUs instead of 3-4")
    p.add_argument("--work", default="/tmp/dflash-mgpu")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args()
    shape = "tiny-dense" if args.cpu_smoke else args.shape
    devices = ["cpu:0", "cpu:1"] if args.cpu_smoke else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    dtype_name = "float32" if args.cpu_smoke else "bfloat16"
    work, out = Path(args.work), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"shape": shape, "devices": devices}

    cfg, report, vocab = saved_target(
        shape,
        devices[0],
        dtype_name,
        work,
        {"extract.devices": devices[0], "extract.unit_tokens": max(args.tokens_per_gpu // 4, 1000)},
    )

    # one device
    ids = synthetic_samples(args.tokens_per_gpu, vocab, seed=1)
    _, v1, units1 = plan_store(work / "store1", report, cfg, *ids, dtype_name)
    one = run_in_process(worker_spec(work / "store1", v1, units1, report, cfg, dtype_name, devices[0]))
    res["one_device"] = {"tokens": one.tokens, "tokens_per_s": one.tokens_per_s, "seconds_with_load": one.seconds}
    log(f"1 device: {one.tokens_per_s:,.0f} tokens/s ({one.tokens} tokens)")

    if args.split:
        res["split"] = split_replica(args, work, report, dtype_name, vocab, one, work / "store1" / v1, devices[:2])
        (out / "multi_gpu_bench.json").write_text(json.dumps(res, indent=2, default=str))
        print(json.dumps(res, indent=2, default=str))
        return 0

    # every device at once
    ids = synthetic_samples(args.tokens_per_gpu * len(devices), vocab, seed=2)
    store2, v2, units2 = plan_store(work / "store2", report, cfg, *ids, dtype_name)
    assignment = assign_units([store2.unit_info(v2, u) for u in units2], devices)
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(devices)) as ex:
        futs = {
            d: ex.submit(run_in_process, worker_spec(work / "store2", v2, us, report, cfg, dtype_name, d))
            for d, us in assignment.items()
        }
        many = {d: f.result() for d, f in futs.items()}
    wall = time.monotonic() - t0
    agg = sum(r.tokens_per_s for r in many.values())
    total = sum(r.tokens for r in many.values())
    res["all_devices"] = {
        "per_device": {
            d: {"tokens": r.tokens, "tokens_per_s": r.tokens_per_s, "gpu_busy": getattr(r, "gpu_busy", None)}
            for d, r in many.items()
        },
        "aggregate_tokens_per_s": agg,
        "scaling_vs_one": agg / one.tokens_per_s,
        "wall_s_with_loads": wall,
        "wall_tokens_per_s_with_loads": total / wall,
    }
    log(
        f"{len(devices)} devices: aggregate {agg:,.0f} tokens/s = {agg / one.tokens_per_s:.2f}x one device; "
        f"wall incl. loads {total / wall:,.0f} tokens/s"
    )

    # drafter training from the N-device store, on the first device
    from dflash_pipeline.drafter.config import TrainConfig
    from dflash_pipeline.drafter.train import train

    tc = TrainConfig(
        block_size=8 if args.cpu_smoke else 16,
        max_steps=args.train_steps,
        epochs=100,
        batch_size=1,
        anchors_per_sample=64 if args.cpu_smoke else 512,
        num_workers=4,
        checkpoint_every=10**6,
        log_every=5,
        device="cpu" if args.cpu_smoke else "cuda:0",
        mask_token=vocab - 1,
    )  # the bench model has no tokenizer: an id inside the embedding
    publish_store(work / "store2", v2, cfg, *ids)  # training reads only a validated version
    tr = train(tc, str(work / "store2"), report, work / "drafter", version=v2)
    steady = tr.history[len(tr.history) // 3 :]
    res["drafter_training"] = {
        "steps": tr.steps,
        "tokens_per_s": tr.tokens_per_s,
        "data_wait_fraction": tr.data_wait_fraction,
        "gpu_busy_fraction": 1 - tr.data_wait_fraction,
        "first_loss": tr.first_loss,
        "final_loss": tr.final_loss,
        "steady_history": steady[-3:],
    }
    log(f"drafter training: {tr.tokens_per_s:,.0f} tokens/s, data wait {tr.data_wait_fraction:.1%}")
    (out / "multi_gpu_bench.json").write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
