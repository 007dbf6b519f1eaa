"""Checks that take milliseconds, made by the CLI before Prefect and its temporary server start (which takes
10-40 s on a loaded machine): a wrong model path, a bad layer id or an unwritable output directory is reported
at once, before any dataset preparation. The probe stage checks the same things again, completely, in the flow
(deployments do not go through the CLI)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dflash_pipeline.config import RunConfig
from dflash_pipeline.errors import ConfigError, StoreError


def _writable_dir(path: str, field: str) -> None:
    p = Path(path)
    existing = next((a for a in (p, *p.parents) if a.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(f"{field}={path}: {existing} is not a directory; choose a directory path")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-test-"):
            pass
    except OSError as e:
        raise StoreError(
            f"{field}={path} is not writable ({e.strerror or e}); choose a directory you can write "
            f"(e.g. --set {field}=~/dflash-runs) or fix its permissions"
        ) from None


def _local(path: str) -> str:
    """As stages.resolve_paths makes it (that module imports torch: 4 s before the first check)."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(path)))


def preflight(cfg: RunConfig) -> None:
    """Raise the first problem found, naming the field, the value and the fix."""
    from dflash_pipeline.extraction.layers import select_layer_ids
    from dflash_pipeline.extraction.modelfiles import read_model_config

    if not cfg.stages:
        raise ConfigError(
            "stages is empty: name at least one of regenerate, prepare, probe, extract, validate, train, evaluate"
        )
    _writable_dir(_local(cfg.output_dir), "output_dir")
    if cfg.store_path and "://" not in cfg.store_path:
        _writable_dir(_local(cfg.store_path), "store_path")
    if cfg.target.model_path != "embedded":
        mc = read_model_config(_local(cfg.target.model_path))  # names target.model_path and the fix
        text = mc.get("text_config") or mc
        if "num_hidden_layers" in text:
            select_layer_ids(cfg.layers, int(text["num_hidden_layers"]), announce=False)  # the probe logs
    tok = cfg.target.tokenizer_path and _local(cfg.target.tokenizer_path)
    if tok and cfg.target.tokenizer_path != "embedded" and not os.path.isdir(tok):
        raise ConfigError(
            f"target.tokenizer_path {tok} is not a directory; give a local tokenizer directory "
            "(tokenizer.json / tokenizer_config.json), or leave it unset to use the model's"
        )
