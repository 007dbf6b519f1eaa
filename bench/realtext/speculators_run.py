"""speculators' DFlash trainer beside ours on the real-text benchmark (issue 48 item 2): the same validated store (the
real-text pipeline's, extracted with layers.capture_last=true), as many samples as the levers' baseline trains
(levers.py: --steps x batch 1), its own defaults otherwise, seeds side by side on one GPU; each result converted to our
export format (drafter/import_speculators.py) and scored on the same held-out prompts as the levers' rows, by our
decoder and z-lab's (evaluate.decoder=both). Rows go where levers.py keeps its own (variant "speculators"), so
`levers.py report` shows them beside ours. bench/realtext/chain.sh runs it with RT_SPECULATORS=1.

    python bench/realtext/speculators_run.py prepare --steps 2000             # export-states + the samples' view
    python bench/realtext/speculators_run.py seed --seed 0 --steps 2000       # train, convert, score: one row
    python bench/realtext/speculators_run.py trainer [speculators train flags]  # speculators' trainer as it is

Equal samples: speculators trains epochs over its dataset (`--max-steps` counts packed batches, and a finished epoch
still runs one more batch per later epoch), so `prepare` writes a view of the export that holds exactly the samples
our baseline trains (samples i mod N for i < steps, N = the store's samples: our trainer's epochs and a fraction),
trained for one epoch, plus a few of the store's samples as speculators' validation split (its train/val boundary
is a ratio: the view sets it to fall right after the training rows). Rows are links to the export's files.

`trainer` is speculators' `python -m speculators.train` (TrainConfig.resolve + cli.main). Its trainer assumes an
accelerator in two places: it moves the model and every batch to `get_local_rank()` (an int, so `cuda:0`), and its
step timer calls `torch.accelerator.synchronize()`. Without CUDA (a CPU rehearsal) this patches both (device `cpu`,
no synchronize) and adds what CPU needs unless given: `--draft-attn-impl sdpa` (its default, flex attention, builds
its masks with torch.compile), `--loss-implementation eager` (its fused loss is a Triton kernel),
`--hidden-states-dtype float32` (autocast is off on CPU, so bf16 states would meet float32 weights), `--num-workers 0`.
With CUDA nothing is patched or added.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANT = "speculators"
EXPORT, VIEW_INFO = "speculators-export", "view.json"
CPU_DEFAULTS = {
    "--draft-attn-impl": "sdpa",
    "--loss-implementation": "eager",
    "--hidden-states-dtype": "float32",
    "--num-workers": "0",
}


def cmd_trainer(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        import speculators.train.trainer as trainer

        trainer.get_local_rank = lambda: "cpu"  # model.to(...) and batch .to(...): not cuda:0
        if torch.accelerator.current_accelerator() is None:
            torch.accelerator.synchronize = lambda *_a, **_k: None  # its step timer's
        argv = list(argv) + [x for flag, v in CPU_DEFAULTS.items() if flag not in argv for x in (flag, v)]
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(argv))
    return 0


def _samples(args) -> int:
    from levers import samples_per_step

    from dflash_pipeline.config import parse_override

    return args.steps * samples_per_step({}, dict(map(parse_override, args.set)))


def build_view(export: Path, samples: int, view: Path) -> dict:
    """`view`: `samples` training rows (export row i mod N) then the validation rows (the export's last
    max(1, min(64, N // 10))), each row's file a link to the export's; reused when built for the same export."""
    import datasets

    record = json.loads((export / "dflash_export.json").read_text())
    info_path = view / VIEW_INFO
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("version_state") == record["version_state"] and info.get("samples") == samples:
            return info
        shutil.rmtree(view)
    src = datasets.load_from_disk(str(export))
    n = len(src)
    n_val = max(1, min(64, n // 10))
    rows = [i % n for i in range(samples)] + list(range(n - n_val, n))
    tmp = view.with_name(view.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    src.select(rows).save_to_disk(str(tmp))
    (tmp / "hidden_states").mkdir()
    for j, i in enumerate(rows):
        os.symlink(
            (export / "hidden_states" / f"hs_{i}.safetensors").resolve(), tmp / "hidden_states" / f"hs_{j}.safetensors"
        )
    lengths = list(src.with_format(None)["seq_len"])
    info = {
        "export": str(export),
        "version_state": record["version_state"],
        "store": record["store"],
        "version": record["version"],
        "model_path": record["model_path"],
        "target_layer_ids": record["speculators_target_layer_ids"],
        "store_samples": n,
        "samples": samples,
        "epochs_of_store": samples / n,
        "val_rows": n_val,
        "rows": len(rows),
        "train_data_ratio": (samples + 0.5) / len(rows),  # int(rows * ratio) == samples: the split after them
        "train_tokens": sum(lengths[i] for i in rows[:samples]),
    }
    (tmp / VIEW_INFO).write_text(json.dumps(info, indent=1))
    os.replace(tmp, view)
    return info


def cmd_prepare(args) -> int:
    from precision import full_store

    from dflash_pipeline.storage.export_states import export_states

    store = full_store(args.config, args.set)
    t0 = time.monotonic()
    export_states(store, args.out / EXPORT)
    info = build_view(args.out / EXPORT, _samples(args), args.out / f"speculators-view-{_samples(args)}")
    print(
        f"speculators data: {info['samples']} training samples ({info['epochs_of_store']:.3f} epochs of "
        f"{info['store_samples']}), {info['val_rows']} validation, {info['train_tokens']} tokens; target layers "
        f"{info['target_layer_ids']} (speculators' numbering); {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return 0


def trainer_command(info: dict, view: Path, save: Path, seed: int, extra: list[str]) -> list[str]:
    """speculators' DFlash trainer with its own defaults: only the data, its layers, one epoch of the view (the
    samples our baseline trains), the seed and where it writes are set."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "trainer", "--speculator-type", "dflash"]
    cmd += ["--verifier-name-or-path", info["model_path"], "--data-path", str(view)]
    cmd += ["--hidden-states-backend", "file", "--on-missing", "raise"]
    cmd += ["--target-layer-ids", *map(str, info["target_layer_ids"])]
    cmd += ["--epochs", "1", "--train-data-ratio", repr(info["train_data_ratio"]), "--seed", str(seed)]
    cmd += ["--save-path", str(save), "--log-dir", str(save / "logs")]
    return cmd + extra


def _tokens_per_s(log: str) -> float | None:
    """Median of its per-step `profile/tokens_per_s` (the first 3 steps, compilation, left out)."""
    values = [float(v) for v in re.findall(r"profile/tokens_per_s=([0-9.eE+-]+)", log)]
    values = values[3:] or values
    return statistics.median(values) if values else None


def cmd_seed(args) -> int:
    from precision import overrides_for
    from precision_quality import run_row

    from dflash_pipeline.drafter.export import read_meta
    from dflash_pipeline.drafter.import_speculators import import_speculators

    samples = _samples(args)
    rows = args.out / f"runs-seed{args.seed}-{VARIANT}.jsonl"
    if rows.is_file() and any(json.loads(line).get("samples") == samples for line in rows.read_text().splitlines()):
        print(f"seed {args.seed} {VARIANT}: {rows} has its row already (delete it to train again)", flush=True)
        return 0
    view = args.out / f"speculators-view-{samples}"
    info = json.loads((view / VIEW_INFO).read_text())  # `prepare` first
    save = args.out / f"speculators-seed{args.seed}"
    drafter = args.out / f"drafter-{VARIANT}-seed{args.seed}"
    save.mkdir(parents=True, exist_ok=True)
    cmd = trainer_command(info, view, save, args.seed, args.spec_args.split())
    t0 = time.monotonic()
    with (save / "train_log.txt").open("a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        print(f"seed {args.seed}: speculators' trainer exited {rc}: {save / 'train_log.txt'}", flush=True)
        return rc
    state = json.loads((save / "0" / "training_state.json").read_text()) if (save / "0").is_dir() else {}
    import_speculators(save, drafter / "export", target=info["model_path"])
    t1 = time.monotonic()
    extra = {
        "stages": ["evaluate"],
        "regenerate.enabled": False,
        "train.output_dir": str(drafter),
        "evaluate.decoder": args.decoder,
    }
    row = run_row(args.config, overrides_for(args, "full", extra), "full", args.seed)
    acceptance = read_meta(drafter / "export").get("acceptance") or {}
    row |= {
        "variant": VARIANT,
        "change": {"trainer": "speculators 0.9.0, its DFlash defaults", "flags": cmd[cmd.index("trainer") + 1 :]},
        "steps": state.get("global_step"),
        "samples": samples,
        "train_tokens": info["train_tokens"],
        "wall_s_contended": round(wall, 1),
        "train_elapsed_s": round(wall, 1),
        "train_tokens_per_s": info["train_tokens"] / wall,
        "train_tokens_per_s_steps": _tokens_per_s((save / "train_log.txt").read_text()),
        "evaluate_s": round(time.monotonic() - t1, 1),
        "reference_acceptance_length": acceptance.get("reference_acceptance_length"),
        "decoder_agreement": acceptance.get("decoder_agreement"),
    }
    with rows.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(
        f"seed {args.seed} {VARIANT}: tau {row['acceptance_length']} (reference decoder "
        f"{row['reference_acceptance_length']}) after {samples} samples, {row['steps']} of its steps, "
        f"{wall / 60:.1f} min",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trainer"]:
        return cmd_trainer(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["prepare", "seed", "trainer"])
    ap.add_argument("--config", default="configs/realtext.yaml")
    ap.add_argument("--set", action="append", default=[], help="dotted override, as the CLI's --set")
    ap.add_argument("--out", type=Path, default=Path("runs/realtext/levers"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2000, help="steps of our baseline (batch 1): the samples to train")
    ap.add_argument("--decoder", default="both", choices=["ours", "reference", "both"], help="evaluate.decoder")
    ap.add_argument("--spec-args", default="", help="more flags for speculators' trainer (its defaults otherwise)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return {"prepare": cmd_prepare, "seed": cmd_seed}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
