"""Reading a checkpoint directory's files without loading the model: config, weight sizes, fingerprint."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from dflash_pipeline.errors import CompatError

_ST_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def read_model_config(model_path: str) -> dict:
    p = Path(model_path)
    cfg = p / "config.json"
    if not p.is_dir():
        raise CompatError(
            f"target.model_path {p} is not a directory; give a local HF checkpoint "
            "directory (config.json + *.safetensors) or 'embedded'"
        )
    if not cfg.exists():
        raise CompatError(
            f"target.model_path {p} has no config.json: not a HF checkpoint directory; give the directory that holds "
            "the checkpoint's config.json and *.safetensors (or 'embedded')"
        )
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CompatError(f"{cfg} is corrupt (invalid JSON at line {e.lineno}): re-download the checkpoint") from e


def safetensors_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 100 * 2**20:
                raise ValueError("header length implausible")
            return json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CompatError(f"weights file {path} is corrupt or truncated ({e}); re-download the checkpoint") from e


def weight_files(model_path: str) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        bins = sorted(Path(model_path).glob("pytorch_model*.bin"))
        if bins:
            return bins
        raise CompatError(
            f"target.model_path {model_path} has no weights files (*.safetensors or pytorch_model*.bin): give the "
            "checkpoint directory that holds them (a download that stopped early? fetch the weights again)"
        )
    return files


FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names


def weights_bytes(model_path: str, bytes_per_param: int, fp8_stays: bool = False) -> int:
    """Size of the weights once loaded in a dtype of `bytes_per_param` bytes (with `fp8_stays`, an FP8 checkpoint
    run by its FP8 forward: its FP8 tensors keep one byte a value)."""
    total = 0
    for f in weight_files(model_path):
        if f.suffix != ".safetensors":
            return sum(x.stat().st_size for x in weight_files(model_path))
        for name, meta in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for s in meta["shape"]:
                n *= s
            total += n * (1 if fp8_stays and meta["dtype"] in FP8_DTYPES else bytes_per_param)
    return total


def weights_fingerprint(model_path: str, sample_blocks: int = 32, block: int = 1 << 16) -> str:
    """Fingerprint of the weight files: for each, its name and size, then either the whole file (64 MiB or less)
    or `sample_blocks` evenly spaced 64 KiB blocks (the first holds the safetensors header: names, shapes,
    dtypes). Cheap on a 54 GB checkpoint and changes when fine-tuned weights change (docs/STORE.md)."""
    h = hashlib.sha256()
    for f in weight_files(model_path):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= 64 * 2**20:
                h.update(fh.read())
                continue
            for i in range(sample_blocks):
                fh.seek(i * (size - block) // (sample_blocks - 1))
                h.update(fh.read(block))
    return h.hexdigest()  # full length: the store records provenance untruncated (docs/STORE.md)


def config_hash(model_path: str) -> str:
    cfg = read_model_config(model_path)
    cfg.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
