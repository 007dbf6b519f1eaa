"""On-disk layout of the hidden-state store (documented for third parties in docs/STORE.md).

    <store>/CURRENT                      name of the version readers should use (moved after validation)
    <store>/v0001/                       a Zarr v3 group, one per (model, layer set, dtype) identity
        zarr.json                        root attributes: provenance (see docs/STORE.md)
        units/u00000/                    one group per work unit, written by exactly one worker
            hidden       [T, K, H]       outputs of the K captured decoder layers, concatenated order
            last_hidden  [T, H]          (optional) pre-norm output of the last decoder layer
            input_ids    [T] int32, loss_mask [T] uint8
            commit.json                  the commit record: tokens [0, committed_tokens) are final
        attrs of units/uNNNNN: samples = [[sample_id, start, length], ...] in storage order

bfloat16 is stored as uint16 holding the raw bf16 bits, with attribute `logical_dtype: bfloat16`:
any Zarr v3 reader (zarr-python, tensorstore, zarrs) opens it without registering a custom data type,
and `torch.from_numpy(a).view(torch.bfloat16)` restores it bit-exactly.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import torch

from dflash_pipeline.storage.digest import ALGORITHM

# 2: commit records list every committed file with its size and XXH3-128 digest; plan and version records
# (docs/STORE.md, "Integrity").
FORMAT_VERSION = 2
# A unit's commit record before its first commit (commit.json absent).
NOTHING_COMMITTED = {"committed_tokens": 0, "complete": False}


def commit_record_problem(rec: Any) -> str | None:
    """Why a parsed commit.json is not a record this package writes (None: it is one; JSON null counts as no
    record). Edited types would otherwise crash every reader of it (found by a damage check)."""
    if rec is None:
        return None
    if not isinstance(rec, dict):
        return f"not a JSON object but {json.dumps(rec)[:60]}"
    n = rec.get("committed_tokens", 0)
    if type(n) is not int or n < 0:
        return f"committed_tokens is {json.dumps(n)[:60]}, not a count of tokens"
    if not isinstance(rec.get("complete", False), bool):
        return f"complete is {json.dumps(rec.get('complete'))[:60]}, not true or false"
    files = rec.get("files", {})
    if not isinstance(files, dict):
        return f"files is {json.dumps(files)[:60]}, not an object"
    for f, e in files.items():
        if e is not None and not (
            isinstance(e, dict) and type(e.get("size")) is int and e["size"] >= 0 and isinstance(e.get(ALGORITHM), str)
        ):
            return f"files[{f!r}] is {json.dumps(e)[:60]}, not {{size, {ALGORITHM}}}"
    return None


# Arrays whose shards the extraction writes (their files are committed shard by shard); every other file of a
# unit is written by the planner and committed with the unit's first commit record.
SHARDED_ARRAYS = ("hidden", "hidden_scale", "last_hidden", "last_hidden_scale")
ARRAYS = ("hidden", "hidden_scale", "last_hidden", "last_hidden_scale", "input_ids", "loss_mask")
VERSION_RECORD = "version.json"  # digests of the version attributes readers depend on
VALIDATION = "validation.json"  # <version>/validation.json: the last validation report of the version
PLANS = "plans"  # <version>/plans/<unit>.json: each unit's planned attributes, written once by the planner
# The planner names units u00000, u00001, ...: any other name under units/ or plans/ (a backup copy, a note) is no
# part of the store and is never read as a unit (a damage check: a stray plans/notes.json made readers refuse an
# intact store as "a unit directory missing").
UNIT_NAME = re.compile(r"u[0-9]{5,}")
# Version attributes that readers depend on (covered by the version record's digests).
READER_ATTRS = (
    "format_version",
    "layer_ids",
    "layer_convention",
    "capture_last",
    "logical_dtype",
    "precision",
    "int8_scales",
    "compute_dtype",
    "hidden_size",
    "num_layers",
    "model_type",
    "model_config_hash",
    "weights_fingerprint",
)
LAYER_CONVENTION = (
    "decoder-layer index i; value = output of decoder layer i before any final norm, which is HF "
    "output_hidden_states[i + 1] (for the last layer HF gives the post-norm value instead); "
    "layers concatenated in target_layer_ids order along axis 1"
)

# logical dtype -> (numpy dtype stored in Zarr, torch dtype)
DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "bfloat16": (np.dtype("uint16"), torch.bfloat16),
    "float16": (np.dtype("float16"), torch.float16),
    "float32": (np.dtype("float32"), torch.float32),
}


def sharded_arrays(capture_last: bool, precision: str = "full") -> tuple[str, ...]:
    """The arrays a unit of this version writes shard by shard, in SHARDED_ARRAYS order: `hidden`, with a
    compact precision its scales `hidden_scale` (storage/quant.py), and the same for `last_hidden`."""
    names = ("hidden", "last_hidden") if capture_last else ("hidden",)
    if precision != "full":
        names += tuple(f"{n}_scale" for n in names)
    return tuple(a for a in SHARDED_ARRAYS if a in names)


def to_storage(t: torch.Tensor, logical: str) -> np.ndarray:
    """A CPU tensor in the logical dtype -> numpy array of the stored dtype (bit-exact)."""
    stored, tdtype = DTYPES[logical]
    t = t.to(tdtype)
    if logical == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_storage(a: np.ndarray, logical: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if logical == "bfloat16":
        return t.view(torch.bfloat16)
    return t


COMPRESSIONS = ("zstd", "lz4", "none")  # extract.compression's values, recorded in each plan record


def compressors(name: str, itemsize: int) -> list:
    from zarr.codecs import BloscCodec, Crc32cCodec

    if name == "none":
        return [Crc32cCodec()]
    if name == "zstd":
        # Measured best for bf16 (docs/ARCHITECTURE.md, "Field facts"): zstd level 1, byte shuffle,
        # 1 MiB blocks; ratio ~1.45.
        codec = BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=itemsize, blocksize=1 << 20)
    elif name == "lz4":
        codec = BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle", typesize=itemsize, blocksize=1 << 20)
    else:
        raise ValueError(f"unknown compression {name!r}")
    return [codec, Crc32cCodec()]  # CRC32C per chunk: a flipped byte is a read error, not silent garbage


def chunks_per_shard(arr) -> int:
    """How many chunks a shard of the zarr array `arr` holds along the token axis (its shard index's entries):
    from the array's own metadata, which the shard files are laid out by."""
    return arr.shards[0] // arr.chunks[0]


def chunking(bytes_per_token: int, chunk_mib: float, shard_mib: float, n_tokens: int) -> tuple[int, int]:
    """(chunk_tokens, shard_tokens) along the token axis; shard is a multiple of chunk."""
    chunk = max(1, int(chunk_mib * 2**20) // bytes_per_token)
    shard = max(chunk, int(shard_mib * 2**20) // bytes_per_token // chunk * chunk)
    if n_tokens < shard:  # small units: one shard holding everything
        shard = max(chunk, -(-n_tokens // chunk) * chunk)
        chunk = min(chunk, shard)
    return chunk, shard
