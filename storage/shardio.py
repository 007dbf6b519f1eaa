"""Store-writer processes: shards are compressed and written outside the process that feeds the GPU.

Why processes: a GPU worker's main thread launches each forward's kernels, and with the writer on threads
of the same process it queues for the GIL behind them between compression calls (one H200, 8B shape with
the RMSNorms compiled: 31.7k tokens/s on threads, 34.1k with processes; bench/RESULTS.md run 11). Here the
GPU worker only copies rows into shard buffers; separate processes, each with its own interpreter, compress
and write whole shards.

- SharedBuffers allocates shard buffers as files in shared memory (/dev/shm), mapped by the worker and by
  the writer processes. A GPU worker registers them with CUDA (`pin`), so device-to-host copies land in
  them by DMA, and no byte of a shard is copied between processes.
- ShardProcesses runs `python -m storage.shardio` children, each serving one request at a time over its
  stdin/stdout: "encode rows [0, n) of this buffer as one shard and write it to this key", answered with
  "done" or the exception (an OSError stays an OSError, so the caller's I/O retries still apply).
  A child exits when its stdin closes, so a killed worker leaves no writer behind.

Only light modules are imported here (no torch, no zarr): a child starts in a fraction of a second.
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from dflash_pipeline.errors import StoreError

_EMPTY = np.uint64(2**64 - 1)  # the sharding index's marker for a chunk not stored


def encode_shard(rows: np.ndarray, shard_rows: int, chunk_rows: int, blosc, pool: Executor | None = None) -> list:
    """The bytes of one shard in the layout of zarr's sharding codec (storage/writer.py's _ShardFile):
    chunks of `chunk_rows` rows, each compressed by `blosc` (a numcodecs.Blosc, or None) and followed by its
    CRC32C, then the chunk index and its CRC32C. The last chunk of a short shard is padded with zeros.
    With `pool`, chunks are compressed on its threads (Blosc releases the GIL); the bytes are the same."""
    import google_crc32c

    def encode(i: int):
        chunk = np.ascontiguousarray(rows[i * chunk_rows : (i + 1) * chunk_rows])
        if len(chunk) < chunk_rows:  # the array's last chunk is stored whole, padded with the fill value
            padded = np.zeros((chunk_rows, *rows.shape[1:]), dtype=rows.dtype)
            padded[: len(chunk)] = chunk
            chunk = padded
        data = blosc.encode(chunk) if blosc is not None else chunk
        return data, struct.pack("<I", google_crc32c.value(data))

    n_chunks = -(-len(rows) // chunk_rows)
    encoded = pool.map(encode, range(n_chunks)) if pool is not None else map(encode, range(n_chunks))
    index = np.full((shard_rows // chunk_rows, 2), _EMPTY, dtype="<u8")
    pieces: list = []
    offset = 0
    for i, (data, crc) in enumerate(encoded):
        n = memoryview(data).nbytes
        pieces += [data, crc]
        index[i] = (offset, n + 4)
        offset += n + 4
    index_bytes = index.tobytes()
    return pieces + [index_bytes, struct.pack("<I", google_crc32c.value(index_bytes))]


# ---- shard buffers in shared memory -----------------------------------------------------------------


def _shm_dir() -> Path:
    p = Path("/dev/shm")
    return p if p.is_dir() and os.access(p, os.W_OK) else Path(tempfile.gettempdir())


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedBuffers:
    """An allocator for storage.writer.BufferPool: numpy arrays backed by files in shared memory, named so
    that a writer process can map them (`where`). `pin(array)` (optional) registers an array for DMA and
    returns the function that unregisters it. Files of workers that died (SIGKILL) are removed on start."""

    PREFIX = "dflash-shard-"

    def __init__(self, pin: Callable[[np.ndarray], Callable[[], None]] | None = None, directory: Path | None = None):
        self.dir = directory or _shm_dir()
        self._pin = pin
        self._n = itertools.count()
        self._bufs: dict[int, tuple[str, tuple[int, ...], str]] = {}  # data address -> (path, shape, dtype)
        self._unpin: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        for f in self.dir.glob(f"{self.PREFIX}*"):
            pid = f.name[len(self.PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                f.unlink(missing_ok=True)

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        path = self.dir / f"{self.PREFIX}{os.getpid()}-{next(self._n)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:  # reserve the pages now: a full tmpfs must fail here, not with SIGBUS mid-copy
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                path.unlink(missing_ok=True)
                raise StoreError(
                    f"cannot reserve {nbytes / 2**20:.0f} MiB in {self.dir} for a store-writer "
                    f"shard buffer ({e.strerror}). A GPU worker's writer processes need about "
                    "(writers + 2) shard buffers of shared memory: enlarge /dev/shm (docker run "
                    "--shm-size with at least 3 GiB per GPU), lower extract.shard_mib, or set "
                    "extract.store_writers: threads"
                ) from e
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        arr = np.frombuffer(mm, dtype=dtype).reshape(shape)
        with self._lock:
            self._bufs[arr.__array_interface__["data"][0]] = (str(path), tuple(shape), np.dtype(dtype).str)
            if self._pin is not None:
                self._unpin.append(self._pin(arr))
        return arr

    def free_bytes(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def where(self, buf: np.ndarray) -> tuple[str, tuple[int, ...], str]:
        """(file, shape, dtype) of a buffer this allocator made."""
        return self._bufs[buf.__array_interface__["data"][0]]

    def close(self) -> None:
        """Unregister and delete the files (the arrays must not be used after this)."""
        with self._lock:
            for unpin in self._unpin:
                unpin()
            self._unpin.clear()
            for path, _, _ in self._bufs.values():
                Path(path).unlink(missing_ok=True)
            self._bufs.clear()


# ---- the writer processes ---------------------------------------------------------------------------


def _send(f, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _recv(f) -> Any:
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


class ShardProcesses:
    """`n` writer processes, each compressing a shard's chunks on `threads` threads. `write_shard` blocks its
    calling thread (a storage.writer thread, which waits without the GIL) until a process has written the
    shard; up to `n` calls run at once."""

    def __init__(self, n: int, threads: int = 1):
        env = dict(os.environ)
        self._procs = [
            subprocess.Popen(
                [sys.executable, "-m", "dflash_pipeline.storage.shardio", str(max(1, threads))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            for _ in range(max(1, n))
        ]
        self._idle: queue.Queue = queue.Queue()
        for p in self._procs:
            self._idle.put(p)

    def __len__(self) -> int:
        return len(self._procs)

    def write_shard(
        self,
        loc,
        key: str,
        buffer: tuple[str, tuple[int, ...], str],
        n_rows: int,
        shard_rows: int,
        chunk_rows: int,
        blosc_config: dict | None,
    ) -> None:
        """Rows [0, n_rows) of the shared `buffer` (SharedBuffers.where) as one shard at `key` of `loc`."""
        p = self._idle.get()
        try:
            _send(p.stdin, (loc, key, buffer, n_rows, shard_rows, chunk_rows, blosc_config))
            ok, err = _recv(p.stdout)
        except (BrokenPipeError, EOFError):
            raise RuntimeError(
                f"store-writer process {p.pid} died (exit code {p.wait()}); its shard was not "
                "committed, and a rerun redoes it. Check the host's memory (the OOM killer) "
                "and the worker's log"
            ) from None
        finally:
            self._idle.put(p)
        if not ok:
            raise err

    def close(self) -> None:
        for p in self._procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self._procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _serve(threads: int) -> None:
    """A writer process's loop: one request at a time until stdin closes; a shard's chunks are compressed on
    `threads` threads."""
    import numcodecs
    from numcodecs import blosc

    # Not Blosc's own threads: they write a chunk's blocks in the order they finish (the same data, other
    # bytes on each run); chunks compressed on our threads are placed in order, so a shard's bytes are
    # reproducible.
    blosc.use_threads = False
    pool = ThreadPoolExecutor(threads, thread_name_prefix="chunk") if threads > 1 else None
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not corrupt the replies
    inp = sys.stdin.buffer
    maps: dict[str, np.ndarray] = {}
    locs: dict[str, Any] = {}
    codecs: dict[str, Any] = {}
    while True:
        try:
            loc, key, (path, shape, dtype), n_rows, shard_rows, chunk_rows, blosc_config = _recv(inp)
        except EOFError:
            return
        try:
            if path not in maps:
                maps[path] = np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=shape)
            loc = locs.setdefault(loc.url, loc)  # keeps an object store's connection across shards
            ck = repr(sorted(blosc_config.items())) if blosc_config else ""
            if blosc_config and ck not in codecs:
                codecs[ck] = numcodecs.get_codec(dict(blosc_config))
            loc.write_object(key, encode_shard(maps[path][:n_rows], shard_rows, chunk_rows, codecs.get(ck), pool))
            reply: tuple = (True, None)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
            e.add_note(f"in store-writer process {os.getpid()}:\n{traceback.format_exc()}")
            try:
                pickle.dumps(e)
                reply = (False, e)
            except Exception:  # noqa: BLE001
                reply = (False, RuntimeError(f"store-writer process: {type(e).__name__}: {e}"))
        _send(out, reply)


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
