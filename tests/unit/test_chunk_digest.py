"""A shard's `chunks` digest (storage/digest.py): the writer's, from the pieces it encoded, equals the reader's, from
a few small reads of the file; a file cut short gives no digest, never an exception."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash_pipeline.storage import digest
from dflash_pipeline.storage.location import LocalLocation
from dflash_pipeline.storage.shardio import encode_shard


@pytest.mark.parametrize("rows", [64, 40, 9], ids=["whole shard", "short last shard", "one chunk of four"])
def test_the_writers_chunks_digest_is_the_readers(tmp_path: Path, rows: int):
    import numcodecs

    data = np.random.default_rng(0).standard_normal((rows, 3, 8)).astype(np.float32)
    pieces = encode_shard(data, shard_rows=64, chunk_rows=16, blosc=numcodecs.Blosc("zstd", 1))
    (tmp_path / "shard").write_bytes(b"".join(bytes(p) for p in pieces))
    size = (tmp_path / "shard").stat().st_size
    got = LocalLocation(tmp_path).chunks_of("shard", size, 64 // 16)
    assert digest.is_digest(got) and got == digest.of_encoded_chunks(pieces)


def test_a_shard_cut_short_gives_a_text_that_is_no_digest(tmp_path: Path):
    pieces = encode_shard(np.ones((32, 4), np.float32), shard_rows=32, chunk_rows=16, blosc=None)
    whole = b"".join(bytes(p) for p in pieces)
    (tmp_path / "shard").write_bytes(whole[:-10])
    loc = LocalLocation(tmp_path)
    for size in (len(whole), 10):  # the committed size (the file is shorter now), and one too small for the index
        assert not digest.is_digest(loc.chunks_of("shard", size, 2))
