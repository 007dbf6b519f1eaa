"""Dataset preparation: raw chat rows -> token ids + assistant loss masks, as a `datasets` Arrow directory.

Output lives in `<out_root>/<fingerprint>/` and is written atomically (temp dir + rename), so a rerun with the same
inputs finds it and does nothing, and a crash never leaves a half-written dataset that looks finished. The
fingerprint covers the source's content (never its path: the same data under another output_dir is the same
dataset), the chat template, the tokenizer, the settings and this module's version.

Every row read is accounted for: kept, quarantined (quarantine.jsonl, one line per row with its reason) or
dropped by a filter, each counted by reason; read = kept + quarantined + dropped always holds. When no row is
usable, quarantine.jsonl is still written (to `<out_root>/<fingerprint>/`, without a manifest) and the error
names it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_pipeline.dataprep.config import DataConfig
from dflash_pipeline.dataprep.normalize import RowError, normalize_conversation
from dflash_pipeline.dataprep.render import render
from dflash_pipeline.dataprep.sources import BadLine, iter_rows, resolve_encoding, source_fingerprint
from dflash_pipeline.errors import DataError
from dflash_pipeline.fsmodes import as_made
from dflash_pipeline.progress import counted
from dflash_pipeline.storage.commit import taking_turns

log = logging.getLogger(__name__)
PREPARE_VERSION = "2"
# Token-length histogram bins of the manifest (upper bounds, inclusive).
LENGTH_BINS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class PrepareResult:
    """The manifest of a prepared dataset (small; safe to pass between Prefect tasks)."""

    fingerprint: str
    path: str  # the datasets Arrow directory
    source: str
    n_rows: int  # rows read = n_samples + quarantined + sum(dropped)
    n_samples: int
    n_tokens: int
    n_supervised_tokens: int
    num_shards: int
    dropped: dict[str, int] = field(default_factory=dict)
    quarantined: int = 0
    quarantine_path: str = ""
    reused: bool = False
    quarantined_by_reason: dict[str, int] = field(default_factory=dict)
    length_histogram: dict[str, int] = field(default_factory=dict)  # "<=N" -> samples
    encoding: str = ""  # the codec a text source was read with
    # XXH3-128 of each file of the dataset directory as written: a reuse checks them (manifests before 2026-12-06
    # have none). A damage check: a bit flipped in an Arrow file was reused, failing validation of an intact store,
    # and a unit deleted on its advice was re-extracted from the damaged tokens under the old sample ids.
    files: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @property
    def supervised_share(self) -> float:
        return self.n_supervised_tokens / self.n_tokens if self.n_tokens else 0.0


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    return h.hexdigest()[:16]


def template_fingerprint(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def fingerprint(cfg: DataConfig, source: str, tokenizer) -> str:
    parts = {
        "version": PREPARE_VERSION,
        "source": source_fingerprint(source, cfg.split),
        "template": template_fingerprint(tokenizer),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        # The source's location is not part of the dataset's identity (its content is, above).
        "settings": cfg.model_dump(mode="json", exclude={"source"}),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def sample_id(ids: list[int], mask: list[int]) -> str:
    """Content address of a sample: identical conversations get identical ids (and are deduplicated)."""
    h = hashlib.sha256()
    h.update(json.dumps([ids, mask]).encode())
    return h.hexdigest()[:20]


def length_histogram(lengths: list[int]) -> dict[str, int]:
    hist = Counter()
    for n in lengths:
        hist[next((f"<={b}" for b in LENGTH_BINS if n <= b), f">{LENGTH_BINS[-1]}")] += 1
    order = [f"<={b}" for b in LENGTH_BINS] + [f">{LENGTH_BINS[-1]}"]
    return {k: hist[k] for k in order if hist[k]}


def _write_quarantine(path: Path, quarantine: list[dict]) -> None:
    with open(path, "w") as f:
        for q in quarantine:
            f.write(json.dumps(q, ensure_ascii=False) + "\n")


def prepare_dataset(
    cfg: DataConfig,
    source: str,
    tokenizer,
    out_root: Path,
    progress: Callable[[int, float], None] | None = None,
) -> PrepareResult:
    """Prepare `source` into `out_root/<fingerprint>`; reuse it when it already exists.

    Runs that prepare the same dataset at once (several deployment runs on one output_dir) take turns on
    `out_root/.<fingerprint>.lock`: the first builds it, the others wait and reuse it."""
    fp = fingerprint(cfg, source, tokenizer)
    final = Path(out_root) / fp
    res = _reuse(final)
    if res is not None:
        return res
    with taking_turns(final.parent / f".{fp}.lock", f"another run is preparing {final}; waiting for it"):
        return _reuse(final, warn=False) or _build(cfg, source, tokenizer, fp, final, progress)


def _reuse(final: Path, warn: bool = True) -> PrepareResult | None:
    manifest = final / "manifest.json"
    if not manifest.exists():
        return None
    res = PrepareResult(**json.loads(manifest.read_text()))
    # The manifest's own directory is where the data is: an output_dir moved or copied since keeps working.
    res.path, res.quarantine_path = str(final / "dataset"), str(final / "quarantine.jsonl")
    if res.files and (now := _file_digests(final / "dataset")) != res.files:
        changed = sorted(f for f in set(now) | set(res.files) if now.get(f) != res.files.get(f))
        (log.warning if warn else log.debug)(
            "prepared dataset %s changed since it was made (%s: %s): not reused; preparing it again from %s",
            final, counted(len(changed), "file"), ", ".join(changed[:3]), res.source,
        )  # fmt: skip
        return None
    res.reused = True
    log.info("prepared dataset %s already exists (%d samples); reusing it", final, res.n_samples)
    return res


def _build(cfg: DataConfig, source: str, tokenizer, fp: str, final: Path, progress) -> PrepareResult:
    """Tokenize and write `final`; the caller holds its lock."""
    import datasets

    encoding = resolve_encoding(source, cfg.encoding)
    options = {
        "reasoning": cfg.reasoning,
        "control_tokens": cfg.control_tokens,
        "template_kwargs": cfg.chat_template_kwargs,
    }
    quarantine: list[dict] = []
    dropped: Counter[str] = Counter()
    seen: set[str] = set()
    cols: dict[str, list] = {"sample_id": [], "input_ids": [], "loss_mask": [], "seq_len": [], "source_row": []}
    n_rows, t0 = 0, time.monotonic()
    for row_no, row in iter_rows(source, cfg.split, encoding or cfg.encoding):
        n_rows += 1
        if progress and n_rows % 500 == 0:
            progress(n_rows, n_rows / max(time.monotonic() - t0, 1e-9))
        try:
            if isinstance(row, BadLine):
                raise RowError(row.error, row.kind)
            conv = normalize_conversation(row, cfg.format, cfg.reasoning)
            r = render(tokenizer, conv, cfg.mask_turns, **options)
        except RowError as e:
            quarantine.append({"row": row_no, "kind": e.kind, "reason": e.reason})
            continue
        ids, mask = r.input_ids, r.loss_mask
        if len(ids) > cfg.max_length:
            if cfg.overlength == "drop":
                dropped["over max_length"] += 1
                continue
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
        if sum(mask) < cfg.min_supervised_tokens:
            dropped[f"fewer than {cfg.min_supervised_tokens} supervised tokens"] += 1
            continue
        sid = sample_id(ids, mask)
        if sid in seen:
            dropped["exact duplicate"] += 1
            continue
        seen.add(sid)
        for k, v in (
            ("sample_id", sid),
            ("input_ids", ids),
            ("loss_mask", mask),
            ("seq_len", len(ids)),
            ("source_row", row_no),
        ):
            cols[k].append(v)
        if cfg.max_samples is not None and len(cols["sample_id"]) >= cfg.max_samples:
            break  # stop before reading another row, so every row read is accounted for

    n = len(cols["sample_id"])
    by_reason = dict(Counter(q["kind"] for q in quarantine).most_common())
    assert n_rows == n + len(quarantine) + sum(dropped.values())
    if final.exists():  # an earlier attempt that failed (no manifest): replaced, never mixed in
        shutil.rmtree(final)
    if n == 0:
        final.mkdir()
        _write_quarantine(final / "quarantine.jsonl", quarantine)
        examples = "; ".join(f"row {q['row']}: {q['reason']}" for q in quarantine[:3])
        raise DataError(
            f"no usable samples in {source}: {n_rows} rows read, {len(quarantine)} quarantined "
            f"(by reason: {by_reason}), dropped {dict(dropped)}. First reasons: {examples or 'none'}. "
            f"All reasons are in {final / 'quarantine.jsonl'}. Check data.format, data.encoding, "
            "data.max_length and the quarantine report"
        )

    features = datasets.Features(
        {
            "sample_id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("uint8")),
            "seq_len": datasets.Value("int32"),
            "source_row": datasets.Value("int64"),
        }
    )
    ds = datasets.Dataset.from_dict(cols, features=features)
    num_shards = max(1, -(-n // cfg.rows_per_shard))
    tmp = Path(tempfile.mkdtemp(prefix=f".{fp}-", dir=final.parent))
    as_made(tmp)
    try:
        ds.save_to_disk(str(tmp / "dataset"), num_shards=num_shards)
        _write_quarantine(tmp / "quarantine.jsonl", quarantine)
        res = PrepareResult(
            fingerprint=fp,
            path=str(final / "dataset"),
            source=source,
            n_rows=n_rows,
            n_samples=n,
            n_tokens=sum(cols["seq_len"]),
            n_supervised_tokens=sum(sum(m) for m in cols["loss_mask"]),
            num_shards=num_shards,
            dropped=dict(dropped),
            quarantined=len(quarantine),
            quarantine_path=str(final / "quarantine.jsonl"),
            quarantined_by_reason=by_reason,
            length_histogram=length_histogram(cols["seq_len"]),
            encoding=encoding,
            files=_file_digests(tmp / "dataset"),
        )
        (tmp / "manifest.json").write_text(res.to_json())  # written last: its presence means "complete"
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reasons = lambda d: f" ({', '.join(f'{k}: {v}' for k, v in d.items())})" if d else ""  # noqa: E731
    log.info(
        "prepared %d samples (%d tokens, %.1f%% supervised) from %d rows; %d quarantined%s; %d dropped%s -> %s",
        n,
        res.n_tokens,
        100 * res.supervised_share,
        n_rows,
        len(quarantine),
        reasons(by_reason),
        sum(dropped.values()),
        reasons(dict(dropped)),
        final,
    )
    return res


def _file_digests(folder: Path) -> dict[str, str]:
    """{path under `folder`: XXH3-128 of the file} (Arrow shards, datasets' JSON files)."""
    import xxhash

    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h = xxhash.xxh3_128()
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
        out[f.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def find_samples(
    out_root: Path, fingerprints: list[str], wanted: list[str], opened: dict | None = None
) -> tuple[dict[str, tuple[list[int], list[int]]], list[str]]:
    """The token ids and loss masks of the `wanted` sample ids, looked up in the prepared datasets
    `out_root/<fingerprint>/` (the ones a store version was made from, newest first), for a unit to be rebuilt whose
    rows have changed or gone from the source since (docs/STORE.md, "Extracting again"). A dataset is used only
    while every file matches its manifest's digests, and a sample only when its ids and mask hash to its id (the id is
    their content hash), so nothing but the very tokens the unit was made from is ever returned. Returns
    ({sample id: (ids, mask)}, why each dataset looked at could not be used, as clauses). `opened`: a dict kept by
    the caller across calls, so that each dataset is checked and loaded once per run."""
    want, found, why = set(wanted), {}, []
    opened = {} if opened is None else opened
    for fp in fingerprints:
        if not want - set(found):
            break
        final = Path(out_root) / fp
        if fp not in opened:
            opened[fp] = _open_made(final)
        ds, cannot = opened[fp]
        if ds is None:
            why.append(cannot)
            continue
        try:
            rows = [i for i, sid in enumerate(ds["sample_id"]) if sid in want and sid not in found]
            sub = ds.select(rows)
        except Exception as e:  # noqa: BLE001 - an unreadable dataset is one that cannot be used, said why
            why.append(f"prepared dataset {final} is unreadable ({type(e).__name__}: {e})")
            continue
        for sid, ids, mask in zip(sub["sample_id"], sub["input_ids"], sub["loss_mask"]):
            ids, mask = [int(x) for x in ids], [int(x) for x in mask]
            if sample_id(ids, mask) == sid:
                found[sid] = (ids, mask)
            else:
                why.append(f"prepared dataset {final} holds other tokens under sample id {sid}")
    return found, why


def _open_made(final: Path):
    """(the prepared dataset at `final`, None) when it is on disk as its manifest's digests say, else (None, why)."""
    manifest = final / "manifest.json"
    if not manifest.is_file():
        return None, f"prepared dataset {final} is not on disk"
    try:
        files = json.loads(manifest.read_text()).get("files") or {}
        if files and (now := _file_digests(final / "dataset")) != files:
            changed = sorted(f for f in set(now) | set(files) if now.get(f) != files.get(f))
            return None, f"prepared dataset {final} changed since it was made ({', '.join(changed[:3])})"
        return load_prepared(str(final / "dataset")), None
    except Exception as e:  # noqa: BLE001 - an unreadable dataset is one that cannot be used, said why
        return None, f"prepared dataset {final} is unreadable ({type(e).__name__}: {e})"


def load_quarantine(res: PrepareResult) -> list[dict]:
    p = Path(res.quarantine_path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def load_prepared(path: str):
    import datasets

    return datasets.load_from_disk(path)
