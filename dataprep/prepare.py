"""Dataset preparation: raw chat rows -> token ids + assistant loss masks, as a `datasets` Arrow directory.

Output lives in `<out_root>/<fingerprint>/` and is written atomically (temp dir + rename), so a rerun
with the same inputs finds it and does nothing, and a crash never leaves a half-written dataset that
looks finished. The fingerprint covers the source bytes, the chat template, the tokenizer, the
settings and this module's version.
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

from dflash_pipeline.config import DataConfig
from dflash_pipeline.dataprep.normalize import RowError, normalize_row
from dflash_pipeline.dataprep.render import render
from dflash_pipeline.dataprep.sources import BadLine, iter_rows, source_fingerprint
from dflash_pipeline.errors import DataError

log = logging.getLogger(__name__)
PREPARE_VERSION = "1"


@dataclass
class PrepareResult:
    """The manifest of a prepared dataset (small; safe to pass between Prefect tasks)."""

    fingerprint: str
    path: str  # the datasets Arrow directory
    source: str
    n_rows: int
    n_samples: int
    n_tokens: int
    n_supervised_tokens: int
    num_shards: int
    dropped: dict[str, int] = field(default_factory=dict)
    quarantined: int = 0
    quarantine_path: str = ""
    reused: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


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
        "settings": cfg.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def sample_id(ids: list[int], mask: list[int]) -> str:
    """Content address of a sample: identical conversations get identical ids (and are deduplicated)."""
    h = hashlib.sha256()
    h.update(json.dumps([ids, mask]).encode())
    return h.hexdigest()[:20]


def prepare_dataset(
    cfg: DataConfig,
    source: str,
    tokenizer,
    out_root: Path,
    progress: Callable[[int, float], None] | None = None,
) -> PrepareResult:
    """Prepare `source` into `out_root/<fingerprint>`; reuse it when it already exists."""
    fp = fingerprint(cfg, source, tokenizer)
    final = Path(out_root) / fp
    manifest = final / "manifest.json"
    if manifest.exists():
        res = PrepareResult(**json.loads(manifest.read_text()))
        res.reused = True
        log.info("prepared dataset %s already exists (%d samples); reusing it", final, res.n_samples)
        return res

    import datasets

    quarantine: list[dict] = []
    dropped: Counter[str] = Counter()
    seen: set[str] = set()
    cols: dict[str, list] = {"sample_id": [], "input_ids": [], "loss_mask": [], "seq_len": [], "source_row": []}
    n_rows, t0 = 0, time.monotonic()
    for row_no, row in iter_rows(source, cfg.split):
        n_rows += 1
        if progress and n_rows % 500 == 0:
            progress(n_rows, n_rows / max(time.monotonic() - t0, 1e-9))
        if cfg.max_samples is not None and len(cols["sample_id"]) >= cfg.max_samples:
            break
        try:
            if isinstance(row, BadLine):
                raise RowError(row.error)
            r = render(tokenizer, normalize_row(row, cfg.format), cfg.mask_turns)
        except RowError as e:
            quarantine.append({"row": row_no, "reason": e.reason})
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

    n = len(cols["sample_id"])
    if n == 0:
        reasons = Counter(q["reason"].split(":")[0] for q in quarantine)
        raise DataError(
            f"no usable samples in {source}: {n_rows} rows read, {len(quarantine)} quarantined "
            f"(top reasons: {reasons.most_common(3)}), dropped {dict(dropped)}. Check data.format, "
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
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{fp}-", dir=final.parent))
    try:
        ds.save_to_disk(str(tmp / "dataset"), num_shards=num_shards)
        with open(tmp / "quarantine.jsonl", "w") as f:
            for q in quarantine:
                f.write(json.dumps(q) + "\n")
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
        )
        (tmp / "manifest.json").write_text(res.to_json())  # written last: its presence means "complete"
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "prepared %d samples (%d tokens) from %d rows; %d quarantined; dropped %s -> %s",
        n,
        res.n_tokens,
        n_rows,
        len(quarantine),
        dict(dropped),
        final,
    )
    return res


def load_quarantine(res: PrepareResult) -> list[dict]:
    p = Path(res.quarantine_path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def load_prepared(path: str):
    import datasets

    return datasets.load_from_disk(path)
