"""What an evaluation's figures depend on (its key) and the cache of untrained-baseline results
($DFLASH_HOME/baselines): drafter/evaluate.py measures, this module decides what was measured before."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dflash_pipeline.drafter.config import EvalConfig
    from dflash_pipeline.extraction.probe import ProbeReport

log = logging.getLogger(__name__)

# Bump when what a stored result means changes (the key also holds this code's digest, see _code_digest).
EVAL_FORMAT = 2
# The baseline cache keeps this many results (one small JSON file each), the least recently used go first.
BASELINE_CACHE_FILES = 256


# ---- what a result depends on ------------------------------------------------------------------------------
def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _code_digest() -> str:
    """The evaluation's and the drafter model's source (and the layer capture): a change there may change results."""
    here = Path(__file__).resolve().parent
    files = [
        here / "evaluate.py",
        here / "model.py",
        here / "target_head.py",
        here.parent / "extraction" / "capture.py",
    ]
    h = hashlib.sha256()
    for f in files:
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _files_digest(directory: str | Path, names: list[str]) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for n in names:
        with open(Path(directory) / n, "rb") as fh:
            while piece := fh.read(8 << 20):
                h.update(piece)
    return h.hexdigest()


def evaluation_key(report: ProbeReport, cfg: EvalConfig, rows: list[dict], tokenizer, device: str, dtype) -> dict:
    """What an evaluation's figures depend on, except the drafter (see `trained_key`, `baseline_key`)."""
    import transformers

    from dflash_pipeline.dataprep.prepare import template_fingerprint, tokenizer_fingerprint
    from dflash_pipeline.extraction.modelfiles import config_hash, weights_fingerprint

    return {
        "format": EVAL_FORMAT,
        "code": _code_digest(),
        "target": {
            "model_config_hash": config_hash(report.model_path),
            "weights_fingerprint": weights_fingerprint(report.model_path),
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "template_fingerprint": template_fingerprint(tokenizer),
            "attn_implementation": report.attn_implementation,
            "gdn_forward": report.gdn_forward if device.startswith("cuda") else "transformers",
            "conv_kernel": report.conv_kernel,
        },
        "prompts": {"rows": len(rows), "digest": digest(rows)},
        "settings": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "chat_template_kwargs": cfg.chat_template_kwargs,
        },
        "device": {"type": torch.device(device).type, "dtype": str(dtype).removeprefix("torch.")},
        "libraries": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def trained_key(common: dict, export_dir: str | Path) -> dict:
    from dflash_pipeline.drafter.export import CONFIG, WEIGHTS

    return {**common, "drafter": {"export_xxh3_128": _files_digest(export_dir, [CONFIG, WEIGHTS])}}


def baseline_key(common: dict, spec, seed: int) -> dict:
    return {**common, "drafter": {"untrained": spec.to_dict(), "seed": seed}}


# ---- the baseline cache -------------------------------------------------------------------------------------
def baseline_cache_dir() -> Path:
    """$DFLASH_HOME/baselines (default ~/.cache/dflash-pipeline/baselines), read at each call."""
    from dflash_pipeline.embedded.build import dflash_home

    return dflash_home() / "baselines"


def read_baseline(path: Path, key: dict) -> list[dict] | None:
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable baseline cache file %s (%s): measuring again", path, e)
        return None
    if rec.get("key") != key:
        return None
    try:
        os.utime(path)  # a hit makes the file recent: pruning removes the least recently used
    except OSError:
        pass
    return rec.get("per_prompt")


def write_baseline(path: Path, key: dict, per_prompt: list[dict], elapsed_s: float) -> None:
    """One file per key, replaced atomically; a cache that cannot be written only costs a later recompute."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        rec = {"key": key, "per_prompt": per_prompt, "measured_s": round(elapsed_s, 3), "created": time.time()}
        tmp.write_text(json.dumps(rec, default=str))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write the baseline cache %s (%s): the next evaluation measures it again", path, e)
        return
    prune_baselines(path.parent)


def prune_baselines(directory: Path, keep: int = BASELINE_CACHE_FILES) -> list[Path]:
    """Delete all but the `keep` most recently used results (read or written); returns what it deleted. A file
    another process removes first is skipped; the cache only ever costs a recompute."""
    files = []
    for f in directory.glob("*.json"):
        try:
            files.append((f.stat().st_mtime, f))
        except OSError:
            continue
    files.sort(reverse=True)
    gone = []
    for _, f in files[keep:]:
        try:
            f.unlink()
            gone.append(f)
        except OSError:
            continue
    if gone:
        log.info("baseline cache %s: removed %d least recently used results (keeps %d)", directory, len(gone), keep)
    return gone
