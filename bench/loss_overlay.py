"""Overlay the loss curves of train_bench.py runs (issue 30: the optimized step's curve against today's).

    python bench/loss_overlay.py RUN.json[:LABEL] ... --out loss_overlay.png [--per samples|steps]

Every variant of every train_bench.json is one curve, its loss against the samples it has trained on (step x
batch_size x grad_accum: a packed step of four samples and a padded batch of four are the same step, batch 1 takes
four steps for them), smoothed over `--smooth` points. Prints, for each pair of curves, the mean and largest
absolute difference of their losses at the sample counts both reached (same seed and data order: the bench's
runs read the same samples in the same order whatever the batch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curves(paths: list[str], per: str) -> dict[str, tuple[list[float], list[float]]]:
    out = {}
    for spec in paths:
        path, _, label = spec.partition(":")
        for v in json.loads(Path(path).read_text())["variants"]:
            if "loss_by_step" not in v:
                continue  # a variant that failed (its error is in the same file)
            o = v["overrides"]
            per_step = o.get("batch_size", 1) * o.get("grad_accum", 1) if per == "samples" else 1
            losses = v["loss_by_step"]
            name = f"{label or Path(path).parent.name}: {v['variant']}"
            out[name] = ([per_step * (i + 1) for i in range(len(losses))], losses)
    return out


def smooth(y: list[float], n: int) -> list[float]:
    acc, out = 0.0, []
    for i, v in enumerate(y):
        acc += v - (y[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def at(x: list[float], y: list[float], xs: list[float]) -> list[float]:
    """y at each of xs (ascending, within x's range), the last point of x at or before it."""
    out, j = [], 0
    for q in xs:
        while j + 1 < len(x) and x[j + 1] <= q:
            j += 1
        out.append(y[j])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="train_bench.json files, each optionally :LABEL")
    p.add_argument("--out", default="loss_overlay.png")
    p.add_argument("--per", choices=["samples", "steps"], default="samples")
    p.add_argument("--smooth", type=int, default=8, help="running mean over this many points (1: raw)")
    args = p.parse_args()
    cs = {k: (x, smooth(y, args.smooth)) for k, (x, y) in curves(args.runs, args.per).items()}
    if not cs:
        raise SystemExit(f"no variant with a loss curve in {args.runs}")
    names = list(cs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (xa, ya), (xb, yb) = cs[a], cs[b]
            grid = sorted({q for q in xa + xb if max(xa[0], xb[0]) <= q <= min(xa[-1], xb[-1])})
            if not grid:
                continue
            d = [abs(u - v) for u, v in zip(at(xa, ya, grid), at(xb, yb, grid), strict=True)]
            span = f"{grid[0]}-{grid[-1]} {args.per}"
            print(f"{a} | {b}: mean |diff| {sum(d) / len(d):.4f}, max {max(d):.4f} over {span}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (x, y) in cs.items():
        ax.plot(x, y, lw=1, label=name)
    ax.set(xlabel=f"{args.per} trained", ylabel=f"loss (running mean of {args.smooth})", title="drafter loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
