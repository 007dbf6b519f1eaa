"""Where a store lives: a local directory, or a prefix of an S3-compatible bucket (AWS S3, MinIO, Ceph...).

This is the only module that knows the difference. The layout and the commit protocol are the same on
both; what provides each guarantee differs (docs/STORE.md, "Object storage"):

- a record (commit.json, CURRENT) is replaced atomically: locally temp file + fsync + rename + directory
  fsync; on object storage one PUT (readers see the old or the new object, never a torn one);
- a shard is never torn, and is durable before its commit record: temp file + fsync + rename + directory
  fsync; one PUT (or one multipart upload, also all or nothing);
- orphans of a killed writer: `*.partial` temp files, removed; unfinished multipart uploads, aborted;
- a snapshot shares the complete units: hard links; server-side copies (S3 has no links);
- one run per store: flock (dies with its process); a lease object created by a conditional PUT
  (If-None-Match: *), renewed by a heartbeat, taken over only once it has expired.

Credentials come only from the standard AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN, AWS_PROFILE with ~/.aws, an instance role); `options` are the non-secret fsspec/s3fs
options (endpoint_url, client_kwargs, config_kwargs...), the same dict zarr's `storage_options` takes.
The endpoint can also come from AWS_ENDPOINT_URL (botocore reads it). The S3 half is storage/s3.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import commit, digest

Buffers = Sequence[Any]  # bytes-like pieces written one after the other


# Errors no retry can fix: the filesystem is full, over quota, read-only, or forbids writing.
_RESOURCE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only"}


class StoreFull(StoreError):
    """The store's filesystem is full, over quota or read-only: retrying cannot help (never retried)."""


def is_resource_error(e: BaseException) -> bool:
    """An OS error that no retry can fix (full, over quota, read-only, not permitted)."""
    return isinstance(e, OSError) and e.errno in (*_RESOURCE_ERRNOS, errno.EACCES, errno.EPERM)


def resource_error(e: OSError, path: str | Path, nbytes: int | None = None) -> StoreError | None:
    """A StoreFull naming `path` (and the space that write needed) for an exhausted or read-only filesystem;
    None for other OS errors (those may be transient and are retried)."""
    if not is_resource_error(e):
        return None
    try:
        free = shutil.disk_usage(next(p for p in Path(path).parents if p.exists())).free
        where = f"{free / 2**20:.1f} MiB free there"
    except (OSError, StopIteration):
        where = "free space unknown"
    need = f" of {nbytes / 2**20:.1f} MiB" if nbytes is not None else ""
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StoreFull(
            f"store path {path} cannot be written ({e.strerror}): the store is read-only for this run; "
            "fix its permissions or mount, or choose another store_path. Nothing was committed past the "
            "last commit record, so a rerun resumes there"
        )
    return StoreFull(
        f"{_RESOURCE_ERRNOS[e.errno]} writing {path}{need} ({where}). Free space on that filesystem (or "
        "raise the quota) and rerun: the store is consistent up to its last commit record and the rerun "
        "resumes there"
    )


def is_remote(url: str | Path) -> bool:
    return "://" in str(url) and not str(url).startswith("file://")


def open_location(url: str | Path, options: dict[str, Any] | None = None) -> Location:
    """`url`: a local path, file:///path, or s3://bucket[/prefix]."""
    url = str(url)
    if url.startswith("file://"):
        url = url[len("file://") :]
    if not is_remote(url):
        if options:
            raise StoreError(
                f"store_options {sorted(options)} were given for the local store path {url}; they "
                "only apply to an s3:// store_path"
            )
        return LocalLocation(Path(url))
    scheme = url.split("://", 1)[0]
    if scheme not in ("s3", "s3a"):
        raise StoreError(
            f"store path {url}: only local paths and s3:// URLs (AWS S3, MinIO and other "
            f"S3-compatible object storage) are supported, not {scheme}://"
        )
    from dflash_pipeline.storage.s3 import S3Location  # s3fs is imported only for an s3:// store

    return S3Location(url, dict(options or {}))


class Location(ABC):
    """A directory-like root. `rel` arguments are '/'-separated paths below it ('' = the root itself)."""

    url: str

    @abstractmethod
    def child(self, rel: str) -> Location: ...

    @abstractmethod
    def url_of(self, rel: str = "") -> str: ...

    @abstractmethod
    def read_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or None if it does not exist."""

    @abstractmethod
    def write_atomic(self, rel: str, data: bytes, before_commit: Callable[[], None] | None = None) -> None:
        """Replace a small record durably and atomically: readers see the old or the new one, never a torn
        one. `before_commit` runs when the new record is ready but not yet visible (fault injection)."""

    @abstractmethod
    def write_object(self, rel: str, pieces: Buffers) -> dict[str, Any]:
        """Write a whole file (a shard) from `pieces`: it appears complete or not at all. Returns its
        storage.digest record ({'size', 'xxh3_128'}) as written."""

    @abstractmethod
    def list_files(self, rel: str = "") -> dict[str, int]:
        """{path relative to `rel`: size in bytes} of every file below `rel` ({} if it does not exist)."""

    @abstractmethod
    def size_of(self, rel: str) -> int | None:
        """The file's size in bytes, or None if it does not exist."""

    def identity(self, rel: str) -> tuple[int, ...] | None:
        """What tells this file from another of its size put in its place: (size,) here; a local file adds its
        inode and modification time. None if it does not exist."""
        size = self.size_of(rel)
        return None if size is None else (size,)

    @abstractmethod
    def digest_of(self, rel: str) -> dict[str, Any] | None:
        """storage.digest record of the file as stored now (reads it whole), or None if it does not exist."""

    @abstractmethod
    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each (offset, length) range of the file (FileNotFoundError if it does not exist)."""

    def chunks_of(self, rel: str, size: int, n_chunks: int) -> str:
        """storage.digest.of_chunks of the shard file `rel` of `size` bytes as stored now."""
        return digest.of_chunks(lambda ranges: self.read_ranges(rel, ranges), size, n_chunks)

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the sub-directories (common prefixes) of `rel`, sorted; [] if it does not exist."""

    @abstractmethod
    def rmtree(self, rel: str) -> None:
        """Delete `rel`: a file, or a directory and everything below it (nothing if it does not exist)."""

    @abstractmethod
    def copy_tree(self, src: str, dst: str) -> None:
        """Make `dst` a copy of `src` (an immutable zarr group) as cheaply as the storage allows. The group's
        own zarr.json comes last: a copy cut short by a crash is not a group (Store.units skips it, so its
        samples are planned again)."""

    @abstractmethod
    def zarr_store(self, rel: str = "", read_only: bool = False):
        """A zarr Store rooted at `rel`."""

    @abstractmethod
    def remove_partials(self, rel: str = "") -> int:
        """Remove what a killed writer left half-written below `rel`; returns how many."""

    @abstractmethod
    def lock(self, rel: str, holder: str, busy: Callable[[str], Exception]) -> Iterator[None]:
        """Context manager: exclusive use by one process. Raises `busy(recorded_holder)` if taken."""

    @abstractmethod
    def check(self, write: bool) -> None:
        """Raise StoreError, quickly and with the fix, if the location cannot be read (or written)."""

    # ---- shared on top of the primitives ----------------------------------------------------------
    def open_group(self, rel: str = "", mode: str = "r"):
        import zarr

        return zarr.open_group(store=self.zarr_store(rel, read_only=mode == "r"), mode=mode, zarr_format=3)

    def read_json(self, rel: str, default: Any = None) -> Any:
        data = self.read_bytes(rel)
        return default if data is None else json.loads(data)

    def write_json_atomic(self, rel: str, obj: Any, before_commit: Callable[[], None] | None = None) -> None:
        self.write_atomic(rel, commit.encode_json(obj), before_commit)


# ---- local directory ------------------------------------------------------------------------------


# A path that leads to no file: gone, a link to nowhere or a link loop (a damage check: a loop was a traceback), or a
# file where a directory should be. Listed as absent, so verify and readers call it missing.
_UNRESOLVED = (errno.ENOENT, errno.ELOOP, errno.ENOTDIR)


class LocalLocation(Location):
    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = str(self.root)

    def _p(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def child(self, rel: str) -> LocalLocation:
        return LocalLocation(self._p(rel))

    def url_of(self, rel: str = "") -> str:
        return str(self._p(rel))

    def read_bytes(self, rel: str) -> bytes | None:
        p = self._p(rel)
        try:  # (non-blocking: a FIFO put where a record goes hung every reader, verify and run: a damage check)
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(p))
            if not stat.S_ISREG(mode):
                raise ValueError(f"{p} is not a regular file (a FIFO, socket or device): records are plain files")
            return f.read()

    def write_atomic(self, rel: str, data: bytes, before_commit: Callable[[], None] | None = None) -> None:
        try:
            self._p(rel).parent.mkdir(parents=True, exist_ok=True)
            commit.write_atomic(self._p(rel), data, before_commit)
        except OSError as e:
            err = resource_error(e, self._p(rel), len(data))
            if err is None:
                raise
            raise err from e

    def write_object(self, rel: str, pieces: Buffers) -> dict[str, Any]:
        path = self._p(rel)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        d = digest.Digest()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:  # temp file + rename, as zarr's LocalStore: a shard is never torn
                for piece in pieces:
                    f.write(piece)
                    d.update(piece)
                f.flush()
                os.fsync(f.fileno())  # on disk before any commit record that counts it (power loss, not a kill)
            os.replace(tmp, path)
            commit.fsync_dir(path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)  # a full disk keeps no half-written temp file
            err = resource_error(e, path, sum(memoryview(p).nbytes for p in pieces))
            if err is None:
                raise
            raise err from e
        return d.record()

    def list_files(self, rel: str = "") -> dict[str, int]:
        top = self._p(rel)
        out: dict[str, int] = {}
        for dirpath, _, names in os.walk(top):
            for n in names:
                p = Path(dirpath) / n
                try:
                    out[p.relative_to(top).as_posix()] = p.stat().st_size
                except OSError as e:
                    if e.errno not in _UNRESOLVED:
                        raise
        return out

    def size_of(self, rel: str) -> int | None:
        return None if (i := self.identity(rel)) is None else i[0]

    def identity(self, rel: str) -> tuple[int, ...] | None:
        try:
            st = self._p(rel).stat()
        except OSError as e:
            if e.errno not in _UNRESOLVED:
                raise
            return None
        return st.st_size, st.st_ino, st.st_mtime_ns

    def digest_of(self, rel: str) -> dict[str, Any] | None:
        d = digest.Digest()
        try:
            with open(self._p(rel), "rb") as f:
                while block := f.read(digest.READ_BLOCK):
                    d.update(block)
        except (FileNotFoundError, IsADirectoryError):
            return None
        return d.record()

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        fd = os.open(self._p(rel), os.O_RDONLY)
        try:
            return [os.pread(fd, n, offset) for offset, n in ranges]
        finally:
            os.close(fd)

    def exists(self, rel: str) -> bool:
        return self._p(rel).exists()

    def list_dirs(self, rel: str = "") -> list[str]:
        d = self._p(rel)
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def rmtree(self, rel: str) -> None:
        p = self._p(rel)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():  # a file (a plan record), or a link: itself, never what it points to
            p.unlink()

    def copy_tree(self, src: str, dst: str) -> None:
        # Hard links: no data copied (falls back to a copy across filesystems).
        top = self._p(src)
        shutil.copytree(
            top,
            self._p(dst),
            copy_function=_link_or_copy,
            ignore=lambda d, names: ["zarr.json"] if Path(d) == top else [],
        )
        if (top / "zarr.json").exists():
            _link_or_copy(str(top / "zarr.json"), str(self._p(dst) / "zarr.json"))

    def zarr_store(self, rel: str = "", read_only: bool = False):
        from zarr.storage import LocalStore

        return LocalStore(self._p(rel), read_only=read_only)

    def remove_partials(self, rel: str = "") -> int:
        return commit.remove_partials(self._p(rel))

    @contextmanager
    def lock(self, rel: str, holder: str, busy: Callable[[str], Exception]) -> Iterator[None]:
        path = self._p(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not path.is_file():  # (a damage check: a directory there was a traceback)
            raise StoreError(
                f"{path} is the store's lock file, but it is not a file: remove it (rm -r {path}; no run holds a "
                "lock there) and rerun"
            )
        with commit.exclusive_lock(path, holder, busy):
            yield

    def check(self, write: bool) -> None:
        if not write:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".write-test-"):  # unique: runs check at once
                pass
        except OSError as e:
            raise StoreError(
                f"store path {self.root} cannot be written ({e.strerror}); choose another "
                "store_path or fix its permissions"
            ) from e


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
