"""The repository speaks of the project alone: a figure or a decision is cited by its topic, date or commit, never by
the working session that made it, the machine kinds of a GPU-lending service or what such a service's budget allowed.
These words mean nothing to a reader of this repository, so no tracked text file may carry them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Built from pieces so that this file does not match itself.
WORDS = re.compile(
    "|".join(
        (
            r"\bsessions? " + r"[0-9]",  # a session's number, one or several
            r"\bsession-" + r"[0-9]",  # the same, hyphenated
            r"nvidia-h" + r"(100|200)",  # the lending service's kind names
            r"device " + r"(minutes|time|budget)",
            r"budget_" + r"left",
        )
    ),
    re.IGNORECASE,
)


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.is_file() and b"\0" not in p.read_bytes()[:8192]]


def test_no_tracked_text_file_speaks_of_sessions_or_lent_machines():
    found = []
    for path in tracked_text_files():
        if path == Path(__file__).resolve():  # its own examples of what it refuses
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if WORDS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, (
        "these lines cite a working session, a lent machine kind or its budget; cite the topic and date (e.g. "
        "'bench/RESULTS.md, Training, 2026-12-06') or the commit instead, and name hardware as 'one H100 80GB':\n"
        + "\n".join(found[:50])
    )


def test_the_pattern_finds_what_it_guards_against():
    s, n = "session", "nvidia"
    bad = (f"see {s.title()} 12", f"{s}s 25 to 27", f"the {s}-3 defaults", f"{n.upper()}-H200-x2")
    bad += ("30 device " + "minutes",)
    for line in bad:
        assert WORDS.search(line), line
    for line in ("one Prefect harness per session", "a session of its own", "one H100 80GB", "GPU time"):
        assert not WORDS.search(line), line
