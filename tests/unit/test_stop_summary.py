"""The run summary of a stopped run (issue 50): headed with its state and stage, the cause in words, where it stopped
and the command that resumes it; a failed run's is headed with its stage too."""

from __future__ import annotations

from dflash_pipeline.summary import RunSummary, StopReport
from dflash_pipeline.tasks.extract import run_summary_markdown


def _summary() -> RunSummary:
    return RunSummary(output_dir="/o", store="/o/store", version="v0001", current="v0001", validation="PASS")


def test_a_stopped_run_is_headed_with_its_state_and_stage_and_says_how_it_resumes():
    stop = StopReport(
        state="Crashed",
        stage="train-drafter",
        cause="serve was stopped",
        where="checkpoint step-00000042 (/o/drafter/checkpoints/step-00000042)",
        resume="`prefect deployment run 'dflash-pipeline/full' -p overrides='{\"a\": 1}'`",
    )
    md = run_summary_markdown(_summary(), stop=stop)
    assert md.startswith("# Run summary: CRASHED at train-drafter\n"), md
    lines = md.splitlines()
    assert "| outcome | **crashed**: serve was stopped |" in lines, md
    assert "| stopped at | checkpoint step-00000042 (/o/drafter/checkpoints/step-00000042) |" in lines, md
    assert any(line.startswith("| resume | `prefect deployment run 'dflash-pipeline/full'") for line in lines), md
    assert "SystemExit" not in md and "TerminationSignal" not in md
    assert stop.line().startswith("Crashed at train-drafter: serve was stopped. Stopped at checkpoint step-00000042")


def test_a_failed_run_is_headed_with_its_stage():
    md = run_summary_markdown(_summary(), failure="prepare-dataset: DataError: no usable samples")
    assert md.startswith("# Run summary: FAILED at prepare-dataset\n"), md
    assert "| outcome | **failed**: prepare-dataset: DataError: no usable samples |" in md.splitlines(), md


def test_the_resume_command_gives_the_runs_own_config_file_and_overrides_as_the_shell_reads_them():
    import json
    import shlex

    from dflash_pipeline.flows.pipeline import resume_command

    overrides = {"data.source": "/data/it's here.jsonl", "train.lr": 0.001}
    cmd = resume_command("full", {"config_path": "/srv/my run.yaml", "overrides": overrides, "preset": None})
    argv = shlex.split(cmd)
    assert argv[:4] == ["prefect", "deployment", "run", "dflash-pipeline/full"], cmd
    assert argv[4:6] == ["-p", "config_path=/srv/my run.yaml"], cmd
    assert argv[6] == "-p" and json.loads(argv[7].removeprefix("overrides=")) == overrides, cmd
    assert resume_command("nightly", {}) == "prefect deployment run 'dflash-pipeline/nightly'"
