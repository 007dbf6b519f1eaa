"""Read raw rows from a local file, a `datasets` directory, or a HF dataset name.

Rows come out as (row_number, row) where row_number is 1-based for line-oriented files (it matches an
editor's line number) and 0-based otherwise. A JSONL line that is not JSON comes out as a BadLine so
the caller can quarantine it instead of aborting the whole run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_pipeline.errors import DataError


@dataclass(frozen=True)
class BadLine:
    error: str


def _sha256_file(path: Path, h=None):
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


def source_fingerprint(source: str, split: str) -> str:
    """Content hash of a local source; name + split + datasets fingerprint for a hub dataset."""
    p = Path(source)
    if p.is_file():
        return _sha256_file(p).hexdigest()
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in p.rglob("*") if x.is_file()):
            h.update(str(f.relative_to(p)).encode())
            _sha256_file(f, h)
        return h.hexdigest()
    _check_not_missing_path(source)
    ds = _load_hub(source, split)
    return hashlib.sha256(f"{source}:{split}:{ds._fingerprint}".encode()).hexdigest()


def _load_hub(name: str, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "cannot load"
        raise DataError(
            f"data.source {name!r} is neither a local file/directory nor a loadable dataset "
            f"({type(e).__name__}: {e}). Give a path to a .jsonl/.json/.parquet file or a "
            "directory saved with datasets.save_to_disk"
        ) from e


def _check_not_missing_path(source: str) -> None:
    """A path-looking source that does not exist is a typo, not a hub dataset name."""
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")):
        raise DataError(f"data.source {source} does not exist (no such file or directory)")


def _from_dataset(ds) -> Iterator[tuple[int, Any]]:
    yield from enumerate(ds)


def iter_rows(source: str, split: str = "train") -> Iterator[tuple[int, Any | BadLine]]:
    p = Path(source)
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            with open(p, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        yield n, json.loads(line)
                    except json.JSONDecodeError as e:
                        yield n, BadLine(f"invalid JSON: {e.msg} at column {e.colno}")
            return
        if suffix == ".json":
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{p} is not valid JSON ({e.msg}, line {e.lineno}); a .json source must "
                    "hold a list of conversations (use .jsonl for one per line)"
                ) from e
            if not isinstance(data, list):
                raise DataError(f"{p} holds a {type(data).__name__}; a .json source must hold a list of rows")
            yield from enumerate(data)
            return
        if suffix == ".parquet":
            import datasets

            yield from _from_dataset(datasets.Dataset.from_parquet(str(p)))
            return
        raise DataError(f"data.source {p} has unsupported suffix {suffix!r}: use .jsonl, .json or .parquet")
    if p.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:  # noqa: BLE001
            raise DataError(f"data.source {p} is a directory but not one saved by datasets.save_to_disk: {e}") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"data.split {split!r} is not in {p} (splits: {list(ds)})")
            ds = ds[split]
        yield from _from_dataset(ds)
        return
    _check_not_missing_path(source)
    yield from _from_dataset(_load_hub(source, split))
