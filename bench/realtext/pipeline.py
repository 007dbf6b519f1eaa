"""The pipeline on the real-text target, on one GPU, inside one device call: `stages.run_pipeline(cfg, runner)` (the
order and the stage code of the CLI, without Prefect, which the GPU machine lacks) with a runner that
- times every stage (wall seconds; GPU-hours = wall x GPUs / 3600),
- bounds the drafter's training by wall clock: at the deadline it sends itself SIGTERM, so the training saves a
  checkpoint at the next step boundary (the pipeline's own stop), then exports that checkpoint (train again with
  max_steps = the steps done: the loop has nothing left to do and exports); a later run resumes from it,
- evaluates by the stage's own code (drafter/evaluate.py) in chunks of prompts until its deadline, the trained
  drafter and, once per (target, prompts), an untrained one of the same architecture (cached in --work), each per
  draft position, and per `source` (package) of the held-out prompts.

    python bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s 540      # first run
    python bench/realtext/pipeline.py --config configs/realtext.yaml --deadline-s 540 --stages probe,train,evaluate
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
from pathlib import Path

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:.0f}s] {msg}", flush=True)


def merge(reports: list) -> dict:
    """One acceptance figure from reports on disjoint prompt chunks (weighted by verification steps)."""
    steps = sum(r.verify_steps for r in reports)
    tokens = sum(r.generated_tokens for r in reports)
    k = len(reports[0].position_accept_rate) if reports else 0
    rates = [sum(r.position_accept_rate[i] * r.verify_steps for r in reports) / max(steps, 1) for i in range(k)]
    per_prompt = [p for r in reports for p in r.per_prompt]
    return {
        "acceptance_length": tokens / max(steps, 1),
        "num_prompts": len(per_prompt),
        "verify_steps": steps,
        "generated_tokens": tokens,
        "position_accept_rate": rates,
        "per_prompt": per_prompt,
    }


def slices(result: dict, prompts: list[dict], field: str = "source") -> dict:
    by_id = {p.get("id"): p.get(field) for p in prompts}
    acc: dict[str, list[int]] = {}
    for p in result["per_prompt"]:
        s = acc.setdefault(str(by_id.get(p["id"])), [0, 0, 0])
        s[0] += 1
        s[1] += p["steps"]
        s[2] += round((p["acceptance_length"] or 0) * p["steps"])  # tokens produced by verification steps
    return {k: {"prompts": v[0], "steps": v[1], "tau": v[2] / max(v[1], 1)} for k, v in sorted(acc.items())}


def bounded_eval(drafter, target, tok, ecfg, prompts: list[dict], deadline: float, what: str, chunk: int = 2):
    from dflash_pipeline.drafter.evaluate import evaluate_acceptance

    reports, t = [], time.monotonic()
    for i in range(0, len(prompts), chunk):
        if time.monotonic() > deadline and reports:
            log(f"evaluate ({what}): deadline reached after {i} of {len(prompts)} prompts")
            break
        reports.append(evaluate_acceptance(drafter, target, tok, ecfg, prompts[i : i + chunk]))
    out = merge(reports)
    out["eval_s"] = time.monotonic() - t
    log(
        f"evaluate ({what}): tau {out['acceptance_length']:.3f} on {out['num_prompts']} prompts ({out['eval_s']:.0f} s)"
    )
    return out


def make_runner(args, work: Path, timings: dict, extra: dict):
    import torch

    from dflash_pipeline import stages

    class Runner(stages.LocalRunner):
        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            if name in ("probe", "regenerate", "prepare", "estimate", "plan", "extract", "validate", "train", "retain"):

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

        def evaluate(self, cfg, report, export_dir):
            from dflash_pipeline.drafter.evaluate import load_prompts
            from dflash_pipeline.drafter.export import load_drafter, update_meta
            from dflash_pipeline.drafter.model import DFlashDrafter
            from dflash_pipeline.extraction.loader import load_planned
            from dflash_pipeline.extraction.tokenizer import load_tokenizer

            t = time.monotonic()
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = torch.bfloat16 if dev == "cuda" else torch.float32
            target = load_planned(report, dev, str(dtype).removeprefix("torch."))
            tok = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
            drafter = load_drafter(export_dir, dev, dtype)
            prompts = load_prompts(cfg.evaluate)
            end = T0 + args.deadline_s
            cache = work / f"baseline_{len(prompts)}x{cfg.evaluate.max_new_tokens}.json"
            share = 0.4 if not cache.exists() else 1.0  # leave the baseline its part of the time
            trained = bounded_eval(
                drafter, target, tok, cfg.evaluate, prompts, t + (end - t) * share, "trained drafter"
            )
            if cache.exists():
                base = json.loads(cache.read_text())
                log(f"untrained baseline from {cache}: tau {base['acceptance_length']:.3f}")
            else:
                torch.manual_seed(0)
                fresh = DFlashDrafter(drafter.spec).to(device=dev, dtype=dtype).eval()
                base = bounded_eval(fresh, target, tok, cfg.evaluate, prompts, end, "untrained baseline")
                cache.write_text(json.dumps(base))
            ids = {p["id"] for p in base["per_prompt"]}
            same = [p for p in trained["per_prompt"] if p["id"] in ids]
            made = sum((p["acceptance_length"] or 0) * p["steps"] for p in same)
            trained["on_baseline_prompts_tau"] = made / max(sum(p["steps"] for p in same), 1)
            trained["slices"] = slices(trained, prompts)
            base["slices"] = slices(base, prompts)
            update_meta(export_dir, acceptance={**trained, "untrained": base})
            extra["acceptance"] = {"trained": trained, "untrained": base}
            timings["evaluate"] = time.monotonic() - t
            log(f"stage evaluate: {timings['evaluate']:.1f} s")

            from dflash_pipeline.drafter.evaluate import AcceptanceReport

            return self._keep(
                "evaluate",
                AcceptanceReport(
                    acceptance_length=trained["acceptance_length"],
                    block_size=drafter.spec.block_size,
                    num_prompts=trained["num_prompts"],
                    verify_steps=trained["verify_steps"],
                    generated_tokens=trained["generated_tokens"],
                    position_accept_rate=trained["position_accept_rate"],
                    per_prompt=trained["per_prompt"],
                    untrained_acceptance_length=base["acceptance_length"],
                ),
            )

    return Runner()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/realtext.yaml")
    ap.add_argument("--set", action="append", default=[], help="dotted override, as the CLI's --set")
    ap.add_argument("--stages", default=None, help="comma list (default: the config's)")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="everything ends by then (from start)")
    ap.add_argument("--eval-reserve-s", type=float, default=150.0, help="time kept for evaluation after training")
    ap.add_argument("--report", type=Path, default=None, help="default: <output_dir>/pipeline_report.json")
    args = ap.parse_args(argv)
    args.train_until_s = args.deadline_s - args.eval_reserve_s
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from dflash_pipeline import stages
    from dflash_pipeline.config import load_config

    overrides = list(args.set) + ([f"stages=[{args.stages}]"] if args.stages else [])
    cfg = stages.resolve_paths(load_config(args.config, overrides))
    work = Path(cfg.output_dir)
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    extra: dict = {}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    summary = stages.run_pipeline(cfg, make_runner(args, work, timings, extra))
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
    }
    out = args.report or work / "pipeline_report.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    log(f"stage times (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    acc = extra.get("acceptance")
    if acc:
        tr, un = acc["trained"], acc["untrained"]
        tau, base = tr["acceptance_length"], un["acceptance_length"]
        log(f"tau trained {tau:.3f} ({tr['num_prompts']} prompts), untrained {base:.3f}")
        log("position rates trained: " + " ".join(f"{r:.2f}" for r in tr["position_accept_rate"]))
        log("per source: " + json.dumps({k: round(v["tau"], 2) for k, v in tr["slices"].items()}))
    log(f"report: {out} ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
