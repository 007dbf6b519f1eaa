"""Checks that need no model forward, made by the CLI before Prefect and its temporary server start (which takes
10-40 s on a loaded machine): a wrong model path, a model directory without tokenizer files, chat template or
weights files, a bad layer id, an unwritable output directory (or $DFLASH_HOME, where the embedded target is built),
a missing or unreadable data file and rows that are no conversations, and evaluation prompts that are missing or
lack an evaluate.slice_by field are reported at once, before any dataset preparation. The data is read with the
run's own code (dataprep/sources.py, dataprep/normalize.py), its first rows only; the prompts with the evaluate
stage's (drafter/prompts.py). The stages check the same things again, completely, in the flow (deployments do not
go through the CLI)."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path

from dflash_pipeline.config import RunConfig
from dflash_pipeline.errors import ConfigError, DataError, StoreError

log = logging.getLogger(__name__)


# What a run writes below an output directory or store is at most this many bytes deeper (a compact store's
# scale shard with its temp name, a checkpoint's files): a path the system cannot hold fails mid-stage otherwise.
DEEPEST_BELOW = 200


def _writable_dir(path: str, field: str) -> None:
    p = Path(path)
    existing = next((a for a in (p, *p.parents) if _exists(a)), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(f"{field}={path}: {existing} is not a directory; choose a directory path")
    path_max, name_max = (
        _limit(existing, name, default) for name, default in (("PC_PATH_MAX", 4096), ("PC_NAME_MAX", 255))
    )
    if len(os.fsencode(path)) + DEEPEST_BELOW > path_max:
        raise ConfigError(
            f"{field} is {len(os.fsencode(path)):,} bytes long ({path[:48]}...): the files a run writes below it "
            f"would pass this system's path limit of {path_max:,} bytes; choose one under {path_max - DEEPEST_BELOW:,}"
        )
    if long := next((c for c in p.parts if len(os.fsencode(c)) > name_max), None):
        raise ConfigError(
            f"{field} has a directory name of {len(os.fsencode(long)):,} bytes ({long[:48]}...): this file "
            f"system's limit is {name_max}; choose a shorter name"
        )
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-test-") as f:
            f.write(b"\0" * 4096)  # an empty file needs no data block: it was created on a full disk too
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        fix = "free some space there" if e.errno == errno.ENOSPC else "fix its permissions"
        raise StoreError(
            f"{field}={path} is not writable ({e.strerror or e}); choose a directory you can write "
            f"(e.g. --set {field}=~/dflash-runs) or {fix}"
        ) from None


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:  # a name longer than the file system's limit (named below)
        return False


def _limit(directory: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(directory, name)
    except (OSError, ValueError):
        return default


def _local(path: str) -> str:
    """As stages.resolve_paths makes it (that module imports torch: 4 s before the first check)."""
    return os.path.abspath(os.path.expandvars(os.path.expanduser(path)))


def preflight(cfg: RunConfig, what_if: bool = False) -> None:
    """Raise the first problem found, naming the field, the value and the fix. `what_if` (`plan`): not what a
    run would refuse only for the store it would write to (store_precision_refusal: the plan notes it)."""
    from dflash_pipeline.embedded import EMBEDDED, SHIPPED_TARGET
    from dflash_pipeline.embedded.build import check_home
    from dflash_pipeline.extraction.layers import select_layer_ids
    from dflash_pipeline.extraction.modelfiles import read_model_config, weight_files
    from dflash_pipeline.extraction.probe import text_config
    from dflash_pipeline.extraction.tokenizer import check_tokenizer_dir

    if not cfg.stages:
        raise ConfigError(
            "stages is empty: name at least one of regenerate, prepare, probe, extract, validate, train, evaluate"
        )
    _writable_dir(_local(cfg.output_dir), "output_dir")
    if cfg.store_path and "://" not in cfg.store_path:
        _writable_dir(_local(cfg.store_path), "store_path")
    embedded = cfg.target.model_path == EMBEDDED
    # the embedded target's layers are those of its shipped config (building it takes seconds: the probe does)
    target_dir = str(SHIPPED_TARGET) if embedded else _local(cfg.target.model_path)
    mc = read_model_config(target_dir)  # names the fix
    # a config without the model's dimensions is named here, before Prefect starts (the probe says the same)
    select_layer_ids(cfg.layers, text_config(mc, target_dir)["num_hidden_layers"], announce=False)  # the probe logs
    tok = cfg.target.tokenizer_path and _local(cfg.target.tokenizer_path)
    if tok and cfg.target.tokenizer_path != "embedded" and not os.path.isdir(tok):
        raise ConfigError(
            f"target.tokenizer_path {tok} is not a directory; give a local tokenizer directory "
            "(tokenizer.json / tokenizer_config.json), or leave it unset to use the model's"
        )
    if tok and cfg.target.tokenizer_path != "embedded":
        check_tokenizer_dir(tok, "target.tokenizer_path", cfg.target.trust_remote_code)
    elif not tok and cfg.target.model_path != "embedded":
        check_tokenizer_dir(_local(cfg.target.model_path), "target.model_path", cfg.target.trust_remote_code)
    if not embedded:
        weight_files(_local(cfg.target.model_path))  # names target.model_path
    if EMBEDDED in (cfg.target.model_path, cfg.target.tokenizer_path):
        check_home()  # built there on first use, by the probe
    _check_data(cfg)
    _check_prompts(cfg)
    if not what_if and (refusal := store_precision_refusal(cfg)):
        raise ConfigError(refusal)
    if not what_if and not embedded and "evaluate" in cfg.stages and cfg.evaluate.prompts == EMBEDDED:
        log.warning(
            "evaluate.prompts is 'embedded': the drafter will be scored on the bundled toy prompts, not on prompts "
            "like your data; set evaluate.prompts to a JSONL of held-out prompts (one chat a line, ending with a "
            "user turn), e.g. --set evaluate.prompts=/data/heldout.jsonl"
        )


def store_precision_refusal(cfg: RunConfig) -> str | None:
    """Why the run will refuse a local store none of whose versions holds the configured precision (a version
    holds one precision): it would say so only after the probe, regenerate and prepare. None when it will not, or
    when the store's records cannot be read (the run's own checks name what is wrong)."""
    if "extract" not in cfg.stages or cfg.extract.new_version or "://" in cfg.store:
        return None
    path = _local(cfg.store)
    if not os.path.isdir(path):
        return None
    from dflash_pipeline.storage.store import Store

    try:
        return Store(path).precision_refusal(cfg.extract.store_precision)
    except Exception:  # noqa: BLE001 - damaged records: the run's own checks report them
        return None


def prefect_home() -> None:
    """The temporary server keeps its SQLite database under Prefect's home ($PREFECT_HOME, else ~/.prefect). When
    that cannot be created (a HOME that does not exist yet, a read-only one), the server fails inside its own
    process and the run only learns of it at the start-up timeout, minutes later: create it now, or say why not."""
    home = os.environ.get("PREFECT_HOME") or "~/.prefect"
    path = _local(home)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"Prefect's home {path} (its database for the run's temporary server) cannot be written "
            f"({e.strerror or e}): set PREFECT_HOME to a writable directory, or PREFECT_API_URL to a running server"
        ) from None


def _check_prompts(cfg: RunConfig) -> None:
    """The evaluate stage's prompt file exists, is readable, holds prompt rows and every evaluate.slice_by field,
    read with that stage's own code (drafter/prompts.py: the whole file, which is small)."""
    if "evaluate" in cfg.stages:
        from dflash_pipeline.drafter.prompts import load_prompts

        load_prompts(cfg.evaluate)
        if cfg.evaluate.decoder != "ours":  # before the run trains, not at its last stage
            from dflash_pipeline.drafter.reference_decoder import require_dflash

            require_dflash()


PEEK_ROWS = 100  # rows of the data source read before the run: one usable conversation among them is enough


def _check_data(cfg: RunConfig) -> None:
    """The data source exists, has a supported format, and its first rows hold a usable conversation (read
    with the run's code: the first PEEK_ROWS rows only)."""
    from dflash_pipeline.dataprep.normalize import RowError, normalize_conversation
    from dflash_pipeline.dataprep.sources import LINE_SUFFIXES, BadLine, peek_rows

    source = cfg.data.source
    if source == "embedded":
        return
    if os.path.exists(_local(source)) or source.startswith((".", "/", "~", "$")):
        source = _local(source)  # as stages.resolve_paths makes it
    try:
        rows = peek_rows(source, cfg.data.split, cfg.data.encoding, PEEK_ROWS)
    except DataError as e:  # some of its messages name the file only
        raise e if str(e).startswith("data.") else DataError(f"data.source {e}") from None
    if rows is None:  # a hub dataset, a large .json: the prepare stage reads it
        return
    if not rows:
        raise DataError(f"data.source {source} holds no rows: give a file with conversations in it")
    where = "line" if Path(source).suffix.lower() in LINE_SUFFIXES else "row"
    first = None
    for row_no, row in rows:
        if isinstance(row, BadLine):
            if row.kind == "undecodable bytes":  # may be another encoding, which the run detects
                continue
            reason = row.error
        else:
            try:
                normalize_conversation(row, cfg.data.format, cfg.data.reasoning)
                return  # a usable row: the run starts
            except RowError as e:
                reason = e.reason
        first = first or (row_no, reason)
    if first is not None:
        raise DataError(
            f"data.source {source}: none of its first {len(rows)} rows is a usable conversation ({where} {first[0]}: "
            f"{first[1]}); a row is a chat, e.g. "
            '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
        )
