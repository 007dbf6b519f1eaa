"""Read raw rows from a local file (.jsonl, .json, .parquet, .arrow), a `datasets` directory, or a HF dataset name.

Rows come out as (row_number, row) where row_number is 1-based for line-oriented files (it matches an editor's line
number) and 0-based otherwise. A line that is not JSON, or whose bytes do not decode, comes out as a BadLine so the
caller can quarantine it instead of aborting the whole run. A file that cannot be read at all (a corrupt Parquet
footer, a .json file that is not JSON) raises one DataError naming the file and the position.

Text encoding: a byte-order mark always wins (UTF-8, UTF-16, UTF-32); otherwise data.encoding. 'auto' never
guesses a legacy 8-bit code page (a guess reads Latin-1 "n°" as ISO-8859-14 "nḞ", silently): a file without a BOM
is UTF-8. The rule for bytes that do not decode is the same under every setting: a line-oriented file whose other
lines decode quarantines each undecodable line with its byte offset (damage inside a UTF-8 file). Under 'auto', a
file with non-ASCII bytes none of whose non-ASCII lines is UTF-8 is not UTF-8 at all: it stops with one DataError
naming the file, the first undecodable byte offset and `data.encoding=...` as the fix.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_pipeline.errors import DataError

LINE_SUFFIXES = (".jsonl", ".ndjson")
FILE_SUFFIXES = (*LINE_SUFFIXES, ".json", ".parquet", ".arrow")
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


@dataclass(frozen=True)
class BadLine:
    error: str
    kind: str = "invalid JSON"


def _sha256_file(path: Path, h=None):
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


def source_fingerprint(source: str, split: str) -> str:
    """Content hash of a local source (its bytes, not its path); name + split + datasets fingerprint for a hub
    dataset."""
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
    if source.startswith((".", "/", "~")) or source.endswith(FILE_SUFFIXES):
        raise DataError(
            f"data.source {source} does not exist (no such file or directory): point data.source at an existing "
            f"file ({', '.join(FILE_SUFFIXES)}) or a directory saved with datasets' save_to_disk"
        )


def resolve_encoding(path: str | Path, encoding: str = "auto") -> str:
    """The codec to read a text source with (see the module docstring); "" for sources that are not text."""
    p = Path(path)
    if not p.is_file() or p.suffix.lower() not in (*LINE_SUFFIXES, ".json"):
        return ""
    with open(p, "rb") as f:
        head = f.read(4)
    for bom, codec in _BOMS:
        if head.startswith(bom):
            return codec
    if encoding != "auto":
        return encoding
    first_bad: tuple[int, int, bytes] | None = None  # (byte offset, line number, the bytes there)
    offset = 0
    with open(p, "rb") as f:
        for n, line in enumerate(f, start=1):
            start, offset = offset, offset + len(line)
            if line.isascii():
                continue
            try:
                line.decode("utf-8")
                return "utf-8"  # UTF-8 text: any other undecodable line is quarantined with its offset
            except UnicodeDecodeError as e:
                if first_bad is None:
                    first_bad = (start + e.start, n, line[e.start : e.start + 4])
    if first_bad is None:
        return "utf-8"  # pure ASCII
    at, n, raw = first_bad
    raise DataError(
        f"data.source {p} is not UTF-8 and has no byte-order mark: bytes {raw!r} at byte offset {at} (line {n}) "
        "do not decode, and no line with non-ASCII bytes is valid UTF-8. data.encoding=auto reads only UTF-8 "
        "(with or without BOM) and UTF-16/32 with a BOM; it does not guess a legacy code page. Set the file's "
        "encoding, e.g. data.encoding=latin-1 or data.encoding=cp1252 (Western European), or convert the file "
        "to UTF-8 (iconv -f LATIN1 -t UTF-8)"
    )


def iter_rows(source: str, split: str = "train", encoding: str = "auto") -> Iterator[tuple[int, Any | BadLine]]:
    p = Path(source)
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix in LINE_SUFFIXES:
            yield from _jsonl(p, resolve_encoding(p, encoding))
        elif suffix == ".json":
            yield from _json(p, resolve_encoding(p, encoding))
        elif suffix == ".parquet":
            yield from _parquet(p)
        elif suffix == ".arrow":
            yield from _arrow(p)
        else:
            raise DataError(
                f"data.source {p} has unsupported suffix {suffix!r}: use a file ({', '.join(FILE_SUFFIXES)}) or a "
                "directory saved with datasets' save_to_disk"
            )
        return
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
        yield from _dataset(ds, str(p))
        return
    _check_not_missing_path(source)
    yield from _dataset(_load_hub(source, split), source)


def _json_error(e: json.JSONDecodeError, line_no: int | None = None) -> str:
    """Where the JSON breaks, as an editor shows it: a JSONL row's own line and its column in that line (the
    decoder's count would be of the row and its newline: 'line 2, column 1' for a row cut short)."""
    msg = e.msg.removesuffix(" at")  # "Unterminated string starting at": the position follows as " at line ..."
    if line_no is None:
        return f"invalid JSON: {msg} at line {e.lineno}, column {e.colno}"
    return f"invalid JSON: {msg} at line {line_no}, column {e.pos + 1}"


def _jsonl(p: Path, codec: str) -> Iterator[tuple[int, Any | BadLine]]:
    if codec.replace("_", "-").lower() in ("utf-16", "utf-32"):  # multi-byte newlines: decode as a whole
        yield from _json_lines(_decode_whole(p, codec).splitlines())
        return
    line_codec = "utf-8" if codec == "utf-8-sig" else codec
    offset = 0
    with open(p, "rb") as f:
        for n, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8) :], start + len(codecs.BOM_UTF8)
            try:
                line = raw.decode(line_codec)
            except UnicodeDecodeError as e:
                yield (
                    n,
                    BadLine(
                        f"bytes {raw[e.start : e.start + 4]!r} at byte offset {start + e.start} of the file (line {n}) "
                        f"are not valid {line_codec}; set data.encoding if the file is in another encoding",
                        "undecodable bytes",
                    ),
                )
                continue
            if not line.strip():
                continue
            try:
                yield n, json.loads(line.rstrip("\r\n"))  # (the same row: columns counted within it)
            except json.JSONDecodeError as e:
                yield n, BadLine(_json_error(e, n))


def _json_lines(lines: list[str]) -> Iterator[tuple[int, Any | BadLine]]:
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            yield n, BadLine(_json_error(e, n))


def _decode_whole(p: Path, codec: str) -> str:
    data = p.read_bytes()
    try:
        return data.decode(codec)
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{p}: bytes {data[e.start : e.start + 4]!r} at byte offset {e.start} (line {line}) are not valid "
            f"{codec}; set data.encoding to the file's encoding"
        ) from None


def _json(p: Path, codec: str) -> Iterator[tuple[int, Any | BadLine]]:
    text = _decode_whole(p, codec)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and text.lstrip().startswith("{"):  # JSON Lines saved as .json
            yield from _json_lines(text.splitlines())
            return
        raise DataError(
            f"{p} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} (character {e.pos}); a .json "
            "source must hold a list of conversations (use .jsonl for one per line)"
        ) from None
    if not isinstance(data, list):
        raise DataError(f"{p} holds a {type(data).__name__}; a .json source must hold a list of rows")
    yield from enumerate(data)


def _parquet(p: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(p))
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{p} is not a readable Parquet file (footer / metadata: {e})") from None
    row = 0
    for rg in range(pf.num_row_groups):
        n = pf.metadata.row_group(rg).num_rows
        try:
            rows = pf.read_row_group(rg).to_pylist()
        except Exception as e:  # noqa: BLE001
            raise DataError(
                f"{p}: Parquet row group {rg} (rows {row}-{row + n - 1}) cannot be read ({type(e).__name__}: {e}); "
                "the file is damaged: re-export it"
            ) from None
        for i, r in enumerate(rows):
            yield row + i, r
        row += n


def _arrow(p: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa

    try:
        source = pa.memory_map(str(p))
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{p} is not a readable Arrow IPC file or stream ({e})") from None
    row, b = 0, 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001
            raise DataError(
                f"{p}: Arrow record batch {b} (from row {row}) cannot be read ({type(e).__name__}: {e}); "
                "the file is damaged: re-export it"
            ) from None
        for i, r in enumerate(batch.to_pylist()):
            yield row + i, r
        row, b = row + batch.num_rows, b + 1


def _dataset(ds, name: str) -> Iterator[tuple[int, Any]]:
    n = len(ds)
    for start in range(0, n, 1000):
        try:
            rows = ds[start : min(start + 1000, n)]
        except Exception as e:  # noqa: BLE001 - damaged Arrow files surface here
            raise DataError(
                f"{name}: rows {start}-{min(start + 1000, n) - 1} cannot be read ({type(e).__name__}: {e}); "
                "the dataset's files are damaged: save it again"
            ) from None
        keys = list(rows)
        for i in range(len(rows[keys[0]]) if keys else 0):
            yield start + i, {k: rows[k][i] for k in keys}


PEEK_WHOLE_BYTES = 64 * 2**20  # a text source up to this size is peeked at exactly as a run reads it


def peek_rows(source: str, split: str = "train", encoding: str = "auto", n: int = 100) -> list | None:
    """The first `n` rows of a local source as `iter_rows` gives them, reading only what they need (the CLI's
    check before a run starts); its errors are iter_rows' (a missing path, an unsupported suffix, a .json file
    that is not a list). None where a peek would cost what a run does: a hub dataset name (loaded by the run),
    a .json file over PEEK_WHOLE_BYTES (parsed whole). A larger .jsonl is read as UTF-8 unless a byte-order mark
    or data.encoding says otherwise (detecting a legacy encoding reads the whole file), so its undecodable lines
    here may decode in the run."""
    import itertools

    p = Path(source)
    if not p.exists():
        _check_not_missing_path(source)
        return None
    if p.is_file() and p.suffix.lower() in (*LINE_SUFFIXES, ".json") and p.stat().st_size > PEEK_WHOLE_BYTES:
        if p.suffix.lower() == ".json":
            return None
        encoding = "utf-8" if encoding == "auto" else encoding
    return list(itertools.islice(iter_rows(source, split, encoding), n))
