"""Every store precision's quality cost on the real-text target (issue 29 item 2): bytes per token, reconstruction
error per layer (overall and on the channels with the largest activations), and the trained drafter's acceptance
length over seeds, all runs with the same steps.

It shares the real-text pipeline's work directory (its regenerated and prepared data) and its validated store as
the `full` one; each compact precision gets its own store, each (precision, seed) its own drafter. On one GPU
bench/realtext/chain.sh runs one process per store and then one per (seed, precision), side by side: a drafter
this small leaves the GPU mostly idle, and each process takes its own DFLASH_LOCK_DIR so the runs'
one-run-per-GPU locks let them share it.

    python bench/realtext/precision.py stores --config configs/realtext.yaml --out runs/realtext/precision
    python bench/realtext/precision.py train --config configs/realtext.yaml --out runs/realtext/precision --seed 0
    python bench/realtext/precision.py report --out runs/realtext/precision      # the table, precision.json

`train` runs the precisions in an order rotated by the seed and starts no run that `--until` (a Unix time) would
cut: a late chain loses a different precision per seed, not one precision in every seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from precision_quality import print_table, provenance, run_row, summarize  # noqa: E402

PRECISIONS = ("full", "fp8", "int8", "int4")


def full_store(config: str, sets: list[str]) -> Path:
    """The main pipeline's store (validated by its own run): the `full` precision of the table."""
    from dflash_pipeline import stages
    from dflash_pipeline.config import load_config

    return Path(stages.resolve_paths(load_config(config, sets)).store)


def overrides_for(args, precision: str, extra: dict) -> dict:
    """The user's --set, then this precision's store (the main run's for `full`) in the main run's work directory
    (its regenerated and prepared data are reused), then `extra`."""
    from dflash_pipeline import stages
    from dflash_pipeline.config import load_config, parse_override

    cfg = stages.resolve_paths(load_config(args.config, args.set))
    store = cfg.store if precision == "full" else args.out / f"store-{precision}"
    return (
        dict(map(parse_override, args.set))
        | {"output_dir": str(cfg.output_dir), "store_path": str(store), "extract.store_precision": precision}
        | extra
    )


def layer_errors(full: Path, compact: Path, samples: int, top: int) -> list[dict]:
    """Per captured layer over the first `samples` samples (sorted ids): relative L2 error of the compact store's
    dequantized rows against the full store's, overall and on the `top` channels of the largest magnitude (in the
    full store's rows; the massive-activation channels of a trained LLM would be these), the worst token's
    relative error, and the largest channel's magnitude over the median (whether there are massive activations)."""
    from dflash_pipeline.storage.reader import HiddenStateDataset

    with HiddenStateDataset(full) as a, HiddenStateDataset(compact) as b:
        ids = sorted(s.sample_id for s in a.samples)[:samples]
        xs = [a[a.index_of(i)]["hidden"].float() for i in ids]
        ys = [b[b.index_of(i)]["hidden"].float() for i in ids]
    x, y = torch.cat(xs), torch.cat(ys)  # [N, K, H]
    out = []
    for k in range(x.shape[1]):
        xk, ek = x[:, k], (y[:, k] - x[:, k])
        mag = xk.abs()
        chan = mag.amax(dim=0).topk(top).indices
        tok_err = ek.norm(dim=1) / xk.norm(dim=1).clamp_min(1e-12)
        out.append(
            {
                "layer": k,
                "rel_l2": float(ek.norm() / xk.norm()),
                "rel_l2_top_channels": float(ek[:, chan].norm() / xk[:, chan].norm()),
                "worst_token_rel_l2": float(tok_err.max()),
                "top1_over_median": float(mag.max() / mag.flatten().median().clamp_min(1e-12)),
                "tokens": x.shape[0],
            }
        )
    return out


def cmd_stores(args) -> int:
    """Extract and validate every compact precision's store, then measure its error against the full store."""
    full = full_store(args.config, args.set)
    errors = {}
    for precision in args.precisions:
        if precision == "full":
            continue
        t0 = time.monotonic()
        overrides = overrides_for(args, precision, {"stages": ["probe", "extract", "validate"]})
        row = run_row(args.config, overrides, precision, -1)
        errors[precision] = {
            "store": row,
            "layers": layer_errors(full, Path(overrides["store_path"]), args.error_samples, args.top_channels),
        }
        print(
            f"{precision}: store and errors in {time.monotonic() - t0:.0f} s; "
            f"states {row['states_bytes_per_token']:.1f} bytes/token ({row['states_of_raw_bf16']:.3f} of raw bf16), "
            f"store {row['store_bytes_per_token']:.1f}",
            flush=True,
        )
        for e in errors[precision]["layers"]:
            print(f"  layer {e['layer']}: rel L2 {e['rel_l2']:.4f}, top channels {e['rel_l2_top_channels']:.4f}")
    # one file per invocation's precisions: the chain runs one `stores` process per precision side by side
    (args.out / f"errors-{'-'.join(errors)}.json").write_text(json.dumps(errors, indent=1))
    return 0


def cmd_train(args) -> int:
    """One seed: a drafter per precision, `--steps` steps each, evaluated on `evaluate.num_prompts` prompts."""
    # one file per process (the chain may run one per (seed, precision) side by side)
    rows_path = args.out / f"runs-seed{args.seed}-{'-'.join(args.precisions)}.jsonl"
    order = list(args.precisions[args.seed % len(args.precisions) :]) + list(
        args.precisions[: args.seed % len(args.precisions)]
    )
    last = None
    for precision in order:
        if last is not None and args.until and time.time() + last > args.until:
            print(f"seed {args.seed}: no time left for {precision} (a run takes ~{last:.0f} s)", flush=True)
            continue
        t0 = time.monotonic()
        overrides = overrides_for(
            args,
            precision,
            {
                "stages": ["train", "evaluate"],
                "train.seed": args.seed,
                "train.max_steps": args.steps,
                "train.output_dir": str(args.out / f"drafter-{precision}-seed{args.seed}"),
            },
        )
        row = run_row(args.config, overrides, precision, args.seed)
        row["steps"] = args.steps
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        last = time.monotonic() - t0
        print(f"seed {args.seed} {precision}: tau {row['acceptance_length']} in {last:.0f} s", flush=True)
    return 0


def paired_differences(rows: list[dict], precisions: list[str]) -> list[dict]:
    """Each compact precision's acceptance minus full's of the same seed: the same initialization and data order,
    so the seed's own luck cancels and what is left is the precision's effect."""
    full = {r["seed"]: r["acceptance_length"] for r in rows if r["precision"] == "full"}
    out = []
    for precision in precisions:
        if precision == "full":
            continue
        pairs = [
            (r["seed"], r["acceptance_length"] - full[r["seed"]])
            for r in rows
            if r["precision"] == precision and r["seed"] in full
        ]
        if not pairs:
            continue
        diffs = [d for _, d in sorted(pairs)]
        base = statistics.mean(full[s] for s, _ in pairs)
        out.append(
            {
                "precision": precision,
                "seeds": sorted(s for s, _ in pairs),
                "differences": diffs,
                "mean": statistics.mean(diffs),
                "relative": statistics.mean(diffs) / base,
            }
        )
    return out


def cmd_report(args) -> int:
    rows = [json.loads(line) for p in sorted(args.out.glob("runs-seed*.jsonl")) for line in p.read_text().splitlines()]
    errors = {}
    for path in sorted(args.out.glob("errors*.json")):
        errors |= json.loads(path.read_text())
    table = summarize(rows, list(args.precisions))
    print_table(table)
    paired = paired_differences(rows, list(args.precisions))
    if paired:
        print("\n| precision | tau minus full's, same seed (paired) | mean | seeds |")
        print("| --- | --- | --- | --- |")
        for d in paired:
            diffs = ", ".join(f"{x:+.3f}" for x in d["differences"])
            print(f"| {d['precision']} | {diffs} | {d['mean']:+.3f} ({d['relative']:+.1%}) | {d['seeds']} |")
    print("\n| precision | layer | rel L2 | on the top channels | worst token | top1/median |")
    print("| --- | --- | --- | --- | --- | --- |")
    for precision, e in errors.items():
        for r in e["layers"]:
            print(
                f"| {precision} | {r['layer']} | {r['rel_l2']:.4f} | {r['rel_l2_top_channels']:.4f} | "
                f"{r['worst_token_rel_l2']:.4f} | {r['top1_over_median']:.1f} |"
            )
    result = {
        **provenance(),
        "summary": table,
        "paired_vs_full": paired,
        "errors": errors,
        "runs": rows,
    }
    (args.out / "precision.json").write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["stores", "train", "report"])
    ap.add_argument("--config", default="configs/realtext.yaml")
    ap.add_argument("--set", action="append", default=[], help="dotted override, as the CLI's --set")
    ap.add_argument("--out", type=Path, default=Path("runs/realtext/precision"))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--until", type=float, default=None, help="Unix time: start no run that would end after it")
    ap.add_argument("--error-samples", type=int, default=64)
    ap.add_argument("--top-channels", type=int, default=8)
    args = ap.parse_args(argv)
    args.out = args.out.absolute()
    args.out.mkdir(parents=True, exist_ok=True)
    args.precisions = tuple(args.precisions.split(","))
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"stores": cmd_stores, "train": cmd_train, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
