"""Writes one unit's hidden states, a whole store shard at a time, under the commit protocol.

Protocol (per unit; one writer process per unit):
1. Token rows arrive in storage order and fill an in-memory buffer covering exactly one store shard.
2. A full buffer is written as one whole shard (no read-modify-write), retried on I/O errors.
3. Only then commit.json is atomically replaced with committed_tokens = end of that shard.
A sample is stored once committed_tokens >= its start + length. After a crash, a new writer starts
at committed_tokens (a shard boundary); anything written past it is overwritten, and orphan temp files
are removed. Writes run on a background thread so the producer (the GPU) keeps going; at most
`max_pending` shards are in flight, which bounds host memory by (max_pending + 1) shards.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tenacity import before_sleep_log, retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from storage.commit import crash_point, read_json, remove_partials, write_json_atomic
from storage.layout import DTYPES

log = logging.getLogger(__name__)


class UnitWriter:
    def __init__(self, unit_dir: Path, io_retries: int = 5, max_pending: int = 2, background: bool = True):
        import zarr

        self.dir = Path(unit_dir)
        n = remove_partials(self.dir)
        if n:
            log.info("removed %d orphan partial files in %s", n, self.dir)
        g = zarr.open_group(str(self.dir), mode="r+", zarr_format=3)
        attrs = dict(g.attrs)
        assert attrs.get("planned"), f"unit {self.dir} was never fully planned"
        self.hidden = g["hidden"]
        self.last = g["last_hidden"] if "last_hidden" in g else None
        self.n_tokens: int = attrs["n_tokens"]
        self.shard_tokens: int = attrs["shard_tokens"]
        self.samples = attrs["samples"]
        self.stored_dtype = DTYPES[attrs["logical_dtype"]][0]
        rec = read_json(self.dir / "commit.json", {"committed_tokens": 0, "complete": False})
        self.committed: int = rec["committed_tokens"]
        self.complete: bool = rec["complete"]
        assert self.committed % self.shard_tokens == 0 or self.committed == self.n_tokens, rec
        self._next = self.committed  # next absolute token position the buffer expects
        self._buf_start = self.committed
        self._bufs: list[np.ndarray | None] = []
        self._new_buffer()
        self._io_retries = io_retries
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="store-writer") if background else None
        self._pending: list[Future] = []
        self._max_pending = max_pending
        self._lock = threading.Lock()

    @property
    def resume_token(self) -> int:
        """Tokens before this are committed; the producer may start anywhere at or before it."""
        return self.committed

    def _new_buffer(self) -> None:
        size = min(self.shard_tokens, self.n_tokens - self._buf_start)
        k, h = self.hidden.shape[1:]
        self._h = np.empty((size, k, h), dtype=self.stored_dtype)
        self._l = np.empty((size, h), dtype=self.stored_dtype) if self.last is not None else None
        self._fill = 0

    def add(self, start: int, hidden: np.ndarray, last: np.ndarray | None = None) -> None:
        """Rows for absolute token positions [start, start + len(hidden)) in storage order."""
        assert (last is None) == (self.last is None), "last_hidden given iff the store captures it"
        end = start + len(hidden)
        assert start <= self._next, f"gap: expected token {self._next}, got {start}"
        if end <= self._next:
            return  # already committed before a restart
        skip = self._next - start
        hidden = hidden[skip:]
        last = last[skip:] if last is not None else None
        while len(hidden):
            room = len(self._h) - self._fill
            take = min(room, len(hidden))
            self._h[self._fill : self._fill + take] = hidden[:take]
            if last is not None:
                self._l[self._fill : self._fill + take] = last[:take]
                last = last[take:]
            self._fill += take
            self._next += take
            hidden = hidden[take:]
            if self._fill == len(self._h):
                self._submit()

    def _submit(self) -> None:
        start, h, l = self._buf_start, self._h, self._l
        self._buf_start += len(h)
        if self._buf_start < self.n_tokens:
            self._new_buffer()
        if self._pool is None:
            self._write_and_commit(start, h, l)
            return
        self._reap(block_until=self._max_pending - 1)
        self._pending.append(self._pool.submit(self._write_and_commit, start, h, l))

    def _reap(self, block_until: int) -> None:
        while len(self._pending) > block_until:
            self._pending.pop(0).result()  # re-raises a write failure in the producer

    def _write_and_commit(self, start: int, h: np.ndarray, l: np.ndarray | None) -> None:
        end = start + len(h)

        @retry(retry=retry_if_exception_type(OSError), stop=stop_after_attempt(self._io_retries),
               wait=wait_exponential(multiplier=0.5, max=10), reraise=True,
               before_sleep=before_sleep_log(log, logging.WARNING))
        def write() -> None:
            self.hidden[start:end] = h
            if l is not None:
                self.last[start:end] = l

        write()
        crash_point("after_shard_write")
        with self._lock:  # commits are issued in order by the single writer thread
            self.committed = end
            self.complete = end == self.n_tokens
            write_json_atomic(self.dir / "commit.json",
                              {"committed_tokens": end, "complete": self.complete,
                               "committed_samples": sum(1 for _, s, n in self.samples if s + n <= end)},
                              before_rename=lambda: crash_point("during_commit"))

    def finish(self) -> None:
        """Wait for all writes; the unit is then complete. (The last buffer is sized to the unit's
        remaining tokens, so `add` has already submitted it.)"""
        assert self._next == self.n_tokens, f"unit {self.dir.name}: finish() at token {self._next} of {self.n_tokens}"
        self.close()
        assert self.complete, "all tokens written but commit record not complete"

    def close(self) -> None:
        if self._pool is not None:
            self._reap(block_until=0)
            self._pool.shutdown(wait=True)
            self._pool = None
