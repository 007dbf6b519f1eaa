"""Digests of what a store commits: files (size + XXH3-128) and attributes (XXH3-128 of canonical JSON).

Why XXH3-128 (the `xxhash` package, which `datasets` already requires): it runs at ~9-10 GB/s per core here,
as fast as a hardware CRC32C, and unlike a CRC it says something about our files. A CRC32C over a whole
shard is useless: a zarr shard (and every chunk zarr writes with a Crc32cCodec) ends with the CRC32C of
the bytes before it, and the CRC of "message + its own CRC" is the same constant (0x48674bc7) for every
message, so every such file would get the same digest. 128 bits make accidental collisions impossible in
practice; XXH3 is not a cryptographic hash: the digests guard against damage (flipped bits, truncation, a
wrong or stale file), not against someone forging a file on purpose (docs/STORE.md, "Integrity").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import xxhash

ALGORITHM = "xxh3_128"
READ_BLOCK = 8 << 20  # bytes read at a time when digesting a file


class Digest:
    """Incremental size + XXH3-128 of a byte stream."""

    def __init__(self) -> None:
        self.size, self._h = 0, xxhash.xxh3_128()

    def update(self, piece: Any) -> None:
        arr = np.frombuffer(memoryview(piece).cast("B"), np.uint8)  # any contiguous buffer, no copy
        self._h.update(arr)
        self.size += arr.nbytes

    def record(self) -> dict[str, Any]:
        return {"size": self.size, ALGORITHM: self._h.hexdigest()}


def of_pieces(pieces: Iterable[Any]) -> dict[str, Any]:
    """{'size': n, 'xxh3_128': hex} of the concatenation of `pieces` (bytes-like)."""
    d = Digest()
    for p in pieces:
        d.update(p)
    return d.record()


def of_attr(value: Any) -> str:
    """The digest of one attribute value: XXH3-128 of its canonical JSON (sorted keys, no whitespace)."""
    return xxhash.xxh3_128_hexdigest(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


CHUNKS = "chunks"  # a shard's commit-record entry: of_chunks, beside its size and digest
EMPTY_CHUNK = 2**64 - 1  # the sharding index's offset and size of a chunk not stored


def of_chunks(read_ranges: Callable[[list[tuple[int, int]]], list[bytes]], size: int, n_chunks: int) -> str:
    """XXH3-128 of a shard's chunk index (zarr's sharding codec, at the file's end: `n_chunks` little-endian uint64
    (offset, nbytes) pairs, then their CRC32C) followed by the CRC32C each stored chunk ends with (its last 4 bytes),
    in index order. A few small reads (`read_ranges([(offset, length), ...])`), not the whole shard: what the
    default reader can afford, and what the CRC32C of each chunk and of the index cannot show: intact chunks
    rearranged within the shard, or the whole shard replaced by another intact one (a damage check read either as
    other rows). A file too short for its index, or an index pointing outside the file, gives a text that is no
    digest (and so matches no record)."""
    index_len = 16 * n_chunks + 4
    if size < index_len:
        return f"no room for a {n_chunks}-chunk index in {size} bytes"
    (index,) = read_ranges([(size - index_len, index_len)])
    if len(index) != index_len:  # the file is shorter than its committed size now
        return f"the index is cut short ({len(index)} of {index_len} bytes)"
    h = xxhash.xxh3_128(index)
    tails = []
    for offset, n in np.frombuffer(index, dtype="<u8", count=2 * n_chunks).reshape(n_chunks, 2).tolist():
        if offset == EMPTY_CHUNK and n == EMPTY_CHUNK:
            continue
        if n < 4 or offset + n > size - index_len:
            return f"the index points outside the file (chunk at {offset}, {n} bytes)"
        tails.append((offset + n - 4, 4))
    for crc in read_ranges(tails):
        if len(crc) != 4:
            return "a chunk is cut short"
        h.update(crc)
    return h.hexdigest()


def of_encoded_chunks(pieces: list) -> str:
    """of_chunks of a shard from the pieces storage.shardio.encode_shard made it of ([chunk, its CRC32C, ...,
    index, the index's CRC32C]: chunks in index order), without reading the file back."""
    h = xxhash.xxh3_128(bytes(pieces[-2]) + bytes(pieces[-1]))
    for crc in pieces[1:-2:2]:
        h.update(bytes(crc))
    return h.hexdigest()


def is_digest(value: Any) -> bool:
    """Whether `value` has the form of a digest this package writes (32 lowercase hex digits)."""
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def of_attrs(attrs: dict[str, Any], keys: Iterable[str] | None = None) -> dict[str, str]:
    """{key: of_attr(value)} for `keys` (default: every key) that `attrs` holds."""
    return {k: of_attr(attrs[k]) for k in (keys if keys is not None else sorted(attrs)) if k in attrs}
