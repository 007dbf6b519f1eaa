"""Cost of the store's integrity checks (issue 15): `dflash-pipeline verify` throughput, and the reader's
overhead with its checks on ("sizes", the default; "digests") against none, on training's data path.

Builds a bf16 store of --gb GB of random hidden states (zstd, default chunking) with the real planner and
writer, then
- verify: storage.verify.verify_version with digests (what `dflash-pipeline verify` runs), in GB/s of committed
  file bytes, page cache warm (just written) and, where this process may drop the page cache, cold;
- reader: one pass over every sample in random order (as a shuffling DataLoader asks), fresh dataset each
  pass so every unit's first-open checks are paid, for checks off / "sizes" / "digests", --passes times in
  rotation; the median pass is reported.
The version is synthetic and never validated, so it is read with unvalidated="warn": the reader's validation gate
on a validated version (comparing validation.json's state with every unit's commit record) is not measured here.

    python bench/verify_bench.py --out /tmp/vb --gb 2
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from dflash_pipeline.storage import reader as reader_mod
from dflash_pipeline.storage.layout import LAYER_CONVENTION
from dflash_pipeline.storage.planning import plan_units
from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.verify import verify_version
from dflash_pipeline.storage.writer import UnitWriter


def build(root: Path, gb: float, hidden: int, layers: int, unit_tokens: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    store = Store(root)
    prov = {
        "model_type": "bench",
        "model_config_hash": "bench",
        "weights_fingerprint": "bench",
        "num_layers": layers + 1,
        "hidden_size": hidden,
        "layer_ids": list(range(layers)),
        "layer_convention": LAYER_CONVENTION,
        "capture_last": False,
        "logical_dtype": "bfloat16",
        "compute_dtype": "bfloat16",
    }
    version = store.resolve_version(prov, "bench-dataset", new_version=True, incremental=False)
    per_token = layers * hidden * 2
    lengths: list[int] = []
    while sum(lengths) * per_token < gb * 1e9:
        lengths.append(int(rng.integers(256, 2048)))
    ids = [f"s{i:08d}" for i in range(len(lengths))]

    def fetch(rows):
        return [np.zeros(lengths[i], np.int32) for i in rows], [np.ones(lengths[i], np.uint8) for i in rows]

    plan_units(store, version, ids, lengths, fetch, unit_tokens, 4.0, 128.0, "zstd")
    # bf16 bits of N(0, 1) values: compresses like real states (~1.4x with zstd)
    pool = (rng.standard_normal((8192, layers, hidden), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    for u in store.units(version):
        w = UnitWriter(store.unit_location(version, u), threads=2)
        pos = 0
        while pos < w.n_tokens:
            n = min(4096, w.n_tokens - pos)
            off = (pos * 7919) % (len(pool) - n)
            w.add(pos, pool[off : off + n])
            pos += n
        w.finish()
    return version


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_pass(root: Path, version: str, mode: str | None, order: list[int]) -> float:
    cls = reader_mod.HiddenStateDataset
    real = cls._check_files, cls._check_shards, cls._check_still_there
    if mode is None:  # checks off: what the reader did before issue 15
        cls._check_files = lambda self, unit: None
        cls._check_shards = lambda self, unit, files: None
        cls._check_still_there = lambda self, ref, files: None
    try:
        t0 = time.perf_counter()
        ds = HiddenStateDataset(root, version, verify=mode or "sizes", unvalidated="warn")
        n = 0
        for i in order:
            n += ds[i]["hidden"].numel()
        return time.perf_counter() - t0
    finally:
        cls._check_files, cls._check_shards, cls._check_still_there = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--unit-tokens", type=int, default=65536)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the store")
    a = ap.parse_args()
    root = Path(a.out) / "store"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    version = build(root, a.gb, a.hidden, a.layers, a.unit_tokens)
    res: dict = {"build_s": round(time.perf_counter() - t0, 1), "args": vars(a)}
    store = Store(root)

    r = verify_version(store, version, digests=True, threads=a.threads)
    assert r.ok, [p.line() for p in r.problems]
    res["verify_warm"] = {"GB": r.bytes / 1e9, "s": r.seconds, "GB/s": r.bytes / 1e9 / r.seconds, "files": r.files}
    r = verify_version(store, version, digests=False, threads=a.threads)
    res["verify_sizes_only_s"] = r.seconds
    if drop_caches():
        r = verify_version(store, version, digests=True, threads=a.threads)
        res["verify_cold"] = {"GB": r.bytes / 1e9, "s": r.seconds, "GB/s": r.bytes / 1e9 / r.seconds}
    else:
        res["verify_cold"] = "not measured: this process may not drop the page cache"

    n = len(HiddenStateDataset(root, version, unvalidated="warn"))
    order = list(range(n))
    random.Random(0).shuffle(order)
    read_pass(root, version, None, order)  # warm the page cache: reads are measured, not the disk
    times: dict[str, list[float]] = {"off": [], "sizes": [], "digests": []}
    for _ in range(a.passes):
        for mode in times:
            times[mode].append(read_pass(root, version, None if mode == "off" else mode, order))
    med = {m: statistics.median(t) for m, t in times.items()}
    # The checks' own time, measured directly (the A/B difference of whole passes is within the noise of a
    # shared machine): construction (records and attributes), every unit's first-open file checks, and every
    # shard's first-touch check (as one pass over all samples touches them): "sizes" its chunk index and chunk CRCs
    # (storage.digest.of_chunks), "digests" its whole content.
    checks: dict[str, float] = {}
    for mode in ("sizes", "digests"):
        t0 = time.perf_counter()
        ds = HiddenStateDataset(root, version, verify=mode, unvalidated="warn")
        construct, files, shards = time.perf_counter() - t0, 0.0, 0.0
        for u in store.units(version):
            t = time.perf_counter()
            ds._check_files(u)  # every unit's first-open checks
            files += time.perf_counter() - t
            ds._unit_arrays(u)  # its arrays opened, as the unchecked reader opens them too (not counted)
            t = time.perf_counter()
            ds._check_shards(u, ds._read_files(u, 0, store.unit_attrs(version, u)["n_tokens"]))  # first touches
            shards += time.perf_counter() - t
        t = time.perf_counter()
        for ref in ds.samples:  # after every read: the files it used are still there (a stat each)
            ds._check_still_there(ref, ds._read_files(ref.unit, ref.start, ref.start + ref.length))
        after = time.perf_counter() - t
        checks[mode] = {
            "construct_s": construct,
            "unit_file_checks_s": files,
            "shard_checks_s": shards,
            "after_read_s": after,
            "file_checks_s": files + shards + after,
        }
    res["reader"] = {
        "samples": n,
        "units": len(store.units(version)),
        "pass_s_median": med,
        "pass_s_all": times,
        "ab_overhead_sizes_pct": 100 * (med["sizes"] / med["off"] - 1),
        "ab_overhead_digests_pct": 100 * (med["digests"] / med["off"] - 1),
        "check_times": checks,
        "direct_overhead_sizes_pct": 100 * checks["sizes"]["file_checks_s"] / med["off"],
        "direct_overhead_digests_pct": 100 * checks["digests"]["file_checks_s"] / med["off"],
    }
    print(json.dumps(res, indent=1))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
