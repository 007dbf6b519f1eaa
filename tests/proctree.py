"""The process tree, read from /proc (Linux): what a run started and whether it is gone."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _ppid_and_cmd(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited, unless other threads of it still run (and hold its files and locks)
        try:
            if len(os.listdir(f"/proc/{pid}/task")) <= 1:
                return None
        except OSError:
            return None
    try:  # a process in the middle of exiting may have no command line left, and still hold its files
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return int(fields[1]), cmd


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) descendant of `pid`."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (info := _ppid_and_cmd(int(d))):
            table[int(d)] = info
    out, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for p, (pp, cmd) in table.items():
            if pp == parent and p not in out:
                out[p] = cmd
                todo.append(p)
    return out


def alive(pids) -> dict[int, str]:
    """Those of `pids` still running (not zombies), with their command lines."""
    return {p: info[1] for p in pids if (info := _ppid_and_cmd(p))}


def wait_gone(pids, timeout: float) -> dict[int, str]:
    """Wait until none of `pids` runs; returns those left after `timeout` s."""
    deadline = time.monotonic() + timeout
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
