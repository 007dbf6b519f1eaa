"""The pre-flight plan (core/planner.py, `dflash-pipeline plan`): its store size against the real store, and
`run` refusing a store its disk cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_pipeline.errors import StoreError
from dflash_pipeline.order import LocalRunner, run_pipeline
from dflash_pipeline.storage.store import Store
from tests.helpers import config


def _bytes_under(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


@pytest.mark.parametrize(
    ("precision", "dtype"), [("full", "float32"), ("full", "bfloat16"), ("fp8", "bfloat16"), ("int8", "bfloat16")]
)
def test_estimate_is_within_10_percent_of_the_real_store(model_dir, tmp_path, precision, dtype):
    cfg = config(
        tmp_path,
        {
            "stages": ["prepare", "extract"],
            "data.max_samples": 120,
            "extract.store_precision": precision,
            "extract.store_dtype": dtype,
        },
    )
    runner = LocalRunner()
    summary = run_pipeline(cfg, runner)
    est = runner.results["estimate"]
    real = _bytes_under(Path(cfg.store) / summary.version)
    assert summary.planned_store_bytes == est.store_bytes
    assert abs(est.store_bytes - real) / real < 0.10, (est.store_bytes, real, est.calibration)
    assert est.samples == 120 and est.tokens == runner.results["prepare"].n_tokens
    assert "target's own hidden states" in est.calibration  # the tiny target: real rows, not synthetic
    assert est.fits and est.free_bytes > 0 and est.gpu is None  # CPU here: no GPU-hours, said why
    assert any("plan.gpu" in line for line in est.lines())


def test_run_refuses_a_store_the_disk_cannot_hold(model_dir, tmp_path):
    """With a 1 MiB quota the ~8 MB store does not fit: no version is created, nothing extracted; the documented
    override (plan.disk_check=false) starts anyway."""
    small = {"stages": ["prepare", "extract"], "data.max_samples": 120, "plan.disk_quota_gib": 1 / 1024}
    with pytest.raises(StoreError, match=r"plan.disk_check=false") as e:
        run_pipeline(config(tmp_path, small), LocalRunner())
    assert "GiB" in str(e.value) and "store_precision=fp8" in str(e.value)
    assert not Store(tmp_path / "store").versions()
    summary = run_pipeline(config(tmp_path, {**small, "plan.disk_check": False}), LocalRunner())
    assert summary.tokens_extracted > 0


def test_plan_command_prints_the_figures_for_a_named_gpu(model_dir, tmp_path, capsys, monkeypatch):
    """`dflash-pipeline plan` with the run's config and overrides; GPU-hours for a named GPU, from the benches'
    recorded rates (core/rates.json), except for a target too small for rates scaled by FLOPs (a fresh-user check:
    "863,577,085 tokens/s per H100" for the embedded target); exit status 1 when the store does not fit."""
    from dflash_pipeline import planner
    from dflash_pipeline.cli import main

    args = ["plan", "--set", f"output_dir={tmp_path}", "--set", "data.max_samples=40", "--set", "extract.devices=cpu"]
    named = [*args, "--set", "plan.gpu=H100", "--set", "extract.store_precision=fp8"]
    assert main(named) == 0
    out = capsys.readouterr().out
    assert "40 samples kept" in out and "precision fp8" in out and "not estimated: the target is too small" in out
    assert "GPU-hours" not in out and "throughput basis" not in out
    monkeypatch.setattr(planner, "SMALL_TARGET", 0)  # as a target of billions of parameters
    assert main(named) == 0
    out = capsys.readouterr().out
    assert "GPU-hours" in out and "scaled from the 8b shape by FLOPs per token" in out and "bench/results/" in out
    assert "| H100 80GB |" in out and "| H200 |" in out  # the recipe's cost per GPU kind (core/cost.py)
    assert main([*args, "--set", "plan.disk_quota_gib=0.0001"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_a_failing_calibration_forward_falls_back_to_synthetic_rows(model_dir, tmp_path):
    """A target the CPU cannot run (here: a dtype keyword its class rejects) must not fail the plan: bytes per
    token then come from synthetic rows, and the plan says why."""
    from dataclasses import replace

    from dflash_pipeline import planner
    from dflash_pipeline.stages import resolve_paths

    cfg = resolve_paths(config(tmp_path, {"stages": ["prepare"], "data.max_samples": 30}))
    runner = LocalRunner()
    run_pipeline(cfg, runner)
    broken = replace(runner.results["probe"], dtype_kwarg="no_such_kwarg")
    est = planner.estimate(cfg, broken, runner.results["prepare"], "float32")
    assert est.calibration.startswith("synthetic rows") and "the CPU forward failed: TypeError" in est.calibration
    assert est.store_bytes > 0


def test_already_committed_counts_only_this_datasets_samples(model_dir, tmp_path):
    """The plan's "already committed" figure is what a rerun skips: tokens of this dataset's samples that the store
    committed, not whatever else the store holds (e.g. the samples of the dataset before regeneration)."""
    import json

    def run(overrides: dict) -> LocalRunner:
        runner = LocalRunner()
        run_pipeline(
            config(tmp_path, {"stages": ["prepare", "extract"], "extract.incremental": True, **overrides}), runner
        )
        return runner

    first = run({"data.max_samples": 30}).results["prepare"]
    more = run({"data.max_samples": 40}).results
    assert more["estimate"].already_committed_tokens == first.n_tokens < more["prepare"].n_tokens

    other = tmp_path / "other.jsonl"  # conversations the store holds none of
    rows = [
        {"messages": [{"role": "user", "content": f"count to {i}"}, {"role": "assistant", "content": "1 2 3 " * i}]}
        for i in range(1, 6)
    ]
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    est = run({"data.source": str(other), "data.format": "messages"}).results["estimate"]
    assert est.already_committed_tokens == 0 and not any("already committed" in n for n in est.notes)
    # a run that starts a new version writes everything; so would one of another layer set (refused, after its plan)
    assert run({"data.max_samples": 30, "extract.new_version": True}).results["estimate"].already_committed_tokens == 0
    refused = LocalRunner()
    other_layers = {"stages": ["prepare", "extract"], "data.max_samples": 30, "layers.preset": "explicit"}
    with pytest.raises(StoreError, match="another target, layer set or forward"):
        run_pipeline(config(tmp_path, {**other_layers, "layers.ids": [1, 2]}), refused)
    assert refused.results["estimate"].already_committed_tokens == 0


def test_the_plan_says_a_run_on_another_dataset_will_be_refused(model_dir, tmp_path):
    """USAGE's quick try (data.max_samples) and then the real run into the same output_dir (a fresh-user check):
    the plan said "only the rest is written" and the run was refused, naming hash fingerprints only. Now the plan
    says the run will be refused, and both name the settings that make a dataset and the fix."""
    stages = {"stages": ["prepare", "extract"]}
    run_pipeline(config(tmp_path, {**stages, "data.max_samples": 10}), LocalRunner())
    refused = LocalRunner()
    with pytest.raises(StoreError, match=r"data\.max_samples or another data\.\* setting.*extract\.incremental=true"):
        run_pipeline(config(tmp_path, {**stages, "data.max_samples": 14}), refused)
    est = refused.results["estimate"]
    assert est.already_committed_tokens == 0
    assert (
        est.notes[0].startswith("a run with these settings will be refused: store ")
        and "data.max_samples" in est.notes[0]
    )
    from dflash_pipeline.cli import main

    plan = ["plan", "--set", f"output_dir={tmp_path}", "--set", "extract.devices=cpu", "--set", "data.max_samples=14"]
    assert main(plan) == 1  # `plan && run` stops here (a fresh-user check: it exited 0)
    assert main([*plan, "--set", "extract.incremental=true"]) == 0
    more = LocalRunner()
    run_pipeline(config(tmp_path, {**stages, "data.max_samples": 14, "extract.incremental": True}), more)
    assert not any("refused" in n for n in more.results["estimate"].notes)


def test_plan_counts_the_regenerated_replies_once_they_exist(model_dir, tmp_path, capsys):
    """With regenerate on, a run prepares and extracts the target's own replies: once an earlier run wrote them,
    `plan` counts those (before, it counted data.source's and compared them with a store of regenerated ones)."""
    import json

    from dflash_pipeline.cli import main

    args = ["plan", "--set", f"output_dir={tmp_path}", "--set", "extract.devices=cpu", "--set", "data.max_samples=40"]
    args += ["--set", "regenerate.enabled=true"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "40 samples kept" in out and "the figures count the replies of data.source" in out
    replies = tmp_path / "regenerated" / "conversations.jsonl"  # as an earlier run's regenerate stage leaves it
    replies.parent.mkdir()
    rows = [
        {"messages": [{"role": "user", "content": f"count to {i}"}, {"role": "assistant", "content": "1 2 3 " * i}]}
        for i in range(1, 8)
    ]
    replies.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "7 samples kept" in out and f"replies already regenerated in {replies}" in out, out
