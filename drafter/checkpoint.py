"""Training checkpoints (resume), the run's report files (loss curve PNG, metrics JSON), and the drafter
directory's lock.

A checkpoint is `<output_dir>/checkpoints/step-XXXXXXXX/` holding the drafter weights and the trainer
state (optimizer, scheduler, step, RNG states, loss history, architecture). It is written to a temp
directory and renamed, and only directories with a DONE marker count, so a kill while saving leaves
the previous checkpoint as the latest. Older checkpoints beyond `keep` are pruned after a save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.errors import ConfigError, PipelineError
from dflash_pipeline.fsmodes import as_made
from dflash_pipeline.storage.commit import exclusive_lock

DONE = "DONE"
METRICS, LOSS_CURVE = "metrics.json", "loss_curve.png"


@contextmanager
def drafter_dir_lock(out: Path) -> Iterator[None]:
    """One run at a time in a drafter directory, across train, retain and evaluate: two runs would interleave
    their checkpoints, and one's export would replace the other's while it is evaluated. A second run stops at
    once with an error naming the directory and the run that holds it."""
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(
        out / ".lock",
        f"pid {os.getpid()} on {socket.gethostname()}",
        lambda holder: PipelineError(
            f"drafter directory {out} is in use by another run ({holder}); wait for it to finish, "
            "or give this run another train.output_dir"
        ),
    ):
        yield


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step-") and (p / DONE).exists():
            out.append((int(p.name[5:]), p))
    return sorted(out)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    cks = list_checkpoints(output_dir)
    return cks[-1][1] if cks else None


def rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(
    output_dir: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler, state: dict[str, Any], keep: int
) -> Path:
    root = checkpoint_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    as_made(tmp)
    try:
        torch.save(model.state_dict(), tmp / "drafter.pt")
        if "data" in state:
            (tmp / DATA).write_text(json.dumps(state["data"], default=str))
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "rng": rng_state(),
                **state,
            },
            tmp / "trainer.pt",
        )
        (tmp / DONE).write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for _, old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler, spec_json: str) -> dict[str, Any]:
    """Restore in place; returns the trainer state. Refuses checkpoints of another architecture."""
    state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    if state.get("spec") != spec_json:
        raise ConfigError(
            f"{path} holds a drafter of another architecture or target layer set than this run "
            f"(saved: {state.get('spec')}; now: {spec_json}). Use a new train.output_dir, or delete "
            f"{path.parent} to start over"
        )
    model.load_state_dict(torch.load(path / "drafter.pt", map_location="cpu"))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state


# What a drafter directory's training reads: a checkpoint of another store version, store or target is another
# training (a new store version after a nightly run, another target), never one to resume; so is one of the same
# version before units of it were discarded as damaged and rebuilt (`repairs`: their number, storage/discard.py),
# since it may have read the damaged data (a damage check: such a drafter was reused as "finished").
DATA_KEYS = ("store", "store_version", "target", "repairs")
SUPERSEDED = "superseded"
DATA = "data.json"  # in each checkpoint: its training's DATA_KEYS


def recorded_data(output_dir: str | Path, checkpoint: Path) -> dict[str, Any] | None:
    """The data (DATA_KEYS) the training in `output_dir` that wrote `checkpoint` trained on: from the checkpoint's
    data.json (written since 2026-12-03), else from the directory's export (dflash_meta.json), else None."""
    from dflash_pipeline.drafter.export import read_meta

    try:
        return {"repairs": 0, **json.loads((checkpoint / DATA).read_text())}  # (recorded since 2026-12-06)
    except (OSError, ValueError):
        pass
    meta = read_meta(Path(output_dir) / "export")
    return {**{k: meta.get(k) for k in DATA_KEYS}, "repairs": meta.get("repairs", 0)} if meta else None


def supersede(output_dir: str | Path, old: dict[str, Any]) -> Path:
    """Move the directory's training (checkpoints, export, metrics, loss curve) aside, under
    superseded/<old store version>-<n>/, so a training on other data starts from step 0 and the old drafter is
    kept. Returns where it went."""
    out = Path(output_dir)
    base = out / SUPERSEDED
    n = 1
    while (dest := base / f"{old.get('store_version') or 'unknown'}-{n}").exists():
        n += 1
    dest.mkdir(parents=True)
    for name in (checkpoint_dir(out).name, "export", METRICS, LOSS_CURVE, "acceptance.png"):  # (evaluate.PLOT)
        if (out / name).exists():
            os.replace(out / name, dest / name)
    (dest / DATA).write_text(json.dumps(old, indent=1, default=str))
    return dest


def write_report(output_dir: str | Path, history: list[dict], metrics: dict[str, Any]) -> dict[str, str]:
    """loss_curve.png and metrics.json beside the checkpoints; returns their paths (plot: '' without history,
    when none is drawn). metrics.json records both paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpath, ppath = out / METRICS, out / LOSS_CURVE
    paths = {"metrics": str(mpath), "plot": str(ppath) if history else ""}
    tmp = mpath.with_suffix(".tmp")
    record = {**metrics, "metrics_path": paths["metrics"], "plot_path": paths["plot"], "history": history}
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, mpath)
    if history:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("weighted block loss")
        ax.set_title(f"DFlash drafter training ({metrics.get('tokens_per_s', 0):.0f} tokens/s)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(ppath, dpi=100)
        plt.close(fig)
    return paths


def finished_run(output_dir: str | Path, step: int, provenance: dict[str, Any]) -> dict[str, Any] | None:
    """metrics.json of a training that already finished at `step` and exported it, or None. Finished means: the
    export's dflash_meta.json records that step and the same provenance (train_config, store, store_version,
    target, repairs) as this run, and metrics.json records that step uninterrupted. A rerun of a finished run then
    trains nothing and keeps the export as it is (its evaluation stays reusable)."""
    from dflash_pipeline.drafter.export import CONFIG, WEIGHTS, read_meta

    out = Path(output_dir)
    export = out / "export"
    if not (export / CONFIG).is_file() or not (export / WEIGHTS).is_file():
        return None
    meta = {"repairs": 0, **read_meta(export)}  # (exports before 2026-12-06 record no repairs)
    if meta.get("steps") != step or any(meta.get(k) != v for k, v in provenance.items() if k != "repairs"):
        return None
    if provenance.get("repairs", 0) > meta["repairs"]:  # units repaired since (fewer: a deleted repair record)
        return None
    try:
        metrics = json.loads((out / METRICS).read_text())
    except (OSError, ValueError):
        return None
    if metrics.get("steps") != step or metrics.get("interrupted") or metrics.get("export_dir") != str(export):
        return None
    plot = out / LOSS_CURVE
    return {**metrics, "metrics_path": str(out / METRICS), "plot_path": str(plot) if plot.is_file() else ""}
