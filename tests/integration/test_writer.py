"""The store writer: its own shard encoder writes exactly what zarr writes; I/O errors are retried."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zarr

from dflash_pipeline.errors import StoreError
from dflash_pipeline.storage.shardio import ShardProcesses, SharedBuffers, encode_shard
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.writer import BufferPool, UnitWriter


def _unit_copy(small_store, tmp_path, name):
    root = tmp_path / name
    shutil.copytree(small_store.store, root)
    version = small_store.plan.version
    return root / version / "units" / Store(root).units(version)[0]


def _empty_unit(small_store, tmp_path, name, compression):
    """A copy of a unit whose `hidden` array is re-created empty with the codec under test."""
    from dflash_pipeline.storage.layout import compressors

    d = _unit_copy(small_store, tmp_path, name)
    g = zarr.open_group(str(d), mode="r+")
    a, la = g["hidden"], g["last_hidden"]
    shape, dtype = a.shape, a.dtype
    del g["hidden"], g["last_hidden"]
    # several shards, several chunks per shard, a short last chunk and a short last shard
    g.create_array(
        "hidden",
        shape=shape,
        chunks=(96,) + shape[1:],
        shards=(384,) + shape[1:],
        dtype=dtype,
        compressors=compressors(compression, dtype.itemsize),
        fill_value=0,
    )
    g.create_array(
        "last_hidden",
        shape=la.shape,
        chunks=(96,) + la.shape[1:],
        shards=(384,) + la.shape[1:],
        dtype=dtype,
        compressors=compressors(compression, dtype.itemsize),
        fill_value=0,
    )
    g.attrs["shard_tokens"] = 384
    assert shape[0] % 384 and shape[0] > 2 * 384
    (d / "commit.json").unlink()
    return d


@pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
def test_shard_encoder_is_byte_identical_to_zarr(small_store, tmp_path, compression):
    src = zarr.open_group(str(_unit_copy(small_store, tmp_path, "src")), mode="r")
    h, last = src["hidden"][:], src["last_hidden"][:]
    ours, theirs = (_empty_unit(small_store, tmp_path, n, compression) for n in ("ours", "theirs"))
    w = UnitWriter(ours)
    assert w._fast["hidden"] is not None, "the fast encoder must handle the layout storage/ creates"
    w.add(0, h, last)
    w.finish()
    zarr.open_group(str(theirs), mode="r+")["hidden"][:] = h  # zarr's own encoder
    mine = sorted(p.relative_to(ours) for p in (ours / "hidden" / "c").rglob("*") if p.is_file())
    want = sorted(p.relative_to(theirs) for p in (theirs / "hidden" / "c").rglob("*") if p.is_file())
    assert mine == want and len(mine) >= 1
    for rel in mine:
        assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
    assert np.array_equal(zarr.open_group(str(ours), mode="r")["hidden"][:], h)


def test_io_errors_are_retried(small_store, tmp_path, monkeypatch):
    d = _unit_copy(small_store, tmp_path, "flaky")
    g = zarr.open_group(str(d), mode="r")
    h, last = g["hidden"][:], g["last_hidden"][:]
    (d / "commit.json").unlink()
    import dflash_pipeline.storage.writer as writer_mod

    real = writer_mod._ShardFile.write
    calls = {"n": 0}

    def flaky(self, start, rows, *args):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(5, "Input/output error (injected)")
        return real(self, start, rows, *args)

    monkeypatch.setattr(writer_mod._ShardFile, "write", flaky)
    monkeypatch.setattr(writer_mod, "wait_exponential", lambda **kw: lambda retry_state: 0)
    w = UnitWriter(d, io_retries=5)
    w.add(0, h, last)
    w.finish()
    assert calls["n"] > 2 and w.complete
    assert np.array_equal(zarr.open_group(str(d), mode="r")["hidden"][:], h)


def test_a_disk_full_at_the_commit_record_says_what_the_unit_still_needs(small_store, tmp_path, monkeypatch):
    """The disk can fill at a commit record as well as at a shard (the tmpfs test of test_disk_full.py met it there
    once): the same error as at a shard, with the space the unit still needs, and the record on disk stays the last
    good one. The full disk is injected where the OS reports it: writing every commit record after the first."""
    import contextlib
    import errno
    import json

    from dflash_pipeline.storage import commit
    from dflash_pipeline.storage.location import StoreFull

    src = zarr.open_group(str(_unit_copy(small_store, tmp_path, "src")), mode="r")
    h, last = src["hidden"][:], src["last_hidden"][:]
    d = _empty_unit(small_store, tmp_path, "full", "zstd")  # several shards: a commit record after each
    real, records = commit.write_atomic, []

    def full_after_the_first_record(path, data, before_rename=None):
        if path.name == "commit.json":
            records.append(json.loads(data))
            if len(records) > 1:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(path, data, before_rename)

    monkeypatch.setattr(commit, "write_atomic", full_after_the_first_record)
    w = UnitWriter(d)
    # closed as the extraction closes its writers: an ExitStack, whose close waits for the shards in flight and
    # re-raises their failure
    with pytest.raises(StoreFull, match=r"no space left writing .*commit\.json .*MiB free there.*still needs up to"):
        with contextlib.ExitStack() as stack:
            stack.callback(w.close)
            w.add(0, h, last)
            w.finish()
    on_disk = json.loads((d / "commit.json").read_text())
    assert on_disk == records[0] and on_disk["committed_tokens"] == 384 and not on_disk["complete"]


@pytest.mark.parametrize(("n_procs", "codec_threads"), [(2, 1), (1, 3)])
def test_writer_processes_write_the_same_bytes_as_threads(small_store, tmp_path, n_procs, codec_threads):
    """A GPU worker's path: shard buffers in shared memory, shards encoded and written by writer processes,
    a shard's chunks compressed on one thread or several (the bytes must not depend on it)."""
    src = zarr.open_group(str(_unit_copy(small_store, tmp_path, "src")), mode="r")
    h, last = src["hidden"][:], src["last_hidden"][:]
    by_threads, by_procs = (_empty_unit(small_store, tmp_path, n, "zstd") for n in ("threads", "procs"))
    w = UnitWriter(by_threads)
    w.add(0, h, last)
    w.finish()
    shared = SharedBuffers(directory=tmp_path)
    procs = ShardProcesses(n_procs, codec_threads)
    try:
        w = UnitWriter(by_procs, threads=2, buffers=BufferPool(shared), procs=procs)
        w.add(0, h, last)
        w.finish()
        assert len(list(tmp_path.glob(f"{SharedBuffers.PREFIX}*"))) >= 2  # the rows went through shared memory
    finally:
        procs.close()
        shared.close()
    assert not list(tmp_path.glob(f"{SharedBuffers.PREFIX}*")), "shared shard buffers must be deleted on close"
    assert all(p.poll() is not None for p in procs._procs), "writer processes must exit on close"
    for name in ("hidden", "last_hidden"):
        files = sorted(p.relative_to(by_threads) for p in (by_threads / name / "c").rglob("*") if p.is_file())
        assert len(files) >= 3
        arr = zarr.open_group(str(by_procs), mode="r")[name]
        assert arr.shards[0] >= 3 * arr.chunks[0]  # several chunks per shard: compressed at once with threads
        for rel in files:
            assert (by_procs / rel).read_bytes() == (by_threads / rel).read_bytes(), rel
    assert (by_procs / "commit.json").read_bytes() == (by_threads / "commit.json").read_bytes()


def test_writer_process_failures_reach_the_worker(small_store, tmp_path, monkeypatch):
    import dflash_pipeline.storage.writer as writer_mod

    monkeypatch.setattr(writer_mod, "wait_exponential", lambda **kw: lambda retry_state: 0)
    h = zarr.open_group(str(_unit_copy(small_store, tmp_path, "src")), mode="r")["hidden"][:]
    shared = SharedBuffers(directory=tmp_path)
    procs = ShardProcesses(1)
    try:
        # An I/O error in the writer process comes back as the same OSError (so it is retried), naming the file.
        d = _empty_unit(small_store, tmp_path, "blocked", "zstd")
        shutil.rmtree(d / "hidden" / "c", ignore_errors=True)
        (d / "hidden" / "c").write_text("a file where the shard directory should be")
        w = UnitWriter(d, io_retries=2, buffers=BufferPool(shared), procs=procs)
        with pytest.raises(OSError) as e:
            w.add(0, h[:384], np.zeros((384, h.shape[2]), h.dtype))
            w.close()
        assert "hidden/c" in str(e.value) and "store-writer process" in "".join(getattr(e.value, "__notes__", []))
        assert not (d / "commit.json").exists()
        # A writer process that dies (the OOM killer) is an error that says so, not a hang.
        procs._procs[0].kill()
        procs._procs[0].wait()
        w = UnitWriter(_empty_unit(small_store, tmp_path, "orphaned", "zstd"), buffers=BufferPool(shared), procs=procs)
        with pytest.raises(RuntimeError, match="store-writer process .* died"):
            w.add(0, h[:384], np.zeros((384, h.shape[2]), h.dtype))
            w.close()
    finally:
        procs.close()
        shared.close()


def test_too_little_shared_memory_for_writer_processes_is_a_clear_error(tmp_path, monkeypatch, model_dir):
    """Docker's default /dev/shm is 64 MiB. Asked for writer processes, the worker says so before loading the
    model, with the fix, and commits nothing. (A GPU worker's 'auto' writes on threads then, with a warning.)"""
    from tests.helpers import extract_local

    monkeypatch.setattr(SharedBuffers, "free_bytes", lambda self: 64 * 2**20)
    with pytest.raises(StoreError, match=r"(?s)/dev/shm has 0.06 GiB free.*--shm-size.*store_writers: threads"):
        extract_local(tmp_path, {"data.max_samples": 4, "extract.store_writers": "processes"})
    store = Store(tmp_path / "store")
    assert all(not store.commit_record(v, u).get("committed_tokens") for v in store.versions() for u in store.units(v))


def test_encode_shard_on_threads_gives_the_same_bytes():
    """A shard's chunks compressed on a thread pool (writer processes with SHARD_CODEC_THREADS > 1) are placed in
    order: the file is byte for byte the one a single thread writes, the last short chunk padded alike."""
    import numcodecs

    rows = np.random.default_rng(0).standard_normal((1000, 3, 64)).astype(np.float32)
    blosc = numcodecs.Blosc(cname="zstd", clevel=1, shuffle=numcodecs.Blosc.SHUFFLE, blocksize=1 << 20)
    one = b"".join(bytes(p) for p in encode_shard(rows, 1024, 64, blosc))
    with ThreadPoolExecutor(4) as pool:
        assert b"".join(bytes(p) for p in encode_shard(rows, 1024, 64, blosc, pool)) == one
