"""The acceptance plot beside an export (acceptance.png): what drafter/evaluate.py measured, drawn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_pipeline.drafter.evaluate import AcceptanceReport


def plot_acceptance(rep: AcceptanceReport, path: str | Path) -> Path:
    """PNG: per row, acceptance rate by draft position (left) and tau (right, trained vs untrained), overall
    and then one row per evaluate.slice_by field with a line / a pair of bars per slice value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    overall = {
        "value": "all",
        "acceptance_length": rep.acceptance_length,
        "position_accept_rate": rep.position_accept_rate,
        "untrained_acceptance_length": rep.untrained_acceptance_length,
    }
    rows = [("all prompts", [overall])] + [(f"by {f}", entries) for f, entries in rep.slices.items()]
    ks = list(range(1, rep.block_size))
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 3.6 * len(rows)), squeeze=False)
    for (title, entries), (left, right) in zip(rows, axes, strict=True):
        for e in entries:
            n = e.get("num_prompts", rep.num_prompts)
            left.plot(ks, e["position_accept_rate"], marker="o", ms=3, lw=1.2, label=f"{e['value']} ({n} prompts)")
        if title == "all prompts" and rep.untrained_position_accept_rate is not None:
            left.plot(ks, rep.untrained_position_accept_rate, ls="--", color="grey", label="untrained")
        left.set(xlabel="draft position k", ylabel="share of steps accepting k", ylim=(0, 1.02), title=title)
        left.set_xticks(ks)
        left.grid(alpha=0.3)
        left.legend(fontsize=8)
        x = range(len(entries))
        right.bar([i - 0.2 for i in x], [e["acceptance_length"] for e in entries], 0.4, label="trained")
        base = [e.get("untrained_acceptance_length") for e in entries]
        if all(b is not None for b in base):
            right.bar([i + 0.2 for i in x], base, 0.4, color="grey", label="untrained")
        right.set_xticks(list(x), [e["value"] for e in entries], rotation=30 if len(entries) > 4 else 0)
        right.set_xlim(-0.8, len(entries) - 0.2)
        right.set(ylabel="acceptance length (tokens / step)", ylim=(0, rep.block_size), title=f"tau {title}")
        right.grid(alpha=0.3, axis="y")
        right.legend(fontsize=8)
    fig.suptitle(f"DFlash acceptance: tau {rep.acceptance_length:.2f} (block {rep.block_size}, greedy)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path
