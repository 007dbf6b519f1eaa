"""The store's digests: why not CRC32C over a file, and attribute digests that ignore key order only."""

from __future__ import annotations

import os

import google_crc32c
import numpy as np

from dflash_pipeline.storage import digest


def test_crc32c_of_a_file_ending_with_its_own_crc32c_is_a_constant():
    """Every zarr shard and Crc32c-coded chunk ends with the CRC32C of what precedes it: CRC32C over such
    files is the same for all of them, so the store cannot use it as a file digest. XXH3-128 tells them apart."""
    files = []
    for n in (10, 1000, 12345):
        body = os.urandom(n)
        files.append(body + google_crc32c.value(body).to_bytes(4, "little"))
    assert len({google_crc32c.value(f) for f in files}) == 1
    assert len({digest.of_pieces([f])["xxh3_128"] for f in files}) == 3


def test_digest_of_pieces_equals_digest_of_their_concatenation():
    a = np.arange(1000, dtype=np.float32)
    pieces = [a, memoryview(b"xy"), bytearray(b"z"), b""]
    whole = a.tobytes() + b"xyz"
    assert (
        digest.of_pieces(pieces)
        == digest.of_pieces([whole])
        == {"size": len(whole), "xxh3_128": digest.of_pieces([whole])["xxh3_128"]}
    )
    assert digest.of_pieces([whole[:-1]]) != digest.of_pieces([whole])


def test_attribute_digest_is_canonical_but_sees_every_value_change():
    assert digest.of_attr({"a": 1, "b": [1, 2]}) == digest.of_attr({"b": [1, 2], "a": 1})
    assert digest.of_attr([1, 2, 3]) != digest.of_attr([1, 2, 4])
    assert digest.of_attr("bfloat16") != digest.of_attr("float16")
    assert digest.of_attrs({"x": 1, "y": 2}, ["y", "z"]) == {"y": digest.of_attr(2)}
