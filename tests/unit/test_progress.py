"""The progress display off a terminal (core/progress.py): a line per stage as it starts and ends, a few progress
lines for a long stage, no duplicates; the CLI's console handler leaves the stage lines to the display."""

from __future__ import annotations

import io
import logging

from dflash_pipeline import progress


def _run_stages(display: progress.Display, steps: int = 200) -> None:
    run = progress.Run(["probe", "train"])
    with progress.showing(display):
        with run.stage("probe", "model") as st:
            st.result = "8 layers"
        with run.stage("train") as st:
            for step in range(1, steps + 1):
                progress.update("train", step, steps, "steps")
            st.result = f"{steps} steps"


def test_a_line_per_stage_start_and_end_and_at_most_three_between():
    out = io.StringIO()
    _run_stages(progress.LineDisplay(out, every_s=0.0))
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/2] probe ... model"
    assert lines[1].startswith("[1/2] probe: 8 layers (")
    assert lines[2] == "[2/2] train ..."
    assert lines[-1].startswith("[2/2] train: 200 steps (")
    between = lines[3:-1]
    counts = [line.split(": ")[1].split(" (")[0] for line in between]
    assert counts == ["50/200 steps", "100/200 steps", "150/200 steps"]
    assert len(set(lines)) == len(lines)


def test_progress_lines_wait_for_the_interval():
    out = io.StringIO()
    _run_stages(progress.LineDisplay(out, every_s=3600.0))
    assert len(out.getvalue().splitlines()) == 4  # start and end of each stage only


def test_updates_outside_a_run_or_a_display_do_nothing():
    progress.update("train", 1, 2, "steps")  # no stage running: ignored
    run = progress.Run(["extract"])
    with run.stage("extract") as st:  # no display: the stage is still tracked (parts summed)
        progress.update("extract", 5, 10, "tokens", part="cpu")
        progress.update("extract", 1, 10, "tokens", part="cuda:0")
        assert (st.done, st.total) == (6, 20)


def test_the_console_shows_warnings_once_and_never_the_stage_records(caplog):
    out = io.StringIO()
    handler = progress.ConsoleHandler(stream=out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        logging.getLogger(progress.LOGGER).warning("[1/2] probe: a stage record")
        logging.getLogger("dflash_pipeline.drafter.regen_output").info("regenerated 32/320 conversations")
        logging.getLogger("prefect.task_runs").info("Finished in state Completed()")
        logging.getLogger("dflash_pipeline.storage.store").warning("the disk is nearly full")
    finally:
        root.removeHandler(handler)
    assert out.getvalue().splitlines() == ["warning: the disk is nearly full"]


def test_transformers_gpu_kernel_notes_are_dropped_without_a_gpu():
    import torch

    progress.hide_gpu_notes_without_gpu()
    progress.hide_gpu_notes_without_gpu()  # once is enough: no second filter
    lg = logging.getLogger("transformers.integrations.hub_kernels")
    assert sum(isinstance(f, progress.CpuOnlyNotes) for f in lg.filters) == 1
    note = lg.makeRecord(lg.name, logging.WARNING, __file__, 1, f"`x` is {progress.GPU_KERNEL_NOTE}", (), None)
    other = lg.makeRecord(lg.name, logging.WARNING, __file__, 1, "something else", (), None)
    assert lg.filter(note) == torch.cuda.is_available() and lg.filter(other)


def test_the_terminal_display_ends_each_stage_with_its_line():
    out = io.StringIO()
    _run_stages(progress.BarDisplay(out))  # rich renders no live bar into a StringIO; the end lines stay
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert [line.split(": ")[0] for line in lines] == ["[1/2] probe", "[2/2] train"], lines


def test_the_prepare_line_says_why_rows_were_dropped_or_quarantined():
    # the reasons were in the manifest only: "64 dropped" said nothing of why
    from types import SimpleNamespace

    r = SimpleNamespace(
        n_samples=256,
        n_tokens=19_525,
        n_rows=1_330,
        dropped={"over max_length": 3, "exact duplicate": 1_064},
        quarantined=7,
        quarantined_by_reason={"no assistant turn": 7},
        reused=False,
    )
    assert progress.said_prepare(r) == (
        "256 samples, 19,525 tokens of 1,330 rows, 1,067 dropped (exact duplicate 1,064, over max_length 3), "
        "7 quarantined (no assistant turn 7)"
    )
    r.dropped, r.quarantined = {}, 0
    assert progress.said_prepare(r) == "256 samples, 19,525 tokens of 1,330 rows"


def test_a_resumed_training_says_its_first_loss_is_step_1s():
    """A fresh-user check read "steps 65 -> 600, loss 7.284 -> 0.348" as the loss at step 65."""
    from types import SimpleNamespace

    r = SimpleNamespace(reused=False, start_step=65, steps=600, total_steps=600, first_loss=7.2841, final_loss=0.348,
                        tokens_per_s=1234.0, interrupted=False)  # fmt: skip
    assert progress.said_train(r) == "steps 65 -> 600 of 600, loss 7.284 (step 1) -> 0.348, 1,234 tokens/s"
    fresh = SimpleNamespace(**{**vars(r), "start_step": 0})
    assert progress.said_train(fresh) == "steps 0 -> 600 of 600, loss 7.284 -> 0.348, 1,234 tokens/s"


def test_what_a_run_reused_is_one_list_item_each():
    """`run --json`'s reused list (a fresh-user check: two items joined into one English phrase)."""
    from types import SimpleNamespace

    run = progress.Run(["prepare", "evaluate"])
    with run.stage("prepare") as st:
        st.reused = ["the prepared dataset"]
    with run.stage("evaluate") as st:  # what `said` sets from the stage's result
        st.reused = progress.REUSED["evaluate"](SimpleNamespace(reused=True, baseline_reused=True))
    assert run.reused == ["the prepared dataset", "the trained drafter's acceptance", "the untrained baseline"]


def test_a_progress_artifact_value_stays_within_0_and_100():
    """A fresh-user check: a reused regeneration with more conversations than the run asks for gave 320%, and
    Prefect printed two warnings on the console."""
    from dflash_pipeline.tasks.common import percent

    assert percent(320, 100) == 100.0 and percent(0, 0) == 0.0 and percent(1, 4) == 25.0 and percent(-1, 4) == 0.0
