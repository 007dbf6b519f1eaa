"""The store on S3-compatible object storage (AWS S3, MinIO, Ceph...): storage/location.py's Location over
s3fs. What replaces each local guarantee is in location.py's docstring and docs/STORE.md."""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage import digest
from dflash_pipeline.storage.location import Buffers, Location

log = logging.getLogger(__name__)

S3_INSTALL_HINT = "pip install 'dflash-pipeline[s3]' (or pip install s3fs)"
CREDENTIAL_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary "
    "credentials), or AWS_PROFILE with ~/.aws/credentials, or run with an instance role; "
    "credentials are never read from the run config"
)

LEASE_S = 60.0  # a store lease not renewed for this long is taken over (its holder died)
_PROBE_CONFIG = {"connect_timeout": 3, "read_timeout": 10, "retries": {"max_attempts": 1}}


class _S3Conn:
    """The s3fs filesystems of one store, created lazily and per process (safe across fork/spawn):
    a synchronous one for our own operations and an asynchronous one for zarr's FsspecStore. Listings
    are never cached: other processes write the same store."""

    def __init__(self, options: dict[str, Any]):
        self.options = options
        self._fs: dict[tuple[int, Any], Any] = {}  # (pid, asynchronous or "probe") -> S3FileSystem

    def __getstate__(self) -> dict:
        return {"options": self.options, "_fs": {}}

    def _make(self, asynchronous: bool, **extra):
        try:
            import s3fs
        except ImportError:
            raise StoreError(f"an s3:// store needs s3fs: {S3_INSTALL_HINT}") from None
        return s3fs.S3FileSystem(**{"use_listings_cache": False, **self.options, **extra}, asynchronous=asynchronous)

    def fs(self, asynchronous: bool = False):
        key = (os.getpid(), asynchronous)
        if key not in self._fs:
            self._fs[key] = fs = self._make(asynchronous)
            if asynchronous:  # s3fs closes only its synchronous clients itself
                atexit.register(_close_async_fs, fs, os.getpid())
        return self._fs[key]

    def probe_fs(self):
        """A client that fails within seconds (one attempt, short timeouts), for the early checks."""
        key = (os.getpid(), "probe")
        if key not in self._fs:
            config = {**self.options.get("config_kwargs", {}), **_PROBE_CONFIG}
            self._fs[key] = self._make(False, skip_instance_cache=True, config_kwargs=config)
            self._fs[key].retries = 1
        return self._fs[key]

    def endpoint(self) -> str:
        o = self.options
        return (
            o.get("endpoint_url")
            or o.get("client_kwargs", {}).get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or "the default AWS S3 endpoint"
        )


def _close_async_fs(fs, pid: int) -> None:
    """At exit, close the HTTP session of zarr's s3fs client on zarr's event loop (still running: atexit
    handlers run last-registered first, and zarr registered its loop's cleanup at import, before this)."""
    if os.getpid() != pid or getattr(fs, "_s3creator", None) is None:
        return
    try:
        from zarr.core.sync import sync

        sync(fs._s3creator.__aexit__(None, None, None))
    except Exception:  # noqa: BLE001 - shutting down: nothing left to report to
        pass


class S3Location(Location):
    def __init__(self, url: str, options: dict[str, Any], conn: _S3Conn | None = None):
        rest = url.split("://", 1)[1].strip("/")
        if not rest:
            raise StoreError(f"store path {url!r} names no bucket: use s3://<bucket>/<prefix>")
        self.path = rest  # "bucket/prefix"
        self.bucket = rest.split("/", 1)[0]
        self.url = f"s3://{rest}"
        self.conn = conn or _S3Conn(options)

    @property
    def fs(self):
        return self.conn.fs()

    def _p(self, rel: str) -> str:
        return f"{self.path}/{rel.strip('/')}" if rel else self.path

    def _prefix(self, rel: str = "") -> str:
        """The key prefix of everything below `rel` (without the bucket, with a trailing '/')."""
        key = self._p(rel).partition("/")[2]
        return key + "/" if key else ""

    def child(self, rel: str) -> S3Location:
        return S3Location(f"s3://{self._p(rel)}", self.conn.options, self.conn)

    def url_of(self, rel: str = "") -> str:
        return f"s3://{self._p(rel)}"

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._p(rel))
        except FileNotFoundError:
            return None

    def write_atomic(self, rel: str, data: bytes, before_commit: Callable[[], None] | None = None) -> None:
        if before_commit:
            before_commit()
        self._put(rel, data)  # S3 makes a PUT atomic and, once it returns, durable

    def write_object(self, rel: str, pieces: Buffers) -> dict[str, Any]:
        data = b"".join(pieces)
        self._put(rel, data)  # one PUT (a multipart upload beyond 100 MB: also all or nothing)
        return digest.of_pieces([data])

    def list_files(self, rel: str = "") -> dict[str, int]:
        top = self._p(rel)
        try:
            found = self.fs.find(top, detail=True)
        except FileNotFoundError:
            return {}
        return {k[len(top) + 1 :]: int(v.get("size") or 0) for k, v in found.items() if k.startswith(top + "/")}

    def size_of(self, rel: str) -> int | None:
        try:
            return int(self.fs.info(self._p(rel))["size"])
        except FileNotFoundError:
            return None

    def digest_of(self, rel: str) -> dict[str, Any] | None:
        d = digest.Digest()
        try:
            with self.fs.open(self._p(rel), "rb", block_size=digest.READ_BLOCK) as f:
                while block := f.read(digest.READ_BLOCK):
                    d.update(block)
        except FileNotFoundError:
            return None
        return d.record()

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        if not ranges:
            return []
        path = self._p(rel)
        starts, ends = [o for o, _ in ranges], [o + n for o, n in ranges]
        return list(self.fs.cat_ranges([path] * len(ranges), starts, ends, on_error="raise"))

    def _put(self, rel: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._p(rel), data)
        except OSError:
            raise
        except Exception as e:  # connection errors (botocore's own types): transient, let the caller retry
            raise OSError(f"writing {self.url_of(rel)} failed: {type(e).__name__}: {e}") from e

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._p(rel))

    def list_dirs(self, rel: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self._p(rel), detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def _files(self, rel: str) -> list[str]:
        top = self._p(rel)
        try:
            return [f for f in self.fs.find(top) if f == top or f.startswith(top + "/")]
        except FileNotFoundError:
            return []

    def rmtree(self, rel: str) -> None:
        assert rel, "refusing to delete the store's root"
        files = self._files(rel)
        if files:
            self.fs.rm(files)

    def copy_tree(self, src: str, dst: str) -> None:
        # Server-side copies (CopyObject): no data passes through this host, but S3 has no hard links, so
        # the copy takes storage of its own.
        top, to = self._p(src), self._p(dst)
        files = self._files(src)
        for batch in ([f for f in files if f != f"{top}/zarr.json"], [f for f in files if f == f"{top}/zarr.json"]):
            if batch:
                self.fs.copy(batch, [to + f[len(top) :] for f in batch])

    def zarr_store(self, rel: str = "", read_only: bool = False):
        from zarr.storage import FsspecStore

        return FsspecStore(self.conn.fs(asynchronous=True), path=self._p(rel), read_only=read_only)

    def remove_partials(self, rel: str = "") -> int:
        """Abort the unfinished multipart uploads below `rel` (a writer killed while uploading a large shard):
        invisible to readers, but billed until aborted. Each unit has one writer, so none is live."""
        out = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket, Prefix=self._prefix(rel))
        uploads = out.get("Uploads", [])
        for u in uploads:
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
        return len(uploads)

    @contextmanager
    def lock(self, rel: str, holder: str, busy: Callable[[str], Exception]) -> Iterator[None]:
        lease = _Lease(self.fs, self._p(rel), holder, busy, LEASE_S)
        lease.acquire()
        try:
            yield
        finally:
            lease.release()

    def check(self, write: bool) -> None:
        fs = self.conn.probe_fs()
        try:
            if write:
                probe = self._p(".write-test")
                fs.pipe_file(probe, b"")
                fs.rm_file(probe)
            else:
                fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=self._prefix(), MaxKeys=1)
        except Exception as e:  # noqa: BLE001 - every failure becomes one actionable message
            raise self._explain(e, write) from e

    def _explain(self, e: Exception, write: bool) -> StoreError:
        where = f"store {self.url} (endpoint {self.conn.endpoint()})"
        name = type(e).__name__
        code = str(getattr(e, "response", {}).get("Error", {}).get("Code", "")) if hasattr(e, "response") else ""
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return StoreError(f"no AWS credentials found for {where}: {CREDENTIAL_HINT}")
        if name in (
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ProxyConnectionError",
            "SSLError",
        ) or isinstance(e, (ConnectionError, TimeoutError)):
            return StoreError(
                f"object storage unreachable for {where}: {e}. Check that the server runs and that "
                "store_options.endpoint_url (or AWS_ENDPOINT_URL) names it"
            )
        if isinstance(e, FileNotFoundError) or code == "NoSuchBucket":
            return StoreError(
                f"bucket {self.bucket!r} does not exist for {where}: create it (e.g. `aws s3 mb "
                f"s3://{self.bucket}`) or fix store_path"
            )
        if isinstance(e, PermissionError) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StoreError(
                f"access denied to {where} ({e}): check the credentials ({CREDENTIAL_HINT}) and that "
                f"they may {'write' if write else 'read'} this bucket"
            )
        return StoreError(f"{where} cannot be {'written' if write else 'read'}: {name}: {e}")


def _process_identity() -> dict:
    """Who holds a lease, precisely enough to tell on the same host whether it still runs: the host, its boot,
    the PID namespace (containers share hostnames and PIDs less often than not, but they can) and the PID."""

    def read(path: str, link: bool = False) -> str | None:
        try:
            return os.readlink(path) if link else open(path).read().strip()
        except OSError:
            return None

    return {
        "host": socket.gethostname(),
        "boot": read("/proc/sys/kernel/random/boot_id"),
        "pidns": read("/proc/self/ns/pid", link=True),
        "pid": os.getpid(),
    }


_PROCESS = _process_identity()


def _dead_on_this_host(holder: dict | None) -> bool:
    """True only when the holder ran on this host, boot and PID namespace and its PID is gone: then its lease
    need not be waited out (a run resuming after a crash on one box starts at once)."""
    if not holder or holder.get("boot") is None or holder.get("pidns") is None:
        return False
    if any(holder.get(k) != _PROCESS[k] for k in ("host", "boot", "pidns")):
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, KeyError, TypeError):
        return False
    return False


class _Lease:
    """An exclusive lease on a store held as one object: {"holder", "expires"}.

    Taken with a conditional PUT (If-None-Match: *), so of two runs starting together exactly one gets it;
    renewed every ttl/4 by a heartbeat thread with If-Match on the lease's ETag; taken over (again with
    If-Match, so by one run only) once its expiry has passed, i.e. when its holder died ttl seconds ago.
    Expiry compares the hosts' clocks: keep them synchronised (NTP)."""

    def __init__(self, fs, path: str, holder: str, busy: Callable[[str], Exception], ttl: float):
        self.fs, self.path, self.holder, self.busy, self.ttl = fs, path, holder, busy, ttl
        self.etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": time.time() + self.ttl, "process": _PROCESS}).encode()

    def acquire(self) -> None:
        for _ in range(3):  # a lease released between our attempt and our look at it: try again
            try:
                out = self.fs.pipe_file(self.path, self._body(), mode="create")
                break
            except FileExistsError:
                try:
                    out = self._take_over()
                    break
                except FileNotFoundError:
                    continue
        else:
            raise self.busy("another run that keeps taking and releasing it")
        self.etag = out["ETag"]
        self._thread = threading.Thread(target=self._heartbeat, name="store-lease", daemon=True)
        self._thread.start()

    def _take_over(self) -> dict:
        etag = self.fs.info(self.path)["ETag"]  # first the ETag, then the body: never a newer body's ETag
        current = json.loads(self.fs.cat_file(self.path))
        expires = current.get("expires", 0)
        died_here = _dead_on_this_host(current.get("process"))
        if expires > time.time() and not died_here:
            raise self.busy(
                f"{current.get('holder', 'unknown')}; its lease is renewed while it runs and "
                f"expires at {_utc(expires)} if it died"
            )
        try:
            out = self.fs.pipe_file(self.path, self._body(), IfMatch=etag)
        except OSError:  # another run took it over first
            raise self.busy(f"{current.get('holder', 'unknown')} (just taken over by another run)") from None
        why = "its process no longer runs on this host" if died_here else f"expired at {_utc(expires)}"
        log.warning("took over the store lease of %s (%s)", current.get("holder"), why)
        return out

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self.etag = self.fs.pipe_file(self.path, self._body(), IfMatch=self.etag)["ETag"]
            except OSError as e:
                if e.errno == errno.EINVAL:  # 412: the ETag changed, another run took the lease over
                    log.error("lost the store lease %s to another run (not renewed for %.0f s)", self.path, self.ttl)
                    return
                log.warning("could not renew the store lease %s: %s", self.path, e)
            except Exception as e:  # noqa: BLE001 - network trouble: keep trying; the lease lasts ttl
                log.warning("could not renew the store lease %s: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self.fs.info(self.path)["ETag"] == self.etag:  # still ours
                self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
