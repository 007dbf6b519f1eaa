"""The rates the plan's GPU cost comes from (core/rates.json, read by core/cost.py; docs/COST.md).

    python bench/rates.py --rebuild     # core/rates.json from the raw bench JSONs in bench/results/ and
                                        # bench/realtext/results/ (nothing typed by hand)
    python bench/rates.py --check       # predicted against measured GPU time for the three recorded runs
    python bench/rates.py --list        # the records, one a line

The benches append their own record when they finish (`record_file`: extract_bench.py, train_bench.py, the
real-text pipeline runner); copy the raw file into bench/results/ with its dated name and `--rebuild` to keep the
file reproducible from the raw files alone.

A record: stage (extract, extract_fp8, regenerate, setup, validate, train, evaluate), shape_name and the shape
(`target`: hidden size, vocabulary, layers run, parameters per token; `drafter` for training), gpu ('H100 80GB',
'H200'), gpus (several: `efficiency` per GPU against one), precision, settings (packing, batch size, max new
tokens, ...), rate (`unit`s per second at steady state), amount and wall_s (the whole run measured), overhead_s
(what that whole run spent besides its steady rate: compilation, loading, the last checkpoint), date, command,
raw (the raw file, relative to the repository), shared_gpu (other work shared the GPU: not used as a rate), note.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RATES = ROOT / "core" / "rates.json"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # `core.cost` when the package is not installed

from common import SHAPES  # noqa: E402

try:
    from dflash_pipeline import cost  # noqa: E402
except ImportError:  # a checkout without the package installed
    from core import cost  # noqa: E402

# The captured layers of the bench shapes (extract_bench.py / train_bench.py: the DFlash preset of 5 layers).
BENCH_LAYERS = {"8b": [1, 9, 17, 25, 33], "27b": [1, 16, 31, 46, 61], "tiny-dense": [1, 3, 5], "tiny-hybrid": [1, 3, 5]}


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _bench_target(shape: str) -> dict:
    spec = dict(SHAPES[shape])
    types = spec.get("layer_types") or ["full_attention"] * spec["num_hidden_layers"]
    return cost.target_shape(spec, types, BENCH_LAYERS[shape], False)


def _bench_drafter(shape: str, variant_overrides: dict) -> dict:
    spec = SHAPES[shape]
    n = variant_overrides.get("num_draft_layers") or len(BENCH_LAYERS[shape])
    block = variant_overrides.get("block_size", 16)
    anchors = variant_overrides.get("anchors_per_sample", 512)
    return cost.drafter_shape(spec, n, len(BENCH_LAYERS[shape]), block, anchors)


def _gpu(name: str | None) -> str | None:
    return cost.gpu_kind(name)


def _date(path: Path, fallback: str = "") -> str:
    return path.name[:10] if path.name[:4].isdigit() else fallback


# ---- parsers, one per raw format -----------------------------------------------------------------------------
def from_extract_bench(path: Path, d: dict) -> list[dict]:
    """extract_bench.py's bench.json: (b), the pipeline's own extraction, per shape."""
    env = d.get("env") or {}
    args = env.get("args") or {}
    out = []
    for shape in ("8b", "27b"):
        s = d.get(shape)
        if not isinstance(s, dict) or "b" not in s or not s["b"].get("tokens_per_s"):
            continue
        a, b = s.get("a") or {}, s["b"]
        fp8 = bool(args.get("target_fp8"))
        overhead = None
        if a.get("warm_and_measure_s") and a.get("seconds"):
            # (a) is warmed by one untimed pass over the same batches: what the pass took beyond a timed one is
            # the compilation and autotuning a worker run pays once; (b)'s call beyond its measured window is the
            # load and the last unit's drain
            overhead = max(a["warm_and_measure_s"] - 2 * a["seconds"], 0.0) + max(
                (b.get("call_s") or b["seconds"]) - b["seconds"], 0.0
            )
        out.append(
            {
                "stage": "extract_fp8" if fp8 else "extract",
                "shape_name": shape,
                "target": _bench_target(shape),
                "gpu": _gpu(env.get("gpu")),
                "gpus": 1,
                "precision": "fp8 target" if fp8 else "bf16 target",
                "settings": {
                    "compile": s.get("a", {}).get("compile"),
                    "token_budget": s.get("token_budget"),
                    "variants": args.get("b_variants") or "",
                },
                "rate": b["tokens_per_s"],
                "unit": "tokens",
                "amount": b["tokens"],
                "wall_s": b["seconds"] + (overhead or 0.0),
                "overhead_s": overhead,
                "date": (env.get("date") or "")[:10] or _date(path),
                "command": "python bench/extract_bench.py " + " ".join(f"--{k}={v}" for k, v in args.items() if v),
                "raw": _rel(path),
            }
        )
    return out


def from_train_bench(path: Path, d: dict) -> list[dict]:
    """train_bench.py's train_bench.json: each variant's steady window, and its whole run."""
    out = []
    shape = d.get("shape")
    if shape not in SHAPES:
        return out
    for v in d.get("variants") or []:
        if "error" in v or not v.get("tokens_per_s"):
            continue
        ov = v.get("overrides") or {}
        tokens = v["whole_run_tokens_per_s"] * v["elapsed_s"]
        drafter = _bench_drafter(shape, ov)
        out.append(
            {
                "stage": "train",
                "shape_name": shape,
                "target": _bench_target(shape),
                "drafter": drafter,
                "gpu": _gpu(d.get("device")),
                "gpus": 1,
                "precision": f"store {d.get('store', {}).get('precision', 'full')}",
                "settings": {
                    "pack": bool(ov.get("pack", False)),
                    "batch_size": int(ov.get("batch_size", 1)),
                    "variant": v["variant"],
                },  # fmt: skip
                "rate": v["tokens_per_s"],
                "unit": "tokens",
                "mean_sample_tokens": v["tokens_per_s"] / v["samples_per_s"],
                # the bench's samples are supervised throughout
                "supervised_per_sample": v["tokens_per_s"] / v["samples_per_s"],
                # the bench's own samples (common.synthetic_samples: the lengths of its store)
                "per_sample": _bench_sample_work(d["store"], drafter),
                "amount": tokens,
                "wall_s": v["elapsed_s"],
                # first steps (compilation) and the checkpoint at the stop: the whole run beyond its steady rate
                "overhead_s": v["elapsed_s"] - tokens / v["tokens_per_s"],
                "window_s": v["window_s"],
                "mfu": v.get("mfu"),
                "date": _date(path),
                "command": "python bench/train_bench.py" + (f" --shape {shape}" if shape != "8b" else ""),
                "raw": _rel(path),
                "extract": {"tokens": d["store"]["tokens"], "tokens_per_s": d["store"]["extract_tokens_per_s"]},
            }
        )
    return out


def _bench_sample_work(store: dict, drafter: dict) -> dict:
    from common import synthetic_samples

    _, lengths, _ = synthetic_samples(store["tokens"], store["vocab"], seed=1)
    return cost.sample_work(lengths, 1.0, drafter["anchors"], drafter["block_size"])


def from_multi_gpu_bench(path: Path, d: dict) -> list[dict]:
    """multi_gpu_bench.py: one worker on one GPU, then one per GPU on the same amount each."""
    one, every = d.get("one_device") or {}, d.get("all_devices") or {}
    n = len(d.get("devices") or [])
    if n < 2 or not one.get("tokens_per_s") or not every.get("aggregate_tokens_per_s"):
        return []
    rec = {
        "stage": "extract",
        "shape_name": d.get("shape"),
        "target": _bench_target(d["shape"]) if d.get("shape") in SHAPES else {},
        # the raw file names no GPU: this harness ran on two H200 (bench/RESULTS.md, "Two GPUs of one host")
        "gpu": _gpu(d.get("gpu")) or "H200",
        "gpus": n,
        "precision": "bf16 target",
        "settings": {},
        "rate": every["aggregate_tokens_per_s"] / n,
        "unit": "tokens",
        "amount": sum(p["tokens"] for p in every["per_device"].values()),
        "wall_s": every.get("wall_s_with_loads"),
        "overhead_s": None,
        "efficiency": every["aggregate_tokens_per_s"] / (n * one["tokens_per_s"]),
        "date": _date(path),
        "command": "python bench/multi_gpu_bench.py --tokens-per-gpu 400000",
        "raw": _rel(path),
    }
    if "_s3_" in path.name:
        # its one-GPU phase ran with a cold compile cache, the two-GPU phase warm (bench/RESULTS.md): not a scaling
        rec["efficiency"] = None
        rec["note"] = "one-GPU phase cold, two-GPU phase warm: no scaling figure"
    return [rec]


def _run_config(argv: list[str]) -> dict:
    """The YAML config a real-text run names (its file as it is now; the run's --set overrides not applied)."""
    import yaml

    conf = argv[argv.index("--config") + 1] if "--config" in argv else "configs/realtext.yaml"
    try:
        return yaml.safe_load((ROOT / conf).read_text()) or {}
    except OSError:
        return {}


def _realtext_shape(report_path: Path, argv: list[str]) -> tuple[dict, dict] | None:
    """(target config, the target report) of a real-text run: the target_report.json of the same date and tag
    beside it (bench/realtext/results/), else, when a bench records its fresh report, the config.json of the target
    its config names."""
    stem = _stem(report_path)
    for name in (f"{stem}target_report.json", f"{report_path.name[:10]}_target_report.json"):
        p = report_path.with_name(name)
        if p.is_file():
            return json.loads(p.read_text())["model"], {}
    model = ((_run_config(argv).get("target") or {}).get("model_path")) or ""
    p = ROOT / model / "config.json"
    if model and p.is_file():
        c = json.loads(p.read_text())
        return c.get("text_config") or c, {}
    return None


def _supervised_share(report_path: Path) -> float | None:
    """The prepared share of supervised tokens, from the run's log ("... tokens, 72.2% supervised")."""
    import re

    stem = _stem(report_path).replace("realtext_", "")
    for log in sorted(report_path.parent.glob(f"{stem}*log*.txt")):
        m = re.search(r"tokens, ([0-9.]+)% supervised", log.read_text())
        if m:
            return float(m.group(1)) / 100
    return None


def _steady_train_rate(report_path: Path, run: dict, warm_s: float = 30.0) -> float | None:
    """Tokens/s of a real-text run's training after its first warm_s seconds, from its log's progress lines
    ("[hh:mm:ss +Ns] train step K/TOTAL ...", one every 100 steps) and its tokens per step (the report's). The log is
    the one beside the report whose progress lines are this run's (same total, its last step)."""
    import re

    stem = _stem(report_path).replace("realtext_", "")
    for log in sorted(report_path.parent.glob(f"{stem}*log*.txt")):
        text = log.read_text(errors="replace")
        start = re.search(r"\+(\d+)s\] stage train \.\.\.", text)
        pts = [(int(m[1]), int(m[2]), int(m[3])) for m in re.finditer(r"\+(\d+)s\] train step (\d+)/(\d+)", text)]
        if not start or not pts or pts[-1][2] != run.get("total_steps") or pts[-1][1] < run["steps"] - 100:
            continue
        window = [(t, k) for t, k, _ in pts if t - int(start[1]) >= warm_s]
        if len(window) < 2 or window[-1][0] - window[0][0] < 60:
            return None
        (t1, k1), (t2, k2) = window[0], window[-1]
        per_step = run["tokens_per_s"] * run["elapsed_s"] / run["steps"]
        return (k2 - k1) / (t2 - t1) * per_step
    return None


def _stem(report_path: Path) -> str:
    """'2026-12-03_s13_store_report.json' -> '2026-12-03_s13_' (the run's other files share it)."""
    name = report_path.name
    for tail in ("pipeline_report.json", "store_report.json"):
        if name.endswith(tail):
            return name[: -len(tail)]
    return name


def from_pipeline_report(path: Path, d: dict) -> list[dict]:
    """bench/realtext/pipeline.py's report: the stages of the pipeline on the real-text target, each timed."""
    shape = _realtext_shape(path, d.get("argv") or [])
    if shape is None:
        return []
    model, _ = shape
    layer_ids = (d.get("summary") or {}).get("layer_ids") or [1, 4, 7, 10, 13]
    target = cost.target_shape(model, model["layer_types"], layer_ids, False)
    t, s = d.get("timings_s") or {}, d.get("summary") or {}
    regen = _regen_settings(d.get("argv") or [])
    gpu = _gpu(d.get("device"))
    date = (d.get("date") or "")[:10] or _date(path)
    argv = d.get("argv") or []
    cmd = "python bench/realtext/pipeline.py " + " ".join(argv)
    base = {"shape_name": "real-text", "target": target, "gpu": gpu, "gpus": 1, "precision": "bf16 target",
            "date": date, "command": cmd, "raw": _rel(path)}  # fmt: skip
    # RT_PRECISION runs beside the train stage on the same GPU in the chain of this run (bench/realtext/chain.sh):
    # its train and evaluate stages shared the GPU (bench/RESULTS.md, 2026-12-03: 25% slower)
    shared = "s13" in path.name
    out = []
    convs = s.get("new_samples") or 0
    if t.get("regenerate", 0) > 5 and convs:  # (0.4 s: the replies of an earlier run reused)
        out.append({**base, "stage": "regenerate", "rate": convs / t["regenerate"], "unit": "conversations",
                    "amount": convs, "wall_s": t["regenerate"], "overhead_s": 0.0,
                    "settings": regen})  # fmt: skip
    setup = sum(t.get(k, 0.0) for k in ("probe", "prepare", "estimate", "plan"))
    if all(k in t for k in ("prepare", "estimate", "plan")):
        out.append({**base, "stage": "setup", "rate": 1 / setup, "unit": "runs", "amount": 1, "wall_s": setup,
                    "overhead_s": 0.0, "settings": {}})  # fmt: skip
    tok = s.get("tokens_extracted")
    if tok and t.get("extract"):
        out.append({**base, "stage": "extract", "rate": tok / t["extract"], "unit": "tokens", "amount": tok,
                    "wall_s": t["extract"], "overhead_s": 0.0, "settings": {"compile": "off"},
                    "note": "the whole stage (load included; compile off)"})  # fmt: skip
    if tok and t.get("validate"):
        out.append({**base, "stage": "validate", "rate": tok / t["validate"], "unit": "tokens", "amount": tok,
                    "wall_s": t["validate"], "overhead_s": 0.0, "settings": {}})  # fmt: skip
    run = d.get("train_run") or {}
    meta = path.with_name(f"{_stem(path)}dflash_meta.json")
    tc = json.loads(meta.read_text())["train_config"] if meta.is_file() else _run_config(argv).get("train") or {}
    sup = _supervised_share(path)
    if run.get("tokens_per_s") and t.get("train") and tok and s.get("new_samples") and sup:
        n = s["new_samples"]
        amount = run["tokens_per_s"] * run["elapsed_s"]
        steady = _steady_train_rate(path, run)
        out.append(
            {
                **base,
                "stage": "train",
                "drafter": cost.drafter_shape(
                    model,
                    tc.get("num_draft_layers") or len(layer_ids),
                    len(layer_ids),
                    tc.get("block_size", 16),
                    tc.get("anchors_per_sample", 512),
                ),  # fmt: skip
                "settings": {
                    "pack": bool(tc.get("pack", False)),
                    "batch_size": int(tc.get("batch_size", 1)),
                    "checkpoint_every": tc.get("checkpoint_every"),
                },  # fmt: skip
                # steady: the run's log lines after its first 30 s (the first steps compile flex attention),
                # checkpoints included; without the log, the whole run's average
                "rate": steady or run["tokens_per_s"],
                "unit": "tokens",
                "mean_sample_tokens": tok / n,
                "supervised_per_sample": tok * sup / n,
                "amount": amount,
                "wall_s": t["train"],
                "overhead_s": t["train"] - amount / (steady or run["tokens_per_s"]),
                "note": "steady rate from the run's log" if steady else "the whole run's average rate",
                "shared_gpu": shared,
            }
        )
    acc = d.get("acceptance") or {}
    if t.get("evaluate") and acc.get("num_prompts") and "baseline_reused" in acc:
        out.append({**base, "stage": "evaluate", "rate": acc["num_prompts"] / t["evaluate"], "unit": "prompts",
                    "amount": acc["num_prompts"], "wall_s": t["evaluate"], "overhead_s": 0.0, "shared_gpu": shared,
                    "settings": {"max_new_tokens": 64, "baseline": "measured" if not acc["baseline_reused"]
                                 else "cached"}})  # fmt: skip
    return out


def _regen_settings(argv: list[str]) -> dict:
    """regenerate.max_new_tokens and batch_size of a real-text run: the config it names (its file as it is now),
    with the run's --set overrides."""
    r = _run_config(argv).get("regenerate") or {}
    out = {"max_new_tokens": r.get("max_new_tokens"), "batch_size": r.get("batch_size")}
    for i, a in enumerate(argv[:-1]):
        if a == "--set" and argv[i + 1].startswith("regenerate."):
            k, v = argv[i + 1][len("regenerate.") :].split("=", 1)
            if k in out:
                out[k] = int(v)
    return out


def parse(path: Path) -> list[dict]:
    """The records of one raw file (none for a format that holds no rate)."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(d, dict):
        return []
    path = Path(path)
    if "variants" in d and "store" in d:
        return from_train_bench(path, d)
    if "env" in d and ("8b" in d or "27b" in d):
        return from_extract_bench(path, d)
    if "all_devices" in d:
        return from_multi_gpu_bench(path, d)
    if "timings_s" in d:
        return from_pipeline_report(path, d)
    return []


def raw_files() -> list[Path]:
    return sorted((ROOT / "bench" / "results").glob("*.json")) + sorted(
        (ROOT / "bench" / "realtext" / "results").glob("*_report.json")
    )


def rebuild(path: Path = RATES) -> list[dict]:
    records = [r for f in raw_files() for r in parse(f)]
    write(records, path)
    return records


def write(records: list[dict], path: Path = RATES) -> None:
    doc = {
        "format": 1,
        "written_by": "python bench/rates.py --rebuild (and the benches' record_file)",
        "fields": __doc__.split("A record: ", 1)[1].strip(),
        "records": records,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


def record_file(
    raw: str | Path, command: str | None = None, path: Path = RATES, copy_to: Path | None = None
) -> list[dict]:
    """Append the records of a bench's raw file to the rates file (a bench calls this when it finishes); records of
    the same raw file are replaced. copy_to: the updated file written there too (the bench's output folder, which is
    what comes back from a GPU machine). Never fails the bench: a problem is printed."""
    try:
        new = [r for r in parse(Path(raw)) if r.get("gpu") not in (None, "cpu")]  # GPU runs only
        for r in new:
            if command:
                r["command"] = command
        if not new:
            print(f"rates: no GPU rate in {raw}: nothing recorded", flush=True)
            return []
        old = [r for r in cost.load_rates(path) if r.get("raw") not in {n["raw"] for n in new}]
        write(old + new, path)
        if copy_to is not None:
            write(old + new, Path(copy_to))
        print(f"rates: {len(new)} record(s) of {raw} in {_rel(path)}", flush=True)
        return new
    except Exception as e:  # noqa: BLE001 - a bench's figures are its result; the rates file is a by-product
        print(f"rates: {raw} not recorded ({type(e).__name__}: {e})", flush=True)
        return []


# ---- the check: predicted against measured --------------------------------------------------------------------
CHECKED = {
    "8B shape": "bench/results/2026-12-06_s27_train_long_bench.json",
    "27B shape": "bench/results/2026-12-06_s27_train_27b_bench.json",
    "real-text benchmark": "bench/realtext/results/2026-12-03_s12_pipeline_report.json",
}


def checked_run(name: str, records: list[dict]) -> tuple[cost.Work, str, dict[str, float]]:
    """(the run's work as a plan sees it, its GPU, the measured seconds per stage) from its raw file."""
    raw = CHECKED[name]
    path = ROOT / raw
    d = json.loads(path.read_text())
    if "variants" in d:  # a train bench: the store's extraction, then training
        tr = next(r for r in parse(path) if r["stage"] == "train")
        store = d["store"]["tokens"]
        samples = store / tr["mean_sample_tokens"]
        work = cost.Work(
            target=tr["target"],
            drafter=tr["drafter"],
            tokens=store,
            samples=round(samples),
            supervised=store,
            epochs=tr["amount"] / store,
            batch_size=tr["settings"]["batch_size"],
            pack=tr["settings"]["pack"],
            validate=False,
            shape_name=tr["shape_name"],
            per_sample=tr["per_sample"],
        )
        measured = {"extract": store / d["store"]["extract_tokens_per_s"], "train": tr["wall_s"]}
        return work, tr["gpu"], measured
    recs = {r["stage"]: r for r in parse(path)}
    tr = recs["train"]
    tokens = d["summary"]["tokens_extracted"]
    samples = d["summary"]["new_samples"]
    work = cost.Work(
        target=tr["target"],
        drafter=tr["drafter"],
        tokens=tokens,
        samples=samples,
        supervised=round(tr["supervised_per_sample"] * samples),
        epochs=tr["amount"] / tokens,
        batch_size=tr["settings"]["batch_size"],
        pack=tr["settings"]["pack"],
        regenerate=samples,
        max_new_tokens=recs["regenerate"]["settings"]["max_new_tokens"],
        regen_batch=recs["regenerate"]["settings"]["batch_size"],
        eval_prompts=d["acceptance"]["num_prompts"],
        eval_new_tokens=recs["evaluate"]["settings"]["max_new_tokens"],
        shape_name=tr["shape_name"],
    )
    measured = {st: r["wall_s"] for st, r in recs.items()}
    return work, tr["gpu"], measured


def check(records: list[dict] | None = None, held_out: bool = False) -> list[dict]:
    """Each checked run's predicted GPU time (the plan's model on its work) against its measured one. held_out:
    without the records of the run's own raw file."""
    records = cost.load_rates() if records is None else records
    rows = []
    for name, raw in CHECKED.items():
        work, gpu, measured = checked_run(name, records)
        est = cost.estimate(records, work, gpu, exclude=(raw,) if held_out else ())
        predicted = {s.stage: s.wall_s for s in est.stages}
        stages = [s for s in measured if s in predicted]
        # over the stages the plan estimated (a stage it could not estimate is named, not counted as 0)
        done = [s for s in stages if predicted[s] is not None]
        p, m = sum(predicted[s] for s in done), sum(measured[s] for s in done)
        rows.append(
            {
                "run": name,
                "raw": raw,
                "gpu": gpu,
                "stages": {s: {"predicted_s": predicted[s], "measured_s": measured[s]} for s in stages},
                "sources": {s.stage: s.raw for s in est.stages},
                "predicted_s": p,
                "measured_s": m,
                "error": p / m - 1,
                "missing": [s for s in measured if s not in predicted or predicted[s] is None],
            }
        )
    return rows


def print_check(rows: list[dict], title: str) -> None:
    print(f"\n{title}\n")
    print("| run | GPU | stage | predicted s | measured s | error | rate from |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        for st, v in r["stages"].items():
            p = v["predicted_s"]
            src = r["sources"].get(st)
            same = "this run" if src == r["raw"] else (src or "-")
            err = f"{p / v['measured_s'] - 1:+.1%}" if p is not None else "-"
            ps = f"{p:,.1f}" if p is not None else "not estimated"
            print(f"| {r['run']} | {r['gpu']} | {st} | {ps} | {v['measured_s']:,.1f} | {err} | {same} |")
        left = f" (without {', '.join(r['missing'])})" if r["missing"] else ""
        print(
            f"| **{r['run']}** | {r['gpu']} | **total{left}** | **{r['predicted_s']:,.1f}** | "
            f"**{r['measured_s']:,.1f}** | **{r['error']:+.1%}** | |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rebuild", action="store_true", help="write core/rates.json from the raw files")
    p.add_argument("--check", action="store_true", help="predicted against measured for the three recorded runs")
    p.add_argument("--list", action="store_true", help="the records, one a line")
    p.add_argument("--out", type=Path, default=RATES)
    a = p.parse_args()
    if a.rebuild:
        recs = rebuild(a.out)
        print(f"{len(recs)} records from {len(raw_files())} raw files -> {_rel(a.out)}")
    if a.list:
        for r in cost.load_rates(a.out):
            print(
                f"{r['stage']:12} {r.get('shape_name', ''):10} {r.get('gpu', ''):10} x{r.get('gpus', 1)} "
                f"{r['rate']:>12,.2f} {r['unit']}/s  overhead {r.get('overhead_s') or 0:6.1f} s  {r['date']}  "
                f"{r['raw']}" + ("  (shared GPU: not used)" if r.get("shared_gpu") else "")
            )
    if a.check:
        recs = cost.load_rates(a.out)
        print_check(check(recs), "Predicted (the plan's model, rates.json as shipped) against measured GPU time:")
        print_check(
            check(recs, held_out=True),
            "Held out (each run predicted without the records of its own raw file):",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
