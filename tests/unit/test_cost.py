"""The plan's GPU cost (core/cost.py) from the benches' rates (core/rates.json, bench/rates.py): the rates file is
what the raw bench files give, and the model predicts the GPU time of three runs measured on the GPU within 15%
(issue 49, item 3); several GPUs say which scaling is measured and which assumed (item 4)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dflash_pipeline import cost

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rates():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_rates", ROOT / "bench" / "rates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def records():
    return cost.load_rates()


def test_the_shipped_rates_file_is_what_the_raw_bench_files_give(rates, tmp_path):
    """No figure typed by hand: `python bench/rates.py --rebuild` writes the shipped file again, record for record."""
    rebuilt = rates.rebuild(tmp_path / "rates.json")
    shipped = json.loads(cost.RATES_PATH.read_text())["records"]
    assert json.loads(json.dumps(rebuilt, default=str)) == shipped
    stages = {(r["stage"], r["shape_name"], r["gpu"]) for r in shipped}
    for want in [("extract", "8b", "H200"), ("extract", "8b", "H100 80GB"), ("extract", "27b", "H200"),
                 ("extract_fp8", "27b", "H200"), ("train", "8b", "H100 80GB"), ("train", "27b", "H100 80GB"),
                 ("train", "real-text", "H200"), ("regenerate", "real-text", "H200"),
                 ("evaluate", "real-text", "H200")]:  # fmt: skip
        assert want in stages


@pytest.mark.parametrize("run", ["8B shape", "27B shape", "real-text benchmark"])
def test_the_plan_predicts_each_recorded_runs_gpu_time_within_15_percent(rates, records, run):
    """The plan's model with the rates file as shipped, on the work of a run measured on the GPU (its tokens,
    epochs, packing, prompts), against the wall time its raw file records: every stage the plan estimates."""
    row = next(r for r in rates.check(records) if r["run"] == run)
    assert not row["missing"], row
    assert abs(row["error"]) <= 0.15, row


@pytest.mark.parametrize("run", ["8B shape", "27B shape"])
def test_held_out_each_run_is_predicted_from_the_other_runs_within_15_percent(rates, records, run):
    """Without the records of the run's own raw file: the 8B drafter from an earlier ten-minute run of the same
    settings; the 27B drafter, which has no other record, from the 8B shape scaled by FLOPs per token (its stage
    misses by ~22%: MFU 0.45 at head dimension 256 against 0.62; the run's total is within 15%)."""
    row = next(r for r in rates.check(records, held_out=True) if r["run"] == run)
    assert all(src != row["raw"] for src in row["sources"].values())
    assert abs(row["error"]) <= 0.15, row


@pytest.mark.xfail(
    strict=True,
    reason="held out, the real-text run misses (+20%): the only other clean training record (2026-12-02) ran at "
    "6,096 tokens/s steady against this run's 7,269 on the same settings, and regeneration differs 23% between two "
    "H200 machines (docs/COST.md)",
)
def test_held_out_the_real_text_run_is_predicted_within_15_percent(rates, records):
    row = next(r for r in rates.check(records, held_out=True) if r["run"] == "real-text benchmark")
    assert abs(row["error"]) <= 0.15, row


@pytest.mark.parametrize("raw", ["2026-12-06_s27_train_long_bench.json", "2026-12-06_s27_train_27b_bench.json"])
def test_the_planners_training_flops_agree_with_the_benchs_count(rates, raw):
    """The FLOPs per token the plan scales by (from the shape, sample length and anchors) against the bench's own
    count of the work the training loop did (train_bench.step_flops over the window), within 5%."""
    d = json.loads((ROOT / "bench" / "results" / raw).read_text())
    v = d["variants"][0]
    counted = v["flops_per_step"] * v["window_steps"] / (v["tokens_per_s"] * v["window_s"])
    rec = next(r for r in rates.parse(ROOT / "bench" / "results" / raw) if r["stage"] == "train")
    # per_sample: from the lengths of the bench's own samples (common.synthetic_samples), not from its count
    assert set(rec["per_sample"]) == {"queries", "supervised_positions", "attn_pairs"}
    assert cost.record_train_fpt(rec) == pytest.approx(counted, rel=0.05)


def _work(rates, records, run: str, **change) -> tuple[cost.Work, str]:
    work, gpu, _ = rates.checked_run(run, records)
    for k, v in change.items():
        setattr(work, k, v)
    return work, gpu


def test_two_gpus_say_which_scaling_is_measured_and_which_assumed(rates, records):
    """Extraction on two GPUs: the two-GPU bench's efficiency (measured on two H200); training: data-parallel,
    never measured on two GPUs, so linear and named as assumed. Wall time halves, GPU-hours stay (plus each
    worker's fixed cost)."""
    one, gpu = _work(rates, records, "8B shape")
    two, _ = _work(rates, records, "8B shape", gpus=2)
    a, b = cost.estimate(records, one, gpu), cost.estimate(records, two, gpu)
    sa, sb = {s.stage: s for s in a.stages}, {s.stage: s for s in b.stages}
    assert "MEASURED on 2 x H200" in sb["extract"].scaling
    assert "ASSUMED" in sb["train"].scaling and "torchrun" in sb["train"].scaling
    assert not sa["train"].scaling
    assert sb["train"].wall_s < 0.6 * sa["train"].wall_s
    assert sb["train"].gpu_hours == pytest.approx(sa["train"].gpu_hours, rel=0.1)
    lines = cost.table_lines([b])
    assert any("ASSUMED" in x for x in lines) and any("MEASURED" in x for x in lines)


def test_a_shape_without_its_own_record_is_scaled_by_flops_and_says_so(rates, records):
    """The 27B-shape drafter unpacked (batch 1): no such record; the 27B packed record is used and the line says
    that batch 1 was not measured. A 27B extraction on an H100: measured on H200 only, scaled by bf16 peak."""
    work, gpu = _work(rates, records, "27B shape", pack=False, batch_size=1)
    stages = {s.stage: s for s in cost.estimate(records, work, gpu).stages}
    assert "pack=false, batch_size 1 not measured for this shape" in stages["train"].basis
    assert "measured on H200, scaled by bf16 peak" in stages["extract"].basis
    other = dict(work.target, hidden_size=6144, params_per_token=work.target["params_per_token"] * 1.4)
    work.target = other
    ex = next(s for s in cost.estimate(records, work, gpu).stages if s.stage == "extract")
    assert "by FLOPs per token" in ex.basis and ex.gpu_hours is not None


def test_a_small_target_is_priced_only_from_its_own_shape(rates, records):
    """The real-text target (70M parameters) has records of its own: priced without scaling. A small target of
    another shape gets no figure (per-batch overheads, not FLOPs, bound its speed)."""
    work, gpu = _work(rates, records, "real-text benchmark")
    assert not work.flops_bound
    est = cost.estimate(records, work, gpu)
    assert all(s.gpu_hours is not None for s in est.stages)
    assert not any("scaled from" in s.basis for s in est.stages)
    work.target = dict(work.target, hidden_size=64, params_per_token=2e5)
    work.drafter = dict(work.drafter, hidden_size=64)
    est = cost.estimate(records, work, gpu)
    assert all(s.gpu_hours is None for s in est.stages)


def test_a_bench_appends_its_record_and_a_rerun_replaces_it(rates, tmp_path):
    raw = ROOT / "bench" / "results" / "2026-12-06_s27_train_27b_bench.json"
    path = tmp_path / "rates.json"
    rates.write([], path)
    assert len(rates.record_file(raw, "python bench/train_bench.py --shape 27b", path)) == 1
    rates.record_file(raw, "again", path)
    recs = cost.load_rates(path)
    assert len(recs) == 1 and recs[0]["command"] == "again" and recs[0]["stage"] == "train"
    assert rates.record_file(tmp_path / "missing.json", path=path) == []  # never fails the bench


def test_the_plan_artifact_shows_the_cost_as_a_table(rates, records):
    """The preflight task publishes StoreEstimate.to_markdown: the cost rows become a markdown table under their
    heading, the basis lines stay list items."""
    import dataclasses

    from dflash_pipeline.planner import StoreEstimate

    work, gpu = _work(rates, records, "8B shape", gpus=2)
    lines = cost.table_lines([cost.estimate(records, work, k) for k in cost.kinds(records)])
    missing = dataclasses.MISSING
    need = {
        f.name: None
        for f in dataclasses.fields(StoreEstimate)
        if f.default is missing and f.default_factory is missing  # type: ignore[misc]
    }
    est = StoreEstimate(**{**need, "dropped": {}, "layers": [1], "samples": 1, "tokens": 1, "supervised_tokens": 1,
                           "rows_read": 1, "quarantined": 0, "hidden_size": 8, "raw_bf16_bytes_per_token": 16,
                           "bytes_per_token": 8.0, "units": 1, "store_bytes": 8, "fits": True, "needed_bytes": 0,
                           "free_bytes": None, "free_source": "-", "gpu_source": "-", "metadata_bytes_per_sample": 0,
                           "already_committed_tokens": 0},
                        cost_lines=lines)  # fmt: skip
    md = est.to_markdown()
    assert "- GPU cost of the recipe" in md and "\n| H100 80GB |" in md and "\n| H200 |" in md
    assert "- cost scaling: training on 2 GPUs (data-parallel, torchrun): linear scaling ASSUMED" in md


def test_the_drafters_checkpoints_are_counted_at_the_measured_disk_speed_or_named(rates, records):
    """train.checkpoint_every: each checkpoint the drafter's fp32 weights and AdamW moments; counted at the disk's
    measured write speed (plan.write_test_mib), else named as not counted; a record whose run wrote checkpoints at
    the same interval has them in its rate (the real-text run: every 250 steps)."""
    work, gpu = _work(rates, records, "8B shape", checkpoint_every=200)
    base = next(
        s for s in cost.estimate(records, _work(rates, records, "8B shape")[0], gpu).stages if s.stage == "train"
    )
    named = next(s for s in cost.estimate(records, work, gpu).stages if s.stage == "train")
    assert "NOT counted" in named.basis and named.wall_s == pytest.approx(base.wall_s)
    work.disk_bytes_per_s = 1e9
    counted = next(s for s in cost.estimate(records, work, gpu).stages if s.stage == "train")
    n = work.train_steps // 200
    size = cost.drafter_params(work.drafter) * 12
    assert counted.wall_s == pytest.approx(base.wall_s + n * size / 1e9)
    assert "at the disk's measured 1,000 MB/s" in counted.basis and "upper bound" in counted.basis
    rt, gpu = _work(rates, records, "real-text benchmark", checkpoint_every=250, disk_bytes_per_s=1e9)
    train = next(s for s in cost.estimate(records, rt, gpu).stages if s.stage == "train")
    assert "checkpoints every 250 steps are in the measured rate" in train.basis
