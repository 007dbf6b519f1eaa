"""What training's data loading costs per precision (issue 20): a store of synthetic 8B-shaped rows (5 layers x
hidden 4096, Gaussian with log-normal channel scales, written by the pipeline's own planner and writer) per
precision, then HiddenStateDataset.__getitem__ + collate over every sample in random order, one process, as a
DataLoader worker runs them: bf16 (a view of the stored bits), and fp8 / int8 both dequantized on the CPU
(dequantize=True, the reader's default) and as stored (dequantize=False, what training now reads: its device
dequantizes). Each configuration is timed `--repeats` times over a fresh dataset (files in the page cache).

    .venv/bin/python bench/read_bench.py --tokens 40000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def build(root: Path, precision: str, tokens: int, k: int, h: int) -> tuple[str, str]:
    from dflash_pipeline.calibration import _write_synthetic
    from dflash_pipeline.storage import quant
    from dflash_pipeline.storage.layout import FORMAT_VERSION
    from dflash_pipeline.storage.planning import plan_units
    from dflash_pipeline.storage.store import Store

    rng = np.random.default_rng(0)
    lengths, total = [], 0
    while total < tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(900), 0.75), 200, 4096)))
        total += lengths[-1]
    ids = [f"s{i:06d}" for i in range(len(lengths))]
    store = Store(root / precision)
    prov = {"format_version": FORMAT_VERSION, "layer_ids": list(range(k)), "hidden_size": h, "capture_last": False}
    prov |= {"logical_dtype": "bfloat16", **quant.precision_attrs(precision), "compute_dtype": "bfloat16"}
    version = store.resolve_version(prov, "bench", new_version=False, incremental=False)

    def fetch(rows):
        return [np.zeros(lengths[i], np.int32) for i in rows], [np.ones(lengths[i], np.uint8) for i in rows]

    plan = plan_units(store, version, ids, lengths, fetch, 1 << 40, 4.0, 128.0, "zstd")
    report = SimpleNamespace(layer_ids=list(range(k)), hidden_size=h, capture_last=False)
    _write_synthetic(store, version, plan.new_units[0].name, report, "bfloat16", precision)
    return str(root / precision), version


def read_all(root: str, version: str, dequantize: bool, seed: int) -> float:
    from dflash_pipeline.drafter.batching import collate
    from dflash_pipeline.storage.reader import HiddenStateDataset

    ds = HiddenStateDataset(root, version, dequantize=dequantize, unvalidated="warn")  # synthetic: never validated
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    toks, t0 = 0, time.monotonic()
    for i in order:
        b = collate([ds[i]])
        toks += int(b["lengths"].sum())
    return toks / (time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="read-bench-") as tmp:
        stores = {p: build(Path(tmp), p, args.tokens, 5, 4096) for p in ("full", "fp8", "int8")}
        configs = [("full", True), ("fp8", True), ("fp8", False), ("int8", True), ("int8", False)]
        for r in range(args.repeats):  # interleaved, so that load changes hit every configuration alike
            for p, deq in configs:
                rows.append({"precision": p, "dequantize": deq, "tokens_per_s": read_all(*stores[p], deq, r)})
    print("| precision | read as | tokens/s per process (median of runs) | runs |")
    print("| --- | --- | --- | --- |")
    out = []
    for p, deq in configs:
        rates = [x["tokens_per_s"] for x in rows if x["precision"] == p and x["dequantize"] == deq]
        how = "bf16 view" if p == "full" else ("dequantized on the CPU" if deq else "as stored (+ scales)")
        print(f"| {p} | {how} | {statistics.median(rates):,.0f} | {', '.join(f'{x:,.0f}' for x in rates)} |")
        out.append({"precision": p, "dequantize": deq, "median": statistics.median(rates), "runs": rates})
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
