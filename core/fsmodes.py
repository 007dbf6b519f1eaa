"""File modes of what a run writes through temporary names: `tempfile.mkdtemp` makes its directory 0700, so a prepared
dataset, a checkpoint or an export renamed into place from one would be private to its owner, while a plain mkdir
gives 0777 less the umask (a team's outputs readable by the group the umask allows; a fresh-user check found
`prepared/` and `checkpoints/step-*` at 0700)."""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, which is not thread-safe: the fallback)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def as_made(path: Path) -> None:
    """Give `path` the mode a plain mkdir (a directory) or open (a file) would have given it."""
    path.chmod((0o777 if path.is_dir() else 0o666) & ~umask())
