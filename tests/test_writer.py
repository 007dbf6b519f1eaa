"""The store writer: its own shard encoder writes exactly what zarr writes; I/O errors are retried."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import zarr

from storage.store import Store
from storage.writer import UnitWriter


def _unit_copy(small_store, tmp_path, name):
    root = tmp_path / name
    shutil.copytree(small_store.store, root)
    version = small_store.plan.version
    return root / version / "units" / Store(root).units(version)[0]


def _empty_unit(small_store, tmp_path, name, compression):
    """A copy of a unit whose `hidden` array is re-created empty with the codec under test."""
    from storage.layout import compressors

    d = _unit_copy(small_store, tmp_path, name)
    g = zarr.open_group(str(d), mode="r+")
    a, la = g["hidden"], g["last_hidden"]
    shape, dtype = a.shape, a.dtype
    del g["hidden"], g["last_hidden"]
    # several shards, several chunks per shard, a short last chunk and a short last shard
    g.create_array("hidden", shape=shape, chunks=(96,) + shape[1:], shards=(384,) + shape[1:], dtype=dtype,
                   compressors=compressors(compression, dtype.itemsize), fill_value=0)
    g.create_array("last_hidden", shape=la.shape, chunks=(96,) + la.shape[1:], shards=(384,) + la.shape[1:],
                   dtype=dtype, compressors=compressors(compression, dtype.itemsize), fill_value=0)
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
    import storage.writer as writer_mod

    real = writer_mod._ShardFile.write
    calls = {"n": 0}

    def flaky(self, start, rows):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(5, "Input/output error (injected)")
        return real(self, start, rows)

    monkeypatch.setattr(writer_mod._ShardFile, "write", flaky)
    monkeypatch.setattr(writer_mod, "wait_exponential", lambda **kw: (lambda retry_state: 0))
    w = UnitWriter(d, io_retries=5)
    w.add(0, h, last)
    w.finish()
    assert calls["n"] > 2 and w.complete
    assert np.array_equal(zarr.open_group(str(d), mode="r")["hidden"][:], h)
