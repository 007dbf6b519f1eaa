"""Imported at start-up by every Python process whose PYTHONPATH starts with this folder (tests/e2e/test_signals):
with DFLASH_TEST_FORWARD_SLEEP=S, each extraction forward (storage.commit.crash_point("forward")) takes S seconds
longer, so a test can signal a run while it is surely extracting. The pre-flight plan's calibration (a scratch
store, inside storage.commit.crash_points_off) is not slowed: only the run's own extraction needs to be."""

import os

if os.environ.get("DFLASH_TEST_FORWARD_SLEEP"):
    import time

    from dflash_pipeline.storage import commit

    _crash_point = commit.crash_point
    _sleep = float(os.environ["DFLASH_TEST_FORWARD_SLEEP"])

    def crash_point(point: str) -> None:
        if point == "forward" and not commit._paused:
            time.sleep(_sleep)
        _crash_point(point)

    commit.crash_point = crash_point
