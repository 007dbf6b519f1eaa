"""The pipeline on the real-text target, on one GPU, inside one device call: `order.run_pipeline(cfg, runner)` (the
order and the stage code of the CLI, without Prefect, which the GPU machine lacks) with a runner that
- times every stage (wall seconds; GPU-hours = wall x GPUs / 3600),
- bounds the drafter's training by wall clock: at the deadline it sends itself SIGTERM, so the training saves a
  checkpoint at the next step boundary (the pipeline's own stop), then exports that checkpoint (train again with
  max_steps = the steps done: the loop has nothing left to do and exports); a later run resumes from it,
- evaluates with the evaluate stage itself (drafter/evaluate.py: the trained drafter, the untrained baseline cached
  per (target, prompts, settings), per draft position and per `evaluate.slice_by` slice, acceptance.png and
  dflash_meta.json beside the export).

    python bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s 540      # first run
    python bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s 540 --stages probe,train,evaluate
    python bench/realtext/pipeline.py --config configs/realtext.yaml --train-minutes 10.5   # train by duration
    python bench/realtext/pipeline.py --config configs/realtext.yaml --set target.model_path=/tmp/rt/target ...

Writes <work>/pipeline_report.json (and prints a summary). Deadlines count from this script's start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:.0f}s] {msg}", flush=True)


STAGES = ("probe", "regenerate", "prepare", "estimate", "plan", "extract", "validate", "train", "evaluate", "retain")


def make_runner(args, timings: dict, extra: dict):
    from dflash_pipeline import order, stages

    class Runner(order.LocalRunner):
        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            if name in STAGES:

                def timed(*a, **kw):
                    t = time.monotonic()
                    log(f"stage {name} ...")
                    try:
                        return attr(*a, **kw)
                    finally:
                        timings[name] = timings.get(name, 0.0) + time.monotonic() - t
                        log(f"stage {name}: {timings[name]:.1f} s")

                return timed
            return attr

        def train(self, cfg, report, version):
            deadline = T0 + args.train_until_s
            if args.train_minutes:
                deadline = time.monotonic() + 60 * args.train_minutes
            sent = []

            def progress(step, total, loss, tps):
                if step % 100 == 0:
                    log(f"train step {step}/{total} loss {loss:.3f} {tps:.0f} tokens/s")
                if time.monotonic() > deadline and not sent:
                    sent.append(step)
                    os.kill(os.getpid(), signal.SIGTERM)  # the pipeline's stop: checkpoint at the step boundary

            res = stages.train(cfg, report, version, progress=progress)
            extra["train_run"] = {k: v for k, v in res.to_dict().items() if k != "history"}
            extra["train_history_tail"] = res.history[-5:]
            if res.interrupted:  # export the checkpoint just saved: nothing left to train at max_steps = steps
                log(f"training stopped at step {res.steps} of {res.total_steps} (deadline); exporting it")
                done = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": res.steps})})
                res2 = stages.train(done, report, version)
                res.export_dir = res2.export_dir
            return self._keep("train", res)

    return Runner()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/realtext.yaml")
    ap.add_argument("--set", action="append", default=[], help="dotted override, as the CLI's --set")
    ap.add_argument("--stages", default=None, help="comma list (default: the config's)")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="everything ends by then (from start)")
    ap.add_argument("--eval-reserve-s", type=float, default=150.0, help="time kept for evaluation after training")
    ap.add_argument("--train-minutes", type=float, default=None, help="train at most this long (else by deadline)")
    ap.add_argument("--report", type=Path, default=None, help="default: <output_dir>/pipeline_report.json")
    args = ap.parse_args(argv)
    args.train_until_s = args.deadline_s - args.eval_reserve_s
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from dflash_pipeline import order, stages
    from dflash_pipeline.config import load_config

    overrides = list(args.set) + ([f"stages=[{args.stages}]"] if args.stages else [])
    cfg = stages.resolve_paths(load_config(args.config, overrides))
    work = Path(cfg.output_dir)
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    extra: dict = {}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    runner = make_runner(args, timings, extra)
    summary = order.run_pipeline(cfg, runner)
    total = time.monotonic() - T0
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name(0) if gpus else "cpu",
        "argv": sys.argv[1:],
        "stages": cfg.stages,
        "timings_s": timings,
        "gpu_hours": {k: v * max(gpus, 1) / 3600 for k, v in timings.items()} if gpus else {},
        "total_s": total,
        "summary": summary.to_dict(),
        **extra,
        "acceptance": asdict(runner.results["evaluate"]) if "evaluate" in runner.results else None,
    }
    out = args.report or work / "pipeline_report.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    # the plan's rates (core/rates.json, core/cost.py): this run's stages, also beside the report
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import rates  # noqa: E402 - bench/rates.py

    rates.record_file(
        out, "python bench/realtext/pipeline.py " + " ".join(sys.argv[1:]), copy_to=out.with_name("rates.json")
    )
    log(f"stage times (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    acc = runner.results.get("evaluate")
    if acc:
        log(
            f"tau trained {acc.acceptance_length:.3f} ({acc.num_prompts} prompts), untrained "
            f"{acc.untrained_acceptance_length}"
        )
        log("position rates trained: " + " ".join(f"{r:.2f}" for r in acc.position_accept_rate))
        log(f"slices: {json.dumps(acc.slices)[:2000]}; plot {acc.plot_path}")
    log(f"report: {out} ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
