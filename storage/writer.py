"""Writes one unit's hidden states, a whole store shard at a time, under the commit protocol.

Protocol (per unit; one writer process per unit):
1. Token rows arrive in storage order and fill an in-memory buffer covering exactly one store shard.
2. A full buffer is written as one whole shard (no read-modify-write), retried on I/O errors.
3. Only then commit.json is atomically replaced with committed_tokens = end of that shard, and the list of
   every file the unit commits (the planner's files and each committed shard) with its size and XXH3-128 digest.
A sample is stored once committed_tokens >= its start + length. After a crash, a new writer starts
at committed_tokens (a shard boundary); anything written past it is overwritten, and orphan temp files
are removed.

Throughput: one H200 on an 8B-class target produces ~1.6 GB/s of bf16, and zstd needs several cores for
that. Writes therefore run on `threads` background threads, several shards in flight at once; in a GPU
worker each thread hands its shard to a writer process (storage/shardio.py), so that compression never
competes for the GIL with the thread that feeds the GPU. Shards may finish out of order; step 3 then
advances committed_tokens only over the contiguous prefix of written shards, so the protocol above holds
unchanged. At most max_pending = threads + 1 shards are in flight and shard buffers are recycled
(BufferPool), which bounds host memory by 2 (max_pending + 1) shards (`buffer_bytes`: buffers plus encoded
copies in flight) whatever the unit or dataset size.

zarr-python's own write path tops out near 0.6 GB/s per process, compression or not (measured on the GPU
host, bench/RESULTS.md): its sharding encoder runs on one event-loop thread under the GIL and copies each
shard several times into fresh memory. For the codec chain storage/layout.py creates, _ShardFile encodes
a whole shard itself, in the byte layout of zarr's sharding codec (chunks compressed by zarr's own Blosc
codec object, each followed by its CRC32C, then the chunk index and its CRC32C), with the GIL released
while compressing; zarr reads it back like any shard (the tests check both ways). Any other codec chain
is written through zarr. Shards and commit records go through the unit's storage.location.Location: a
local directory (temp file + rename) or object storage (one PUT each).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tenacity import before_sleep_log, retry, retry_if_exception, stop_after_attempt, wait_exponential

from dflash_pipeline.storage import digest
from dflash_pipeline.storage.commit import crash_point
from dflash_pipeline.storage.layout import NOTHING_COMMITTED, SHARDED_ARRAYS, chunks_per_shard
from dflash_pipeline.storage.location import Location, StoreFull, is_resource_error, open_location, resource_error
from dflash_pipeline.storage.shardio import ShardProcesses, SharedBuffers, encode_shard

log = logging.getLogger(__name__)
_FALLBACKS_LOGGED: set[str] = set()


class _ShardFile:
    """Writes whole shards of one zarr array in the layout of zarr's sharding codec (see the module doc).

    `for_array` returns None unless the array has exactly the codec chain storage/layout.py creates:
    sharding (index at the end; index codecs bytes-little + crc32c) over bytes-little, optionally one
    Blosc codec, then crc32c, shards and chunks spanning every axis but the first. `loc` is the location
    the array's group was opened from (its shards are written there).
    """

    def __init__(self, loc: Location, path: str, meta, shard_rows: int, chunk_rows: int, blosc):
        self.loc, self.path, self.meta = loc, path, meta
        self.shard_rows, self.chunk_rows, self.blosc = shard_rows, chunk_rows, blosc

    @classmethod
    def for_array(cls, arr, loc: Location) -> _ShardFile | None:
        """The fast writer for `arr`, or None (with the reason logged once) when zarr is to write it."""
        fast = cls._match(arr, loc)
        if isinstance(fast, str):
            if fast not in _FALLBACKS_LOGGED:
                _FALLBACKS_LOGGED.add(fast)
                log.warning("writing %s through zarr's own (slower) shard writer: %s", arr.path, fast)
            return None
        return fast

    @classmethod
    def _match(cls, arr, loc: Location) -> _ShardFile | str:
        """The writer, or why this array's layout is not one it knows (then zarr writes the shards)."""
        from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec
        from zarr.codecs.sharding import ShardingCodecIndexLocation

        meta = arr.metadata
        codecs = getattr(meta, "codecs", ())
        if sys.byteorder != "little":
            return "this machine is big-endian"
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
            return f"the codec chain is not one sharding codec: {codecs!r}"
        sh = codecs[0]

        def little(c) -> bool:
            # zarr 3.1 holds the endianness as an Endian enum, zarr >= 3.2 as a plain str.
            endian = getattr(c, "endian", None)
            return isinstance(c, BytesCodec) and getattr(endian, "value", endian) in (None, "little")

        inner = list(sh.codecs)
        middle = inner[1:-1]
        if (
            sh.index_location != ShardingCodecIndexLocation.end
            or len(sh.index_codecs) != 2
            or not little(sh.index_codecs[0])
            or not isinstance(sh.index_codecs[1], Crc32cCodec)
            or len(inner) < 2
            or not little(inner[0])
            or not isinstance(inner[-1], Crc32cCodec)
            or len(middle) > 1
            or (middle and not isinstance(middle[0], BloscCodec))
        ):
            return f"the sharding codec's layout is not the one storage/layout.py creates: {sh!r}"
        blosc = getattr(middle[0], "_blosc_codec", None) if middle else None  # zarr's own numcodecs.Blosc
        if middle and blosc is None:
            return "this zarr version's BloscCodec has no numcodecs codec to compress with (_blosc_codec)"
        shard, chunk = tuple(meta.chunk_grid.chunk_shape), tuple(sh.chunk_shape)
        if (
            shard[1:] != tuple(arr.shape[1:])
            or chunk[1:] != tuple(arr.shape[1:])
            or shard[0] % chunk[0]
            or meta.fill_value != 0
        ):
            return f"shards {shard} / chunks {chunk} do not span every axis but the first of {arr.shape}"
        return cls(loc, arr.path, meta, shard[0], chunk[0], blosc)

    def key(self, start: int) -> str:
        return shard_key(self.path, self.meta, start, self.shard_rows)

    def write(
        self, start: int, rows: np.ndarray, procs: ShardProcesses | None = None, buffer: tuple | None = None
    ) -> dict | None:
        """Rows [start, start + len(rows)) of the array: one whole shard, or the array's last (shorter) one.
        With `procs`, a writer process encodes and writes them from the shared `buffer` they start. Returns
        the shard file's digest record, with its `chunks` (storage.digest.of_chunks), when this process wrote it
        (None: a writer process did)."""
        assert start % self.shard_rows == 0 and 0 < len(rows) <= self.shard_rows, (start, len(rows))
        if procs is not None:
            procs.write_shard(
                self.loc,
                self.key(start),
                buffer,
                len(rows),
                self.shard_rows,
                self.chunk_rows,
                self.blosc.get_config() if self.blosc is not None else None,
            )
            return None
        pieces = encode_shard(rows, self.shard_rows, self.chunk_rows, self.blosc)
        return {**self.loc.write_object(self.key(start), pieces), digest.CHUNKS: digest.of_encoded_chunks(pieces)}


def shard_key(path: str, meta, start: int, shard_rows: int) -> str:
    """The file (relative to the unit) of the shard of array `path` that starts at token `start`."""
    coords = (start // shard_rows,) + (0,) * (len(meta.shape) - 1)
    return f"{path}/{meta.encode_chunk_key(coords)}"


def _is_shard_file(rel: str) -> bool:
    return any(rel.startswith(f"{a}/c/") for a in SHARDED_ARRAYS)


class BufferPool:
    """Shard buffers, recycled between shards and between the units of one worker. `alloc(shape, dtype)`
    makes a new one (numpy by default; a GPU worker passes pinned host memory, so that device-to-host
    copies land in shard buffers directly). A writer holds at most max_pending + 1 at a time; with `limit`,
    at most that many of each kind exist, and `get` waits for one to come back (a worker's units overlap at
    their boundaries: one unit's last shards are written while the next unit's first ones fill)."""

    def __init__(
        self, alloc: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None, limit: int | None = None
    ):
        self.alloc = alloc or (lambda shape, dtype: np.empty(shape, dtype))
        self.limit = limit
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._made: dict[tuple, int] = {}
        self._cond = threading.Condition()

    def get(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        with self._cond:
            while not self._free.get(key) and self.limit is not None and self._made.get(key, 0) >= self.limit:
                self._cond.wait()
            if self._free.get(key):
                return self._free[key].pop()
            self._made[key] = self._made.get(key, 0) + 1
        return self.alloc(tuple(shape), np.dtype(dtype))

    def reserve(self, shape: tuple[int, ...], dtype: np.dtype, n: int) -> None:
        """Allocate now until n buffers of this kind are free (or the limit is reached)."""
        key = (tuple(shape), np.dtype(dtype).str)
        with self._cond:
            missing = n - len(self._free.get(key, []))
            if self.limit is not None:
                missing = min(missing, self.limit - self._made.get(key, 0))
            self._made[key] = self._made.get(key, 0) + max(0, missing)
        for _ in range(missing):
            self.put(self.alloc(tuple(shape), np.dtype(dtype)))

    def put(self, arr: np.ndarray) -> None:
        with self._cond:
            self._free.setdefault((arr.shape, arr.dtype.str), []).append(arr)
            self._cond.notify_all()


def _copy_rows(dst: np.ndarray, src) -> None:
    dst[...] = src


class UnitWriter:
    """`unit`: the unit's location (Store.unit_location), or the path of a local unit directory."""

    def __init__(
        self,
        unit: Location | str | Path,
        io_retries: int = 5,
        threads: int = 1,
        buffers: BufferPool | None = None,
        procs: ShardProcesses | None = None,
    ):
        """`threads` shards are written at once. With `procs` (storage/shardio.py) the threads hand each shard
        to a writer process instead of encoding it themselves; `buffers` must then allocate SharedBuffers.
        Arrays whose codec chain is not the store's own are still written through zarr on the threads."""
        self.loc = unit if isinstance(unit, Location) else open_location(unit)
        n = self.loc.remove_partials()
        if n:
            log.info("removed %d orphan partial files in %s", n, self.loc.url)
        g = self.loc.open_group(mode="r+")
        attrs = dict(g.attrs)
        assert attrs.get("planned"), f"unit {self.loc.url} was never fully planned"
        # The arrays written shard by shard (hidden; its scales in a compact precision; last_hidden and
        # its scales when captured), each with the fast shard writer when its codec chain allows.
        self.arrays = {a: g[a] for a in SHARDED_ARRAYS if a in g}
        self.hidden = self.arrays["hidden"]
        self.last = self.arrays.get("last_hidden")
        self._fast = {a: _ShardFile.for_array(arr, self.loc) for a, arr in self.arrays.items()}
        self.n_tokens: int = attrs["n_tokens"]
        self.shard_tokens: int = attrs["shard_tokens"]
        self.samples = attrs["samples"]
        rec = self.loc.read_json("commit.json", dict(NOTHING_COMMITTED))
        self.committed: int = rec["committed_tokens"]
        self.complete: bool = rec["complete"]
        assert self.committed % self.shard_tokens == 0 or self.committed == self.n_tokens, rec
        # Digest records of the files commit records list: the planner's (taken from the last commit record, or
        # read now before the first commit) and each written shard's, by shard start.
        self._static_files = self._planner_files(rec)
        self._shard_files: dict[int, dict[str, dict | None]] = {}
        for rel, d in (rec.get("files") or {}).items():
            if _is_shard_file(rel):
                arr = self.arrays[rel.split("/c/")[0]]
                start = int(rel.split("/c/")[1].split("/")[0]) * self.shard_tokens
                assert shard_key(arr.path, arr.metadata, start, self.shard_tokens) == rel, rel
                self._shard_files.setdefault(start, {})[rel] = d
        self._io_retries = io_retries
        self._buffers = buffers or BufferPool()
        self._procs = procs
        if procs is not None:
            assert isinstance(self._buffers.alloc, SharedBuffers), "writer processes need shared shard buffers"
            threads = max(threads, len(procs))
        threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(threads, thread_name_prefix="store-writer")
        self._pending: list[Future] = []
        self._max_pending = threads + 1  # shards being written; one more is being filled
        self._lock = threading.Lock()
        self._written: dict[int, int] = {}  # shard start -> end, written but not yet committed (out of order)
        self.blocked_s = 0.0  # time the producer waited for the writer (backpressure)
        self._next = self.committed  # next absolute token position the buffer expects
        self._buf_start = self.committed
        self._views = None  # {array: the slice of its shard buffer being filled}, taken from the pool on the first rows

    def _planner_files(self, rec: dict) -> dict[str, dict | None]:
        if rec.get("files"):
            return {rel: d for rel, d in rec["files"].items() if not _is_shard_file(rel)}
        files = {}
        for rel in sorted(self.loc.list_files()):
            if rel == "commit.json" or rel.endswith(".partial") or _is_shard_file(rel):
                continue
            files[rel] = self.loc.digest_of(rel)
        return files

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row over every sharded array, as stored (before compression)."""
        return sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in self.arrays.values())

    def _remaining_bytes(self) -> int:
        return (self.n_tokens - self.committed) * self.row_bytes

    @property
    def resume_token(self) -> int:
        """Tokens before this are committed; the producer may start anywhere at or before it."""
        return self.committed

    @property
    def buffer_bytes(self) -> int:
        """Bound on the host memory for rows in flight: (max_pending + 1) shard buffers (also the pool's
        limit in a worker, whose consecutive units share them), plus the encoded copy of each shard being
        written (at most a shard each; ~0.7 of one with zstd)."""
        return 2 * (self._max_pending + 1) * self.shard_tokens * self.row_bytes

    def reserve_buffers(self) -> None:
        """Allocate the shard buffers this writer can hold at once now rather than on the first shards (a
        GPU worker does it while the model loads: page-locking them takes about a second)."""
        for a in self.arrays.values():
            self._buffers.reserve((self.shard_tokens, *a.shape[1:]), a.dtype, self._max_pending + 1)

    @property
    def idle(self) -> bool:
        """Every shard handed over so far is written and committed (or failed: finish() raises)."""
        return all(f.done() for f in self._pending)

    def _new_buffer(self) -> None:
        size = min(self.shard_tokens, self.n_tokens - self._buf_start)
        self._bufs = {
            a: self._buffers.get((self.shard_tokens, *arr.shape[1:]), arr.dtype) for a, arr in self.arrays.items()
        }
        self._views = {a: buf[:size] for a, buf in self._bufs.items()}
        self._fill = 0
        self._size = size

    def add(
        self, start: int, hidden, last=None, copy: Callable[[np.ndarray, object], None] = _copy_rows, **more
    ) -> None:
        """Rows for absolute token positions [start, start + len(hidden)) in storage order: `hidden`, `last`
        (last_hidden) and, as keywords, the other sharded arrays the unit has (hidden_scale, last_hidden_scale).
        The rows are copied, by `copy(dst, src)` into slices of the shard buffers (default: numpy assignment;
        the GPU worker passes a device-to-host copy, with device tensors as the rows): the caller may reuse its
        arrays as soon as this returns."""
        rows = {"hidden": hidden, **({"last_hidden": last} if last is not None else {}), **more}
        assert rows.keys() == self.arrays.keys(), f"rows for {sorted(rows)}, the unit has {sorted(self.arrays)}"
        end = start + len(hidden)
        assert start <= self._next, f"gap: expected token {self._next}, got {start}"
        if end <= self._next:
            return  # already committed before a restart
        skip = self._next - start
        rows = {a: r[skip:] for a, r in rows.items()}
        left = end - self._next
        while left:
            if self._views is None:
                t0 = time.monotonic()
                self._new_buffer()  # may wait for a buffer the worker's previous unit is still writing
                self.blocked_s += time.monotonic() - t0
            take = min(self._size - self._fill, left)
            for a, r in rows.items():
                copy(self._views[a][self._fill : self._fill + take], r[:take])
            rows = {a: r[take:] for a, r in rows.items()}
            self._fill += take
            self._next += take
            left -= take
            if self._fill == self._size:
                self._submit()

    def _submit(self) -> None:
        start, views, bufs = self._buf_start, self._views, self._bufs
        self._buf_start += self._size
        # Wait first, then submit; the next rows take the next buffer: at most max_pending buffers are
        # being written and one is being filled.
        t0 = time.monotonic()
        self._reap(block_until=self._max_pending - 1)
        self.blocked_s += time.monotonic() - t0
        self._pending.append(self._pool.submit(self._write_and_commit, start, views, bufs))
        self._views = None

    def _reap(self, block_until: int) -> None:
        while len(self._pending) > block_until:
            self._pending.pop(0).result()  # re-raises a write failure in the producer

    def _write_and_commit(self, start: int, views: dict[str, np.ndarray], bufs: dict[str, np.ndarray]) -> None:
        end = start + len(views["hidden"])

        @retry(
            retry=retry_if_exception(lambda e: isinstance(e, OSError) and not is_resource_error(e)),
            stop=stop_after_attempt(self._io_retries),
            wait=wait_exponential(multiplier=0.5, max=10),
            reraise=True,
            before_sleep=before_sleep_log(log, logging.WARNING),
        )
        def write() -> dict[str, dict | None]:
            written = {}
            for name, arr in self.arrays.items():
                rows, buf = views[name], bufs[name]
                key = shard_key(arr.path, arr.metadata, start, self.shard_tokens)
                if self._fast[name] is None:
                    arr[start:end] = rows
                    d = None
                elif self._procs is not None:
                    d = self._fast[name].write(start, rows, self._procs, self._buffers.alloc.where(buf))
                else:
                    d = self._fast[name].write(start, rows)
                # Written by zarr or by a writer process: digest the file as stored (None: zarr wrote no file
                # because every value is the fill value; it reads back as those values, correctly).
                if d is None and (d := self.loc.digest_of(key)) is not None:  # and what the default reader checks
                    d[digest.CHUNKS] = self.loc.chunks_of(key, d["size"], chunks_per_shard(arr))
                written[key] = d
            return written

        try:
            written = write()
        except StoreFull as e:
            raise self._still_needs(e) from e
        except OSError as e:
            err = resource_error(e, self.loc.url, self._remaining_bytes())
            if err is None:
                raise
            raise err from e
        crash_point("after_shard_write")
        for buf in bufs.values():
            self._buffers.put(buf)
        with self._lock:  # one commit at a time, each covering every shard written before it
            self._shard_files[start] = written
            self._written[start] = end
            advanced = False
            while self.committed in self._written:
                self.committed = self._written.pop(self.committed)
                advanced = True
            if not advanced:
                return  # an earlier shard is still being written; its commit will cover this one
            self.complete = self.committed == self.n_tokens
            committed = self.committed
            try:
                self._write_commit(committed)
            except StoreFull as e:  # the disk can fill at the commit record as well as at a shard
                raise self._still_needs(e) from e

    def _still_needs(self, e: StoreFull) -> StoreFull:
        return StoreFull(
            f"{e}. This unit ({self.loc.url}) still needs up to {self._remaining_bytes() / 2**20:.1f} MiB "
            "(uncompressed; about 0.7 of that with zstd)"
        )

    def _write_commit(self, committed: int) -> None:
        """commit.json: the tokens committed and every file up to them with its digest (under the lock)."""
        self.loc.write_json_atomic(
            "commit.json",
            {
                "committed_tokens": committed,
                "complete": self.complete,
                "committed_samples": sum(1 for _, s, n in self.samples if s + n <= committed),
                "algorithm": digest.ALGORITHM,
                "files": dict(
                    sorted(
                        {
                            **self._static_files,
                            **{k: d for s0, fs in self._shard_files.items() if s0 < committed for k, d in fs.items()},
                        }.items()
                    )
                ),
            },
            before_commit=lambda: crash_point("during_commit"),
        )

    def finish(self) -> None:
        """Wait for all writes; the unit is then complete. (The last buffer is sized to the unit's
        remaining tokens, so `add` has already submitted it.)"""
        assert self._next == self.n_tokens, f"unit {self.loc.url}: finish() at token {self._next} of {self.n_tokens}"
        self.close()
        assert self.complete, "all tokens written but commit record not complete"

    def close(self) -> None:
        if self._pool is not None:  # idempotent: finish() closes, and callers close again in `finally`
            self._reap(block_until=0)
            self._pool.shutdown(wait=True)
            self._pool = None
