"""What a compact store costs in drafter quality (issue 20): the embedded default (configs/embedded.yaml) trained
from a bf16 store and from each compact store (fp8, int8), same data, same settings, same seeds; acceptance
length on the held-out prompts and bytes per token side by side.

The conversations are regenerated and prepared once (shared output_dir); each precision gets its own store
(store_path) and each (precision, seed) its own drafter directory. Every store is bf16 on read
(extract.store_dtype=bfloat16, as a GPU extraction stores), so the compact ones differ from the bf16 one only by
their quantization. Stages run in this process (LocalRunner, no Prefect).

    .venv/bin/python bench/precision_quality.py --out runs/precision_quality --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def store_bytes(version_dir: Path) -> dict[str, int]:
    """Bytes on disk per array of every unit (hidden states, their scales, ids, mask) and in all."""
    out: dict[str, int] = {}
    for f in version_dir.rglob("*"):
        if f.is_file():
            rel = f.relative_to(version_dir).parts
            key = rel[2] if len(rel) > 3 and rel[0] == "units" else "metadata"
            out[key] = out.get(key, 0) + f.stat().st_size
    out["total"] = sum(out.values())
    return out


def run_row(config: str, overrides: dict, precision: str, seed: int) -> dict:
    """One pipeline run (the stages `overrides` name, in this process, no Prefect) and its row of the table."""
    from dflash_pipeline.config import load_config
    from dflash_pipeline.order import LocalRunner, run_pipeline
    from dflash_pipeline.storage.store import Store

    store = Path(overrides["store_path"])
    t0 = time.monotonic()
    runner = LocalRunner()
    summary = run_pipeline(load_config(config, overrides), runner)
    version = summary.current or summary.version or Store(store).current()
    sizes = store_bytes(store / version)
    st = Store(store)
    tokens = sum(st.unit_info(version, u).n_tokens for u in st.units(version))
    attrs = st.attrs(version)
    k, h = len(attrs["layer_ids"]), attrs["hidden_size"]
    states = sum(v for a, v in sizes.items() if a.startswith(("hidden", "last_hidden")))
    est = runner.results.get("estimate")
    return {
        "precision": precision,
        "seed": seed,
        "acceptance_length": summary.acceptance_length,
        "untrained_acceptance_length": summary.untrained_acceptance_length,
        "final_loss": summary.final_loss,
        "tokens": tokens,
        "raw_bf16_bytes_per_token": 2 * k * h,
        "states_bytes_per_token": states / tokens,
        "states_of_raw_bf16": states / tokens / (2 * k * h),
        "store_bytes_per_token": sizes["total"] / tokens,
        "store_bytes": sizes["total"],
        "planned_store_bytes": est.store_bytes if est else None,
        "bytes_by_array": sizes,
        "validation": summary.validation,
        "seconds": round(time.monotonic() - t0, 1),
    }


def summarize(rows: list[dict], precisions: list[str]) -> list[dict]:
    """Per precision (in `precisions` order, those with rows): acceptance over the seeds and the store's bytes."""
    table = []
    for precision in precisions:
        rs = [r for r in rows if r["precision"] == precision]
        if not rs:
            continue
        acc = [r["acceptance_length"] for r in rs]
        first = rs[0]
        table.append(
            {
                "precision": precision,
                "acceptance_mean": statistics.mean(acc),
                "acceptance_stdev": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                "acceptance_by_seed": acc,
                "seeds": [r["seed"] for r in rs],
                "states_bytes_per_token": first["states_bytes_per_token"],
                "states_of_raw_bf16": first["states_of_raw_bf16"],
                "store_bytes_per_token": first["store_bytes_per_token"],
                "planned_store_bytes": first["planned_store_bytes"],
                "store_bytes": first["store_bytes"],
            }
        )
    return table


def print_table(table: list[dict]) -> None:
    base = next((t for t in table if t["precision"] == "full"), None)
    print(
        "\n| precision | states bytes/token (of raw bf16) | store bytes/token | acceptance length (seeds) | vs bf16 |"
    )
    print("| --- | --- | --- | --- | --- |")
    for t in table:
        rel = f"{t['acceptance_mean'] / base['acceptance_mean'] - 1:+.1%}" if base else "-"
        print(
            f"| {t['precision']} | {t['states_bytes_per_token']:.1f} ({t['states_of_raw_bf16']:.3f}) | "
            f"{t['store_bytes_per_token']:.1f} | {t['acceptance_mean']:.3f} +- {t['acceptance_stdev']:.3f} "
            f"({', '.join(f'{a:.3f}' for a in t['acceptance_by_seed'])}) | {rel} |"
        )


def machine() -> str:
    return f"{platform.node()} ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def provenance() -> dict:
    """When, where and by which command a result file was written: the head of every table's JSON."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/precision_quality")
    ap.add_argument("--config", default="configs/embedded.yaml")
    ap.add_argument("--precisions", default="full,fp8,int8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    out = Path(args.out).absolute()
    precisions = args.precisions.split(",")
    rows = []
    for precision in precisions:
        store = out / f"store-{precision}"
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            overrides = {
                "output_dir": str(out),
                "store_path": str(store),
                "extract.store_dtype": "bfloat16",
                "extract.store_precision": precision,
                "extract.devices": "cpu",
                "extract.isolation": "thread",
                "train.seed": seed,
                "train.output_dir": str(out / f"drafter-{precision}-seed{seed}"),
            }
            if i or (store / "CURRENT").exists():  # the store is extracted and validated once per precision
                overrides["stages"] = ["train", "evaluate"]
            rows.append(run_row(args.config, overrides, precision, seed))
            print(json.dumps(rows[-1]), flush=True)

    table = summarize(rows, precisions)
    print_table(table)
    result = {
        **provenance(),
        "runs": rows,
        "summary": table,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
