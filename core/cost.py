"""GPU cost of a run's whole recipe (`dflash-pipeline plan`; docs/COST.md): GPU-hours of extraction, regeneration,
training and evaluation per GPU kind, from the rates the benchmarks recorded in rates.json beside this module.

rates.json is written by bench/rates.py (`python bench/rates.py --rebuild` reads the raw bench JSONs in
bench/results/ and bench/realtext/results/; the benches append their own record when they finish). One record per
measurement: the stage, the shape measured (target and drafter), the GPU, the settings, the steady rate (`rate`
`unit`s per second), the amount done and the whole run's wall time, and what the whole run spent besides the steady
rate (`overhead_s`: compilation, loading, the final checkpoint).

A stage's time = its fixed overhead + work / rate. For each stage the closest record is used: the same shape, GPU
and settings if measured, else a record of another shape scaled by FLOPs per token (only between targets large
enough for FLOPs to bind: SMALL_TARGET), else of another GPU scaled by bf16 peak; every line says which. Several
GPUs: extraction runs one worker per GPU, training is data-parallel (torchrun); their scaling is the measured
multi-GPU efficiency where a record holds one, else linear and named as assumed.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

RATES_PATH = Path(__file__).with_name("rates.json")
# Dense bf16 tensor-core peak (TFLOP/s, without sparsity), from the vendors' data sheets: scales a rate to a GPU kind
# that no record measured.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 80GB": 989.0,
    "H100": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
}
# Parameters per token under which a target's speed is bound by per-batch overheads, not FLOPs: rates scaled from
# other shapes say nothing about it (only a record of its own shape does).
SMALL_TARGET = 0.5e9
STAGES = ("regenerate", "setup", "extract", "validate", "train", "evaluate")
STAGE_NAMES = {
    "regenerate": "regeneration",
    "setup": "probe, prepare, plan",
    "extract": "extraction",
    "validate": "validation",
    "train": "training",
    "evaluate": "evaluation",
}


def gpu_kind(name: str | None) -> str | None:
    """A GPU's name as the records spell it: 'NVIDIA H100 80GB HBM3' -> 'H100 80GB', 'NVIDIA H200' -> 'H200'."""
    if not name:
        return None
    n = name.upper()
    if "H200" in n:
        return "H200"
    if "H100" in n:
        return "H100 80GB" if "80GB" in n.replace(" ", "") or n.strip() in ("H100", "NVIDIA H100") else name
    for k in GPU_PEAK_TFLOPS:
        if k.upper() in n:
            return k
    return name


def peak(kind: str | None) -> float | None:
    if not kind:
        return None
    return GPU_PEAK_TFLOPS.get(kind) or next((v for k, v in GPU_PEAK_TFLOPS.items() if k in kind), None)


def load_rates(path: str | Path | None = None) -> list[dict]:
    """The records of rates.json (an empty list when the file is missing)."""
    p = Path(path) if path else RATES_PATH
    try:
        return list(json.loads(p.read_text())["records"])
    except (OSError, ValueError, KeyError):
        return []


# ---- shapes ----------------------------------------------------------------------------------------------------
def dense_layer_params(h: int, inter: int, heads: int, kv: int, hd: int) -> float:
    return h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * inter


def params_per_token(text_config: dict, layer_types: list[str], run_layers: int) -> float:
    """Parameters of the decoder layers a token passes through during extraction (the first `run_layers`: the
    forward stops after the highest captured layer); MoE layers count their active experts."""
    t = text_config
    h, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    kv, hd = int(t.get("num_key_value_heads") or heads), int(t.get("head_dim") or h // heads)
    inter = int(t.get("intermediate_size") or 0)
    if t.get("num_experts_per_tok"):
        inter = int(t.get("moe_intermediate_size") or inter) * int(t["num_experts_per_tok"])
        inter += int(t.get("shared_expert_intermediate_size") or 0)
    total = 0.0
    for kind in list(layer_types)[:run_layers]:
        if kind == "linear_attention":
            nk, nv = int(t.get("linear_num_key_heads", 16)), int(t.get("linear_num_value_heads", 32))
            dk, dv = int(t.get("linear_key_head_dim", 128)), int(t.get("linear_value_head_dim", 128))
            total += h * (2 * nk * dk + 2 * nv * dv) + h * 2 * nv + nv * dv * h + 3 * h * inter
        else:
            total += dense_layer_params(h, inter, heads, kv, hd)
    return total


def target_shape(text_config: dict, layer_types: list[str], layer_ids: list[int], capture_last: bool) -> dict:
    """What an extraction record is matched on: hidden size, vocabulary, the layers run and their parameters."""
    run = len(layer_types) if capture_last else max(layer_ids) + 1
    return {
        "hidden_size": int(text_config["hidden_size"]),
        "vocab_size": int(text_config.get("vocab_size") or 0),
        "layers_run": run,
        "hybrid": "linear_attention" in layer_types,
        "params_per_token": params_per_token(text_config, layer_types, run),
    }


def drafter_shape(text_config: dict, n_layers: int, captured: int, block: int, anchors: int) -> dict:
    """The drafter's dimensions (drafter/target_head.draft_spec: the target's own width, heads and vocabulary)."""
    t = text_config
    h, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    return {
        "layers": int(n_layers),
        "captured": int(captured),
        "hidden_size": h,
        "intermediate_size": int(t.get("intermediate_size") or 4 * h),
        "heads": heads,
        "kv_heads": int(t.get("num_key_value_heads") or heads),
        "head_dim": int(t.get("head_dim") or h // heads),
        "vocab_size": int(t.get("vocab_size") or 0),
        "block_size": int(block),
        "anchors": int(anchors),
    }


def drafter_params(d: dict) -> float:
    """Trainable parameters of the drafter (fc over the captured layers + its decoder layers)."""
    h = d["hidden_size"]
    layer = dense_layer_params(h, d["intermediate_size"], d["heads"], d["kv_heads"], d["head_dim"])
    return d["captured"] * h * h + d["layers"] * layer


def sample_work(lengths, supervised_share: float, anchors: int, block: int) -> dict:
    """Per average sample, what training computes on samples of these lengths: draft queries (anchors, each at most
    one per supervised position, x block), supervised positions, attention query-key pairs (each block's queries
    see the context before its anchor, on average half the sample, and their own block)."""
    q = s = p = 0.0
    n = 0
    for length in lengths:
        a = min(anchors, max(int(length * supervised_share) - 1, 1))
        q += a * block
        s += a * (block - 1)
        p += a * block * (length / 2 + block)
        n += 1
    n = max(n, 1)
    return {"queries": q / n, "supervised_positions": s / n, "attn_pairs": p / n}


def train_flops_per_token(d: dict, mean_len: float, supervised_per_sample: float, per_sample: dict | None = None):
    """Useful training FLOPs per context token (bench/train_bench.py's count, per average sample): fc, the draft
    layers' forward and backward over the anchors' blocks, the frozen lm_head's forward and input gradient.
    per_sample: sample_work's figures of the data (else from the mean sample, which overstates the anchors of a
    spread of lengths)."""
    h, i, nh, nkv, hd = d["hidden_size"], d["intermediate_size"], d["heads"], d["kv_heads"], d["head_dim"]
    b, k, v = d["block_size"], d["captured"], d["vocab_size"]
    c = max(mean_len, 1.0)
    if per_sample:
        q, s, p = per_sample["queries"], per_sample["supervised_positions"], per_sample["attn_pairs"]
    else:
        q = min(d["anchors"], max(supervised_per_sample, 1.0)) * b
        s = q * (b - 1) / b
        p = q * (c / 2 + b)
    fc = 4 * c * k * h * h
    layer = 4 * q * h * nh * hd + 4 * (c + q) * h * nkv * hd + 6 * q * h * i + 4 * nh * hd * p
    return (fc + 3 * d["layers"] * layer + 4 * s * h * v) / c


def record_train_fpt(rec: dict) -> float:
    """A training record's FLOPs per token, from its own data's figures."""
    return train_flops_per_token(
        rec["drafter"], rec["mean_sample_tokens"], rec["supervised_per_sample"], rec.get("per_sample")
    )


def same_target(a: dict, b: dict) -> bool:
    return (
        a.get("hidden_size") == b.get("hidden_size")
        and a.get("vocab_size") == b.get("vocab_size")
        and a.get("hybrid") == b.get("hybrid")
        and abs(a.get("params_per_token", 0) - b.get("params_per_token", 0))
        <= 0.02 * max(b.get("params_per_token", 1), 1)
    )


def same_drafter(a: dict, b: dict) -> bool:
    keys = ("layers", "hidden_size", "intermediate_size", "heads", "kv_heads", "head_dim", "vocab_size", "block_size")
    return all(a.get(k) == b.get(k) for k in keys)


# ---- what a run does -------------------------------------------------------------------------------------------
@dataclass
class Work:
    """The amounts of one run, as the plan knows them."""

    target: dict  # target_shape
    drafter: dict  # drafter_shape
    tokens: int  # tokens to extract
    samples: int
    supervised: int
    epochs: float
    batch_size: int = 1
    grad_accum: int = 1
    pack: bool = False
    max_steps: int | None = None
    fp8_target: bool = False
    regenerate: int = 0  # conversations to regenerate (0: off)
    max_new_tokens: int = 0  # regenerate.max_new_tokens
    regen_batch: int = 0  # regenerate.batch_size
    eval_prompts: int = 0
    eval_new_tokens: int = 0
    validate: bool = True
    gpus: int = 1
    shape_name: str = ""
    flops_bound: bool | None = None  # None: params_per_token >= SMALL_TARGET (the planner passes its own verdict)
    checkpoint_every: int = 0  # train.checkpoint_every (0: none during training)
    disk_bytes_per_s: float | None = None  # the output disk's measured write speed (plan.write_test_mib)
    per_sample: dict | None = None  # sample_work of the data, when its lengths are known

    def __post_init__(self):
        if self.flops_bound is None:
            self.flops_bound = self.target["params_per_token"] >= SMALL_TARGET

    @property
    def train_tokens(self) -> float:
        """Context tokens trained: tokens x epochs, or fewer when train.max_steps stops it first."""
        per_step = max(self.batch_size * self.grad_accum * self.gpus, 1)
        steps = math.ceil(self.samples / per_step) * self.epochs
        share = min(1.0, self.max_steps / steps) if self.max_steps and steps else 1.0
        return self.tokens * self.epochs * share

    @property
    def train_steps(self) -> float:
        per_step = max(self.batch_size * self.grad_accum * self.gpus, 1)
        steps = math.ceil(self.samples / per_step) * self.epochs
        return min(steps, self.max_steps) if self.max_steps else steps

    @property
    def train_fpt(self) -> float:
        n = max(self.samples, 1)
        return train_flops_per_token(self.drafter, self.tokens / n, self.supervised / n, self.per_sample)


@dataclass
class StageCost:
    stage: str
    gpu_hours: float | None  # summed over the GPUs
    wall_s: float | None
    basis: str  # where the figure comes from, in words
    raw: str | None = None  # the raw file of the record used
    scaling: str = ""  # how several GPUs scale: measured / assumed


@dataclass
class Cost:
    gpu: str
    gpus: int
    stages: list[StageCost] = field(default_factory=list)

    @property
    def total_gpu_hours(self) -> float:
        return sum(s.gpu_hours or 0.0 for s in self.stages)

    @property
    def total_wall_s(self) -> float:
        return sum(s.wall_s or 0.0 for s in self.stages)

    @property
    def missing(self) -> list[str]:
        return [s.stage for s in self.stages if s.gpu_hours is None]

    def to_dict(self) -> dict:
        return {**asdict(self), "total_gpu_hours": self.total_gpu_hours, "total_wall_s": self.total_wall_s}


# ---- picking and scaling records -------------------------------------------------------------------------------
def _settings_match(rec: dict, work: Work) -> bool:
    """The settings a stage's speed depends on: packing and batch (training), the batch (regeneration)."""
    s = rec.get("settings") or {}
    if rec.get("stage") == "regenerate":
        return not work.regen_batch or s.get("batch_size") == work.regen_batch
    if rec.get("stage") != "train":
        return True
    return bool(s.get("pack", False)) == work.pack and int(s.get("batch_size", 1)) == work.batch_size


def _usable(rec: dict, stage: str, exclude: tuple[str, ...]) -> bool:
    return rec.get("stage") == stage and not rec.get("shared_gpu") and rec.get("raw") not in exclude


def pick(records: list[dict], stage: str, work: Work, gpu: str, exclude: tuple[str, ...] = ()) -> dict | None:
    """The closest single-GPU record of `stage` for `work` on `gpu`: same shape first, then the same settings (train),
    then the same GPU kind, then the newest and the longest measured."""
    cands = [r for r in records if _usable(r, stage, exclude) and int(r.get("gpus", 1)) == 1]
    if not cands:
        return None

    def same_shape(r: dict) -> bool:
        if stage == "train":
            return same_drafter(r.get("drafter") or {}, work.drafter)
        return same_target(r.get("target") or {}, work.target)

    def key(r: dict):
        return (
            same_shape(r),
            _settings_match(r, work),
            r.get("gpu") == gpu,
            str(r.get("date", "")),
            float(r.get("amount", 0)) / max(float(r.get("rate", 1)), 1e-9),
        )

    best = max(cands, key=key)
    if not same_shape(best) and not _scalable(best, work, stage):
        return None
    return best


def _scalable(rec: dict, work: Work, stage: str) -> bool:
    """Across shapes only between targets whose speed FLOPs bind (both past SMALL_TARGET), and only for the stages
    whose work FLOPs count (extraction, training)."""
    if stage not in ("extract", "extract_fp8", "train"):
        return False
    return bool(work.flops_bound) and (rec.get("target") or {}).get("params_per_token", 0) >= SMALL_TARGET


def _overhead(records: list[dict], stage: str, work: Work, rec: dict, exclude: tuple[str, ...]) -> tuple[float, str]:
    """A stage's fixed seconds per run (per worker): the median over the stage's records of what each whole run
    spent besides its steady rate, of the same shape where any (else all, scaled by drafter parameters for training,
    by parameters per token for extraction), preferring the picked record's GPU kind."""
    recs = [r for r in records if _usable(r, stage, exclude) and r.get("overhead_s") is not None]
    if stage == "train":
        same = [r for r in recs if same_drafter(r.get("drafter") or {}, work.drafter)]
        size = drafter_params(work.drafter)

        def scale(r):
            return size / max(drafter_params(r["drafter"]), 1.0)

        what = "drafter parameters"
    else:
        same = [r for r in recs if same_target(r.get("target") or {}, work.target)]

        def scale(r):
            return work.target["params_per_token"] / max(r["target"]["params_per_token"], 1.0)

        what = "parameters per token"
    pool = same or recs
    on_gpu = [r for r in pool if r.get("gpu") == rec.get("gpu")]
    pool = on_gpu or pool
    if not pool:
        return 0.0, "no fixed cost recorded"
    values = [max(float(r["overhead_s"]), 0.0) * (1.0 if same else scale(r)) for r in pool]
    n = len(values)
    how = f"{statistics.median(values):.0f} s fixed (" + ("one run's" if n == 1 else f"median of {n} runs")
    return statistics.median(values), how + ("" if same else f", scaled by {what} from other shapes") + ")"


CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 master weights and AdamW's two moments (drafter/checkpoint.py)


def _checkpoints(rec: dict, work: Work) -> tuple[float, str]:
    """(seconds, what) of the checkpoints written every train.checkpoint_every steps: each the drafter's fp32
    weights and AdamW moments, at the output disk's measured write speed. A record whose run wrote them at the same
    interval has them in its rate; without a measured disk speed they are named, not counted."""
    every = work.checkpoint_every
    if not every or work.train_steps < every:
        return 0.0, ""
    if (rec.get("settings") or {}).get("checkpoint_every") == every:
        return 0.0, f"its checkpoints every {every} steps are in the measured rate"
    n = int(work.train_steps // every)
    size = drafter_params(work.drafter) * CHECKPOINT_BYTES_PER_PARAM
    if not work.disk_bytes_per_s:
        return 0.0, (
            f"{n:,} checkpoints of {size / 1e9:,.1f} GB (every {every} steps) NOT counted: the disk's write speed is "
            "not measured (plan.write_test_mib measures it)"
        )
    secs = n * size / work.disk_bytes_per_s
    return secs, (
        f"{n:,} checkpoints of {size / 1e9:,.1f} GB (every {every} steps) at the disk's measured "
        f"{work.disk_bytes_per_s / 1e6:,.0f} MB/s: {secs:,.0f} s, an upper bound (unsynced, the page cache takes "
        "part of each write; not measured on the GPU)"
    )


def _efficiency(records: list[dict], stage: str, gpus: int, exclude: tuple[str, ...]) -> tuple[float, str]:
    if gpus <= 1:
        return 1.0, ""
    multi = [r for r in records if _usable(r, stage, exclude) and int(r.get("gpus", 1)) > 1 and r.get("efficiency")]
    if not multi:
        how = "data-parallel, torchrun" if stage == "train" else "one worker each"
        return 1.0, f"{STAGE_NAMES[stage.split('_')[0]]} on {gpus} GPUs ({how}): linear scaling ASSUMED, not measured"
    r = max(multi, key=lambda r: (int(r["gpus"]) == gpus, str(r.get("date", ""))))
    eff = min(float(r["efficiency"]), 1.0)
    return eff, (
        f"{STAGE_NAMES[stage.split('_')[0]]} on {gpus} GPUs (one worker each): {float(r['efficiency']):.2f} of one "
        f"GPU's rate per GPU MEASURED on {r['gpus']} x {r.get('gpu')} ({r.get('shape_name')} shape, {r.get('date')}, "
        f"{r.get('raw')}), counted as {eff:.2f}"
        + (" (no more than linear)" if float(r["efficiency"]) > 1 else "")
        + ("" if int(r["gpus"]) == gpus else f"; {gpus} GPUs not measured")
    )


def _amount(stage: str, work: Work) -> tuple[float, str]:
    if stage in ("extract", "extract_fp8", "validate"):
        return float(work.tokens), "tokens"
    if stage == "train":
        return work.train_tokens, "tokens"
    if stage == "regenerate":
        return float(work.regenerate), "conversations"
    if stage == "evaluate":
        return float(work.eval_prompts), "prompts"
    return 1.0, "runs"


def stage_cost(records: list[dict], stage: str, work: Work, gpu: str, exclude: tuple[str, ...] = ()) -> StageCost:
    """One stage's GPU-hours on `work.gpus` GPUs of kind `gpu`."""
    name = STAGE_NAMES.get(stage, stage)
    kind = "extract_fp8" if stage == "extract" and work.fp8_target else stage
    rec = pick(records, kind, work, gpu, exclude)
    if rec is None:
        why = "no record of this target's shape" if records else "no rates file"
        return StageCost(stage, None, None, f"{name}: not estimated ({why}: a bench run of it on the GPU measures it)")
    amount, unit = _amount(stage, work)
    rate = float(rec["rate"])
    notes = []
    if stage == "train" and not same_drafter(rec.get("drafter") or {}, work.drafter):
        rf = record_train_fpt(rec)
        rate *= rf / work.train_fpt
        notes.append(f"scaled from the {rec.get('shape_name')} shape by FLOPs per token")
    elif stage == "train":  # the same drafter; the samples' lengths and anchors may differ
        rf = record_train_fpt(rec)
        rate *= rf / work.train_fpt
        if abs(rf / work.train_fpt - 1) > 0.02:
            n = max(work.samples, 1)
            notes.append(
                f"scaled by FLOPs per token to this data's samples ({work.tokens / n:,.0f} tokens, "
                f"{work.supervised / n:,.0f} supervised each; {rec['mean_sample_tokens']:,.0f} and "
                f"{rec['supervised_per_sample']:,.0f} there)"
            )
    elif stage in ("extract", "validate") and not same_target(rec.get("target") or {}, work.target):
        rate *= rec["target"]["params_per_token"] / work.target["params_per_token"]
        notes.append(f"scaled from the {rec.get('shape_name')} shape by FLOPs per token")
    if stage == "train" and not _settings_match(rec, work):
        s = rec.get("settings") or {}
        notes.append(
            f"measured with pack={str(bool(s.get('pack'))).lower()}, batch_size {s.get('batch_size', 1)}; "
            f"pack={str(work.pack).lower()}, batch_size {work.batch_size} not measured for this shape"
        )
    if stage == "regenerate" and not _settings_match(rec, work):
        notes.append(f"measured at batch {(rec.get('settings') or {}).get('batch_size')}, {work.regen_batch} here")
    if stage in ("regenerate", "evaluate"):
        per = (rec.get("settings") or {}).get("max_new_tokens")
        want = work.max_new_tokens if stage == "regenerate" else work.eval_new_tokens
        if per and want and per != want:
            rate *= per / want
            notes.append(f"scaled by max_new_tokens ({per} measured, {want} here)")
    if rec.get("gpu") != gpu:
        mine, theirs = peak(gpu), peak(rec.get("gpu"))
        if not mine or not theirs:
            return StageCost(stage, None, None, f"{name}: not estimated (no bf16 peak known for {gpu!r})")
        rate *= mine / theirs
        notes.append(f"measured on {rec.get('gpu')}, scaled by bf16 peak ({mine:g} / {theirs:g} TFLOP/s)")
    fixed, fixed_how = (0.0, "")
    if stage in ("extract", "train"):
        fixed, fixed_how = _overhead(records, kind, work, rec, exclude)
    elif rec.get("overhead_s"):
        fixed, fixed_how = float(rec["overhead_s"]), f"{float(rec['overhead_s']):.0f} s fixed (that run's)"
    if stage == "train":
        ckpt_s, how = _checkpoints(rec, work)
        fixed += ckpt_s
        if how:
            notes.append(how)
    n = max(work.gpus, 1)
    eff, scaling = _efficiency(records, kind, n, exclude) if stage in ("extract", "train") else (1.0, "")
    if n > 1 and stage not in ("extract", "train"):
        scaling = f"on one of the {n} GPUs"
    busy = amount / rate / eff  # GPU-seconds of the work, summed over the GPUs
    workers = n if stage in ("extract", "train") else 1
    wall = fixed + busy / workers
    gpu_s = fixed * workers + busy
    unit_rate = f"{rate:,.3g} {rec.get('unit', unit)}/s" if rate < 100 else f"{rate:,.0f} {rec.get('unit', unit)}/s"
    basis = (
        f"{name}: {amount:,.0f} {unit} at {unit_rate} per GPU"
        if stage != "setup"
        else f"{name}: {busy:,.0f} s as measured"
    )
    basis += f" ({rec.get('shape_name')} shape on {rec.get('gpu')}, {rec.get('date')}, {rec.get('raw')}"
    basis += "".join(f"; {x}" for x in notes) + (f"; {fixed_how}" if fixed_how else "") + ")"
    return StageCost(stage, gpu_s / 3600, wall, basis, rec.get("raw"), scaling)


def kinds(records: list[dict], named: str | None = None) -> list[str]:
    """GPU kinds to print: those with records, newest first by name order, plus a named one."""
    out = sorted({r["gpu"] for r in records if r.get("gpu")})
    if named and named not in out:
        out.append(named)
    return out


def estimate(records: list[dict], work: Work, gpu: str, exclude: tuple[str, ...] = ()) -> Cost:
    cost = Cost(gpu, work.gpus)
    for stage in STAGES:
        if stage == "regenerate" and not work.regenerate:
            continue
        if stage == "evaluate" and not work.eval_prompts:
            continue
        if stage == "validate" and not work.validate:
            continue
        if stage == "setup":  # probe, prepare, plan: a fixed cost only a record of the same target gives
            rec = pick(records, "setup", work, gpu, exclude)
            if rec is None:
                continue
        cost.stages.append(stage_cost(records, stage, work, gpu, exclude))
    return cost


def table_lines(costs: list[Cost]) -> list[str]:
    """The plan's cost table: one row per GPU kind, a column per stage, then the basis of each figure."""
    if not costs:
        return []
    stages = [s.stage for s in costs[0].stages]
    head = "| GPU | " + " | ".join(STAGE_NAMES[s] for s in stages) + " | total GPU-hours | wall hours |"
    lines = [
        f"GPU cost of the recipe (GPU-hours, {costs[0].gpus} GPU{'s' if costs[0].gpus > 1 else ''}; rates from "
        f"{RATES_PATH.name}, docs/COST.md):",
        head,
        "|" + " --- |" * (len(stages) + 3),
    ]
    for c in costs:
        cells = ["-" if s.gpu_hours is None else f"{s.gpu_hours:.3g}" for s in c.stages]
        total = f"{c.total_gpu_hours:.3g}" + (
            f" (without {', '.join(STAGE_NAMES[m] for m in c.missing)})" if c.missing else ""
        )
        lines.append(f"| {c.gpu} | " + " | ".join(cells) + f" | {total} | {c.total_wall_s / 3600:.3g} |")
    for c in costs:
        for s in c.stages:
            lines.append(f"cost basis, {c.gpu}: {s.basis}")
    for scaling in dict.fromkeys(s.scaling for c in costs for s in c.stages if s.scaling):
        lines.append(f"cost scaling: {scaling}")
    return lines
