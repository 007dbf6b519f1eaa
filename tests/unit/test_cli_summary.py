"""The CLI's closing summary says what this run extracted: new samples, units planned before (a resumed or
repaired run), or nothing."""

from __future__ import annotations

from dflash_pipeline.cli import summary_lines
from dflash_pipeline.summary import RunSummary


def _store_line(**given) -> str:
    defaults = {"output_dir": "out", "store": "runs/s", "version": "v0001", "current": "v0001", "validation": "PASS"}
    s = RunSummary(**(defaults | given))
    return summary_lines(s, 1.0)[1]


def test_the_store_line_says_what_this_run_extracted():
    assert "(256 new samples, 19,525 tokens extracted now; validation PASS)" in _store_line(
        new_samples=256, tokens_extracted=19525
    )
    # after `verify --repair` discarded a unit (or a run was cut short), the rerun extracts planned samples again
    repaired = _store_line(new_samples=0, tokens_extracted=19525)
    assert "no new samples; 19,525 tokens of units planned before (unfinished, repaired or deleted by retention) " in (
        repaired
    )
    assert "0 new samples" not in repaired
    assert "(no new samples, nothing to extract; validation PASS)" in _store_line(new_samples=0, tokens_extracted=0)


def test_paths_on_the_console_are_relative_to_where_the_user_is(tmp_path, monkeypatch):
    from dflash_pipeline.progress import shown

    monkeypatch.chdir(tmp_path)
    assert shown(tmp_path / "runs" / "embedded") == "runs/embedded"  # resolved once to absolute, shown as typed
    assert shown("/elsewhere/store") == "/elsewhere/store"
    assert shown("s3://bucket/store") == "s3://bucket/store" and shown("runs/x") == "runs/x"
    s = RunSummary(output_dir=str(tmp_path / "runs/e"), store=str(tmp_path / "runs/e/store"), version="v0001")
    assert summary_lines(s, 1.0)[:2] == [
        "done in 1 s; outputs under runs/e",
        "store: runs/e/store version v0001 (no new samples, nothing to extract; validation not run; CURRENT is not "
        "set)",
    ]


def test_the_store_line_points_to_the_reader_only_where_its_default_reads_the_version():
    """A fresh-user check: the line said "read it with HiddenStateDataset" after a run without validate (no CURRENT)
    and after retention had deleted the data, where that read fails."""
    hint = "read it with dflash_pipeline.storage.reader.HiddenStateDataset"
    assert hint in _store_line(new_samples=1, tokens_extracted=10)
    assert hint not in _store_line(current=None, validation=None)
    assert hint not in _store_line(validation="FAIL")
    s = RunSummary(output_dir="o", store="s", version="v0001", current="v0001", validation="PASS", bytes_freed=4096)
    s.retention = "retention after_export: v0001: 2 of 2 units' data deleted so far (0.0 MiB freed)"
    lines = summary_lines(s, 1.0)
    assert hint not in lines[1] and s.retention in lines


def test_the_store_line_names_the_version_written_not_the_published_one():
    """An incremental run without validate writes v0002 while readers stay on v0001 (a damage hunt found the line
    naming v0001, the version CURRENT still named)."""
    line = _store_line(version="v0002", current="v0001", validation=None, new_samples=79, tokens_extracted=5000)
    assert "version v0002 (79 new samples, 5,000 tokens extracted now; validation not run; CURRENT is v0001)" in line
    assert "CURRENT" not in _store_line(new_samples=1, tokens_extracted=10)  # validated and published: the same


def test_the_summary_says_which_versions_were_pruned():
    s = RunSummary(output_dir="out", store="s", version="v0003", current="v0003", validation="PASS", pruned=["v0001"])
    assert "pruned older store versions: v0001 (extract.keep_versions)" in summary_lines(s, 1.0)


def test_plan_prints_its_report_and_warnings_only():
    """`plan`'s output is its report: the stages' INFO lines (the prepare stage's summary, with its Python dicts)
    belong to a run's UI, not under the report; warnings still show, as one line each."""
    import subprocess
    import sys

    code = (
        "import argparse, logging; from dflash_pipeline.cli import _console_logging\n"
        "for command in ('plan', 'verify'):\n"
        "    logging.getLogger().handlers.clear()\n"
        "    _console_logging(argparse.Namespace(command=command, verbose=False))\n"
        "    logging.getLogger('dflash_pipeline.dataprep.prepare').info(command + ' info')\n"
        "    logging.getLogger('dflash_pipeline.dataprep.prepare').warning(command + ' warned')\n"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.splitlines() == ["WARNING: plan warned", "verify info", "WARNING: verify warned"], err


def test_the_summary_gives_the_acceptance_length_of_each_slice():
    s = RunSummary(
        output_dir="out", store="s", acceptance_length=3.5, acceptance_by={"domain": {"code": 4.123, "chat": 2.9}}
    )
    assert "acceptance length by domain: code 4.12, chat 2.90" in summary_lines(s, 1.0)


def test_output_into_a_closed_pipe_stops_quietly():
    """`dflash-pipeline verify ... | head -1` (found by a damage check): the reader leaving ended in a BrokenPipeError
    traceback; now the command stops quietly with 141, as a shell's tools do."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    try:
        res = subprocess.run(
            [sys.executable, "-m", "dflash_pipeline.cli", "show-config"], stdout=w, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(w)
    assert res.returncode == 141 and res.stderr == "", res.stderr[-500:]


def test_a_failed_validation_leaves_its_summary_saying_so():
    """A night whose validation failed: its run-summary said 'validation not run' and 'CURRENT after: None' while
    CURRENT still named the published version (a fresh-user check of the nightly deployment)."""
    from dflash_pipeline.errors import StoreError, ValidationFailed

    s = RunSummary(output_dir="out", store="s", version="v0002", previous_current="v0002")
    s.record_failure(ValidationFailed("store v0002 failed validation: integrity: ..."))
    assert s.validation == "FAIL" and s.current == "v0002"
    other = RunSummary(output_dir="out", store="s", previous_current="v0001")
    other.record_failure(StoreError("the store lock is held"))
    assert other.validation is None and other.current == "v0001"
