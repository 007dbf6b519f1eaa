"""The recipe's levers one at a time on the real-text target (issue 48 item 3): each variant is today's defaults
with one change, trained for the same steps from the same validated store (the real-text pipeline's), over seeds,
and scored on the same held-out prompts. Runs are compared by samples trained, never by wall time: the chain runs
several side by side on one GPU (a drafter this small leaves it mostly idle), so their wall times are contended.

    python bench/realtext/levers.py train --variants baseline,dpace --seed 0 --steps 2000   # one process per seed
    python bench/realtext/levers.py report                                                   # the table, levers.json

A variant's acceptance is reported with its seed spread and paired with the baseline of the same seed (the same
initialization and data order): a lever is adopted only when it wins outside the spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from precision import overrides_for  # noqa: E402
from precision_quality import provenance, run_row  # noqa: E402

# One change each from today's defaults (drafter/config.py TrainConfig); `baseline` is the defaults themselves.
VARIANTS: dict[str, dict] = {
    "baseline": {},
    "distill": {"train.distill": True},
    "dpace": {"train.position_weight": "dpace"},
    "anchors1024": {"train.anchors_per_sample": 1024},
    "anchors2048": {"train.anchors_per_sample": 2048},
    "sliding2048": {"train.sliding_window": 2048},  # every draft layer (sliding_layers None), causal in a block
    "pack4": {"train.pack": True, "train.batch_size": 4},
    "muon": {"train.optimizer": "muon", "train.muon_lr": 0.02},
    "lr3e-4": {"train.lr": 3e-4},
    "lr1.2e-3": {"train.lr": 1.2e-3},
}


def samples_per_step(overrides: dict, sets: dict) -> int:
    """Samples one optimizer step trains on: batch_size x grad_accum (packing lays the same samples in one row)."""
    merged = sets | overrides
    return int(merged.get("train.batch_size", 1)) * int(merged.get("train.grad_accum", 1))


def cmd_train(args) -> int:
    """One seed: a drafter per variant. Each variant trains the same number of samples: a variant that takes
    more samples a step (pack4) takes proportionally fewer steps."""
    from dflash_pipeline.config import parse_override

    sets = dict(map(parse_override, args.set))
    rows_path = args.out / f"runs-seed{args.seed}-{'-'.join(args.variants)}.jsonl"
    samples = args.steps * samples_per_step({}, sets)
    for name in args.variants:
        change = VARIANTS[name]
        steps = max(1, samples // samples_per_step(change, sets))
        t0 = time.monotonic()
        extra = {
            "stages": ["train", "evaluate"],
            "train.seed": args.seed,
            "train.max_steps": steps,
            "train.output_dir": str(args.out / f"drafter-{name}-seed{args.seed}"),
            **change,
        }
        row = run_row(args.config, overrides_for(args, "full", extra), "full", args.seed)
        row |= {"variant": name, "change": change, "steps": steps, "samples": steps * samples_per_step(change, sets)}
        row["wall_s_contended"] = round(time.monotonic() - t0, 1)
        row |= trainer_figures(args.out / f"drafter-{name}-seed{args.seed}")
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"seed {args.seed} {name}: tau {row['acceptance_length']} after {row['samples']} samples", flush=True)
    return 0


def trainer_figures(drafter: Path) -> dict:
    """The training's wall seconds and tokens/s (its metrics.json) and the reference decoder's acceptance (the
    export's dflash_meta.json, with evaluate.decoder=both), as speculators_run.py's rows have them."""
    try:
        metrics = json.loads((drafter / "metrics.json").read_text())
        acceptance = json.loads((drafter / "export" / "dflash_meta.json").read_text()).get("acceptance") or {}
    except (OSError, ValueError):
        return {}
    return {
        "train_elapsed_s": metrics.get("elapsed_s"),
        "train_tokens_per_s": metrics.get("tokens_per_s"),
        "reference_acceptance_length": acceptance.get("reference_acceptance_length"),
        "decoder_agreement": acceptance.get("decoder_agreement"),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per variant: acceptance over seeds (mean, min, max), and its paired difference from the baseline. Variants
    not in VARIANTS (speculators_run.py's `speculators`: another trainer) follow them."""
    base = {r["seed"]: r["acceptance_length"] for r in rows if r["variant"] == "baseline"}
    table = []
    for name in [*VARIANTS, *sorted({r["variant"] for r in rows} - set(VARIANTS))]:
        mine = sorted((r for r in rows if r["variant"] == name), key=lambda r: r["seed"])
        if not mine:
            continue
        taus = [r["acceptance_length"] for r in mine]
        diffs = [r["acceptance_length"] - base[r["seed"]] for r in mine if r["seed"] in base]
        entry = {
            "variant": name,
            "seeds": [r["seed"] for r in mine],
            "tau_mean": statistics.mean(taus),
            "tau_min": min(taus),
            "tau_max": max(taus),
            "samples": mine[0]["samples"],
            "paired_vs_baseline": diffs,
        }
        # outside the spread: every seed's paired difference has the same sign, and the means' gap exceeds both
        # variants' seed ranges
        if diffs and name != "baseline" and base:
            b = list(base.values())
            entry["wins"] = all(d > 0 for d in diffs) and min(taus) > max(b)
        reference = [r.get("reference_acceptance_length") for r in mine if r.get("reference_acceptance_length")]
        if reference:
            entry["reference_tau_mean"] = statistics.mean(reference)
            entry["reference_tau_min"], entry["reference_tau_max"] = min(reference), max(reference)
        # tokens/s while training: ours over its training loop (metrics.json); speculators' the median of its per-step
        # figure (its wall time also holds start-up, compilation and a validation pass)
        rates = [r.get("train_tokens_per_s_steps") or r.get("train_tokens_per_s") for r in mine]
        walls = [r["train_elapsed_s"] for r in mine if r.get("train_elapsed_s")]
        if walls:
            entry["train_elapsed_s_mean"] = statistics.mean(walls)
        if all(rates) and rates:
            entry["train_tokens_per_s_mean"] = statistics.mean(rates)
        table.append(entry)
    return table


def cmd_report(args) -> int:
    rows = [json.loads(line) for p in sorted(args.out.glob("runs-seed*.jsonl")) for line in p.read_text().splitlines()]
    table = summarize(rows)
    print(
        "| variant | tau mean | min | max | samples | paired vs baseline | wins outside the spread | reference decoder "
        "tau (min-max) | train min | train tokens/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in table:
        diffs = ", ".join(f"{d:+.3f}" for d in t["paired_vs_baseline"])
        ref = (
            f"{t['reference_tau_mean']:.3f} ({t['reference_tau_min']:.3f}-{t['reference_tau_max']:.3f})"
            if "reference_tau_mean" in t
            else "-"
        )
        minutes = f"{t['train_elapsed_s_mean'] / 60:.1f}" if "train_elapsed_s_mean" in t else "-"
        rate = f"{t['train_tokens_per_s_mean']:.0f}" if "train_tokens_per_s_mean" in t else "-"
        print(
            f"| {t['variant']} | {t['tau_mean']:.3f} | {t['tau_min']:.3f} | {t['tau_max']:.3f} | {t['samples']} | "
            f"{diffs} | {t.get('wins', '-')} | {ref} | {minutes} | {rate} |"
        )
    result = {
        **provenance(),
        "summary": table,
        "runs": rows,
    }
    (args.out / "levers.json").write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["train", "report"])
    ap.add_argument("--config", default="configs/realtext.yaml")
    ap.add_argument("--set", action="append", default=[], help="dotted override, as the CLI's --set")
    ap.add_argument("--out", type=Path, default=Path("runs/realtext/levers"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2000, help="steps of the baseline; others train as many samples")
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    return {"train": cmd_train, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
