"""Evaluation on the embedded target that is sliced, cached and reused, and a rerun of a finished run that does
nothing again: acceptance per slice of `evaluate.slice_by` (per position, consistent with the overall figure),
the untrained baseline cached per key in $DFLASH_HOME/baselines, the trained drafter's result reused from
dflash_meta.json, a finished training that is neither retrained nor re-exported, metrics.json's paths.

What is measured is counted, not timed: the report's target_forwards / baseline_forwards come from a forward hook
on the target, so 0 means the target ran no forward for that figure."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dflash_pipeline.config import load_config
from dflash_pipeline.drafter.config import EvalConfig
from dflash_pipeline.drafter.evaluate import PLOT, evaluate_export, load_prompts
from dflash_pipeline.drafter.export import META, export_drafter, load_drafter
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.train import train
from dflash_pipeline.errors import ConfigError
from dflash_pipeline.order import LocalRunner, run_pipeline

torch.set_num_threads(1)
TRAIN = {
    "train.block_size": 6,
    "train.num_draft_layers": 1,
    "train.batch_size": 4,
    "train.max_steps": 30,
    "train.lr": 3e-3,
    "train.warmup_ratio": 0.1,
    "train.anchors_per_sample": 48,
    "train.checkpoint_every": 10,
    "train.num_workers": 0,
    "train.device": "cpu",
}
EVAL = {"evaluate.num_prompts": 5, "evaluate.max_new_tokens": 10, "evaluate.device": "cpu"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, dflash_home):
    """The pipeline on 40 embedded conversations up to a trained export (no evaluation yet)."""
    root = tmp_path_factory.mktemp("evaluate_reuse")
    over = {
        "output_dir": str(root),
        "extract.devices": "cpu",
        "extract.isolation": "thread",
        "data.max_samples": 40,
        "layers.preset": "explicit",
        "layers.ids": [1, 3, 5],
        "validate.recompute_samples": 1,
        **TRAIN,
        **EVAL,
    }
    runner = LocalRunner()
    run_pipeline(load_config(overrides={**over, "stages": ["prepare", "extract", "validate", "train"]}), runner)
    return {"root": root, "over": over, "report": runner.results["probe"], "trained": runner.results["train"]}


def _eval(**settings) -> EvalConfig:
    return EvalConfig(**{"num_prompts": 5, "max_new_tokens": 10, "device": "cpu", **settings})


def _files(d: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.iterdir()}


def test_metrics_json_records_its_paths(run):
    t = run["trained"]
    metrics = json.loads(Path(t.metrics_path).read_text())
    assert metrics["metrics_path"] == t.metrics_path and Path(t.metrics_path).is_file()
    assert metrics["plot_path"] == t.plot_path and Path(t.plot_path).stat().st_size > 0


def test_slices_per_position_and_their_consistency_with_the_overall_figure(run, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))  # a baseline cache of this test's own
    export = run["trained"].export_dir
    rep = evaluate_export(export, run["report"], _eval(slice_by=["domain"]))
    rows = load_prompts(_eval())
    entries = rep.slices["domain"]
    assert [e["value"] for e in entries] == sorted({r["domain"] for r in rows})
    assert sum(e["num_prompts"] for e in entries) == rep.num_prompts == 5 and len(entries) == 4
    steps = [e["verify_steps"] for e in entries]
    assert sum(steps) == rep.verify_steps > 0
    assert sum(e["generated_tokens"] for e in entries) == rep.generated_tokens
    # overall = the verification-step-weighted mean of the slices, for tau, each position and the baseline
    n = rep.verify_steps
    assert sum(s * e["acceptance_length"] for s, e in zip(steps, entries, strict=True)) / n == pytest.approx(
        rep.acceptance_length
    )
    for k in range(rep.block_size - 1):
        weighted = sum(s * e["position_accept_rate"][k] for s, e in zip(steps, entries, strict=True)) / n
        assert weighted == pytest.approx(rep.position_accept_rate[k])
    base_steps = {}
    for p, r in zip(rep.untrained_per_prompt, rows, strict=True):
        base_steps.setdefault(r["domain"], []).append(len(p["produced"]))
    base = sum(sum(base_steps[e["value"]]) * e["untrained_acceptance_length"] for e in entries)
    assert base / sum(map(sum, base_steps.values())) == pytest.approx(rep.untrained_acceptance_length)
    assert len(rep.position_accept_rate) == rep.block_size - 1 == 5
    assert 1.0 <= rep.untrained_acceptance_length <= rep.acceptance_length <= rep.block_size
    # beside the export: the plot and the record
    assert rep.plot_path == str(Path(export).parent / PLOT)
    assert Path(rep.plot_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((Path(export) / META).read_text())["acceptance"]
    assert meta["slices"] == rep.slices and meta["acceptance_length"] == rep.acceptance_length
    assert meta["per_prompt"][0]["slices"] == {"domain": rows[0]["domain"]}
    md = rep.to_markdown()
    assert "## By `domain`" in md and all(f"| {e['value']} |" in md for e in entries)


def test_a_slice_field_the_rows_lack_is_an_error_naming_it_and_the_rows_fields(run):
    with pytest.raises(ConfigError, match=r"slice_by names 'source'.*5 of the 5 .*\['domain', 'id', 'messages'\]"):
        evaluate_export(run["trained"].export_dir, run["report"], _eval(slice_by=["source"]))


def test_baseline_cached_and_trained_result_reused_until_their_key_changes(run, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    export, report = run["trained"].export_dir, run["report"]
    first = evaluate_export(export, report, _eval(reuse=False, baseline="always"))  # whatever ran before
    assert not first.reused and first.baseline_reused is False
    assert first.target_forwards > 0 and first.baseline_forwards > 0
    cache = Path(first.baseline_cache)
    assert cache.parent == tmp_path / "baselines" and cache.is_file()

    again = evaluate_export(export, report, _eval())  # same key: nothing runs (the target is not even loaded)
    assert again.reused and again.baseline_reused and again.target_forwards == again.baseline_forwards == 0
    assert again.acceptance_length == first.acceptance_length
    assert again.untrained_acceptance_length == first.untrained_acceptance_length
    assert json.loads((Path(export) / META).read_text())["acceptance"]["reused"] is True

    sliced = evaluate_export(export, report, _eval(slice_by=["domain"]))  # slices cost no forward
    assert sliced.reused and sliced.baseline_reused and sliced.target_forwards == sliced.baseline_forwards == 0
    assert sliced.slices["domain"] and sliced.acceptance_length == first.acceptance_length

    remeasured = evaluate_export(export, report, _eval(reuse=False))  # the trained one again, baseline cached
    assert not remeasured.reused and remeasured.target_forwards == first.target_forwards
    assert remeasured.baseline_reused and remeasured.baseline_forwards == 0
    assert remeasured.acceptance_length == first.acceptance_length  # greedy and deterministic

    always = evaluate_export(export, report, _eval(baseline="always"))
    assert always.reused and always.baseline_reused is False and always.baseline_forwards == first.baseline_forwards
    off = evaluate_export(export, report, _eval(baseline="off"))
    assert off.baseline_reused is None and off.untrained_acceptance_length is None and off.baseline_forwards == 0

    longer = evaluate_export(export, report, _eval(max_new_tokens=12))  # a changed key: both measured again
    assert not longer.reused and longer.baseline_reused is False
    assert longer.target_forwards > 0 and longer.baseline_forwards > 0
    assert longer.baseline_cache != first.baseline_cache and Path(longer.baseline_cache).is_file()

    # another drafter of the same architecture: its own figures are measured, the baseline is the cached one
    other = tmp_path / "other" / "export"
    torch.manual_seed(123)
    export_drafter(DFlashDrafter(load_drafter(export).spec), other)
    rep = evaluate_export(str(other), report, _eval())
    assert not rep.reused and rep.target_forwards > 0 and rep.baseline_reused and rep.baseline_forwards == 0
    assert rep.untrained_acceptance_length == first.untrained_acceptance_length

    cache.unlink()  # the cache file gone: the copy kept in the export's dflash_meta.json serves, and is cached again
    kept = evaluate_export(str(other), report, _eval())
    assert kept.reused and kept.baseline_reused and kept.baseline_forwards == 0 and cache.is_file()


def test_a_rerun_of_a_finished_run_trains_exports_and_evaluates_nothing(run, tmp_path):
    cfg = load_config(overrides={**run["over"], "stages": ["train", "evaluate"]})
    export = cfg.drafter_dir / "export"
    first = LocalRunner()
    run_pipeline(cfg, first)
    assert first.results["train"].reused  # the fixture's run had finished training: nothing was trained
    before = _files(export)  # the export as the fixture's run wrote it, with this run's evaluation

    second = LocalRunner()
    summary = run_pipeline(cfg, second)
    t, acc = second.results["train"], second.results["evaluate"]
    assert t.reused and t.start_step == t.steps == t.total_steps == run["trained"].steps
    assert t.history == run["trained"].history and t.export_dir == str(export)
    assert acc.reused and acc.baseline_reused and acc.target_forwards == acc.baseline_forwards == 0
    assert summary.acceptance_length == round(first.results["evaluate"].acceptance_length, 3)
    after = _files(export)
    assert {k: v for k, v in after.items() if k != META} == {k: v for k, v in before.items() if k != META}
    metrics = json.loads(Path(t.metrics_path).read_text())
    assert metrics["steps"] == t.steps and metrics["tokens_per_s"] == run["trained"].tokens_per_s > 0

    # another setting that does not shape the training (a schedule setting trains again from step 0:
    # tests/integration/test_drafter_pipeline.py): the checkpoint at the last step is kept (no step trained), the
    # export is redone with the provenance of this run (a drafter directory of its own: the module's stays as it is)
    copy = tmp_path / "drafter"
    shutil.copytree(cfg.drafter_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    changed = train(cfg.train.model_copy(update={"keep_checkpoints": 3}), cfg.store, run["report"], copy)
    assert not changed.reused and changed.start_step == changed.steps == t.steps
    assert json.loads((copy / "export" / META).read_text())["train_config"]["keep_checkpoints"] == 3


@pytest.mark.parametrize(
    ("turns", "said"),
    [
        ([{"role": "usr", "content": "hi"}], "line 1 (no id): turn 0 has role 'usr', not one of system, developer"),
        ([{"content": "hi"}], "line 1 (no id): turn 0 has no role"),
    ],
)
def test_a_prompt_row_with_an_unknown_role_is_named_as_such(tmp_path, turns, said):
    """A fresh-user check: a misspelt role was reported as the row ending with a turn of that role, and a row
    without id as `(id None)`."""
    from dflash_pipeline.errors import DataError

    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    with pytest.raises(DataError, match=re.escape(said)):
        load_prompts(_eval(prompts=str(tmp_path / "p.jsonl")))
