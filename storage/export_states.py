"""`dflash-pipeline export-states`: a validated store version written in another trainer's offline layout.

Format `speculators` (vllm-project/speculators 0.9.0, its DFlash / EAGLE-3 trainers' offline data; facts read from
its `speculators/train/data.py` ArrowDataset and `hs_connectors` FileTransfer, docs/INTEROP.md):

    OUT/
      data-00000-of-0000N.arrow, dataset_info.json, state.json   a `datasets` Dataset (save_to_disk, torch format):
                                  row i = file index i: `input_ids` list<int64>, `loss_mask` list<int64> (1 =
                                  supervised), `seq_len` int64 (what their preprocessing writes)
      hidden_states/hs_{i}.safetensors   `hidden_states` [T, K + 1, H] in the store's dtype (the K captured layers in
                                  the store's order, then the verifier's last hidden state: the last decoder layer
                                  before the final norm), `token_ids` [T] int64
      dflash_export.json          ours (speculators ignores it): what was exported, from which version, the layer
                                  numbering, whether it is complete
      sample_ids.txt              ours: the store's sample id of file index i on line i + 1

Their loader splits `hidden_states[:, :-1]` (flattened to [T, K*H]) from `hidden_states[:, -1]` (the verifier's last
hidden state) and takes the loss mask from the dataset row; it refuses a file whose token ids differ from the row's.
Every file holds the last hidden state: the store's `last_hidden` (`layers.capture_last`), or, in a version without
it whose captured layers include the last decoder layer, that layer's values (the same pre-norm output); a version
with neither is refused.

Layer numbering: our ids are decoder-layer indices (output of layer i = HF hidden_states[i + 1]); vLLM and
speculators number the same layer i + 1 (their 0 is the embeddings): train speculators with `--target-layer-ids`
set to ours + 1 (the record's `speculators_target_layer_ids`).

Streaming and resumable: one sample in memory at a time; each file is written under a temp name and renamed, so a
file that exists is complete and a rerun skips it. The record names the version's validated state: a rerun
against another version (or the same one changed) refuses, or with `restart=True` deletes what it wrote and starts
over. Files are in sample-id order (a content hash: stable, and unrelated to length, so the validation split
speculators takes from the end of the dataset is not the shortest samples).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from dflash_pipeline.errors import PipelineError, StoreError
from dflash_pipeline.storage import digest
from dflash_pipeline.storage.layout import DTYPES
from dflash_pipeline.storage.reader import HiddenStateDataset, published_version
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.validated import unvalidated_fix, validated_state, validation_status

log = logging.getLogger(__name__)

FORMATS = ("speculators",)
RECORD, SAMPLE_IDS, HS_DIR = "dflash_export.json", "sample_ids.txt", "hidden_states"
LAYOUT = "speculators 0.9.0 offline hidden states (ArrowDataset + hs_connectors FileTransfer)"
OUT_DTYPES = ("store", "bfloat16", "float16", "float32")
# What must agree for a rerun to continue an export: anything else and the files would mix two sources or dtypes.
IDENTITY = ("format", "version_state", "dtype", "samples_digest")


@dataclass
class ExportResult:
    out: str
    version: str
    n_samples: int
    written: int  # hidden-state files written by this call
    skipped: int  # already there from an earlier call
    n_tokens: int
    bytes_written: int
    seconds: float
    dataset_written: bool  # the arrow dataset was (re)written by this call

    def to_dict(self) -> dict:
        return asdict(self)


def hs_name(i: int) -> str:
    return f"hs_{i}.safetensors"


def export_states(
    store_root: str | Path,
    out: str | Path,
    fmt: str = "speculators",
    version: str | None = None,
    dtype: str = "store",
    restart: bool = False,
    store_options: dict | None = None,
    log_every_s: float = 10.0,
) -> ExportResult:
    """Write `version` (default: CURRENT) of the store at `store_root` into `out` in format `fmt`; see the module
    docstring. Raises PipelineError (a ValueError) naming the problem and the fix on bad input."""
    if fmt not in FORMATS:
        raise PipelineError(f"export format {fmt!r} is not known: use one of {list(FORMATS)}")
    if dtype not in OUT_DTYPES:
        raise PipelineError(f"dtype {dtype!r}: use one of {list(OUT_DTYPES)} ('store' = the store's logical dtype)")
    t0 = time.monotonic()
    store = Store(store_root, store_options)
    store.check_readable()
    version = version or published_version(store)
    if version not in store.versions():
        raise StoreError(f"no store version {version!r} under {store.url} (versions: {store.versions()})")
    if why := validation_status(store, version):
        raise StoreError(
            f"store version {store.loc.url_of(version)} is not validated: {why}. export-states writes validated "
            f"versions only: {unvalidated_fix(store, version, why).split(', or read it anyway')[0]}"
        )
    attrs = store.attrs(version)
    last_layer = attrs["num_layers"] - 1
    if attrs.get("capture_last"):
        last_from: str | int = "last_hidden"
    elif last_layer in attrs["layer_ids"]:  # a captured layer is the last one: its output is the last hidden state
        last_from = list(attrs["layer_ids"]).index(last_layer)
    else:
        raise StoreError(
            f"store version {store.loc.url_of(version)} holds no last hidden state (it was extracted without "
            f"layers.capture_last, and its layers {attrs['layer_ids']} do not include the last decoder layer, "
            f"{last_layer}): speculators' trainers read the verifier's last hidden state from every file (the last "
            "slot of `hidden_states`; DFlash's targets are computed from it). Extract a version with "
            "--set layers.capture_last=true (a new version of the store) and export that"
        )
    out_dtype = attrs["logical_dtype"] if dtype == "store" else dtype
    ds = HiddenStateDataset(store_root, version, store_options)
    try:
        order = sorted(s.sample_id for s in ds.samples)
        n_tokens = sum(s.length for s in ds.samples)
        layer_ids = list(attrs["layer_ids"])
        record = {
            "format": fmt,
            "layout": LAYOUT,
            "store": store.url,
            "version": version,
            "version_state": digest.of_attr(validated_state(store, version)),
            "dtype": out_dtype,
            "samples_digest": digest.of_attr(order),
            "order": "sample_id",
            "n_samples": len(order),
            "n_tokens": n_tokens,
            "hidden_size": attrs["hidden_size"],
            "num_layers": attrs["num_layers"],
            "layer_ids": layer_ids,
            "layer_convention": "layer_ids: decoder-layer index i (output of layer i = HF hidden_states[i + 1]); "
            "speculators_target_layer_ids: the same layers as vLLM and speculators number them (i + 1); the last "
            "slot of each file's hidden_states is the verifier's last hidden state (speculators id num_layers)",
            "speculators_target_layer_ids": [i + 1 for i in layer_ids],
            "hidden_states_slots": len(layer_ids) + 1,
            "last_hidden_state_from": "last_hidden" if last_from == "last_hidden" else f"layer {last_layer}",
            "model_path": attrs.get("model_path"),
            "complete": False,
            "dataset_written": False,
        }
        outp = Path(out)
        record = _start(outp, record, order, restart)
        dataset_written = False
        if not record["dataset_written"]:
            _write_dataset(outp, ds, order, log_every_s)
            record["dataset_written"] = dataset_written = True
            _write_json(outp / RECORD, record)
        written, skipped, nbytes = _write_hidden_states(outp, ds, order, DTYPES[out_dtype][1], last_from, log_every_s)
    finally:
        ds.close()
    record.update(complete=True, finished=_now())
    _write_json(outp / RECORD, record)
    res = ExportResult(
        str(outp), version, len(order), written, skipped, n_tokens, nbytes, round(time.monotonic() - t0, 3),
        dataset_written,
    )  # fmt: skip
    log.info(
        "export-states: %s version %s -> %s: %d samples (%d written now, %d already there), %d tokens, %s, %.0f s. "
        "Train speculators from it with --data-path %s --target-layer-ids %s (our layers %s, numbered one higher)",
        store.url, version, outp, len(order), written, skipped, n_tokens, out_dtype, res.seconds, outp,
        " ".join(str(i) for i in record["speculators_target_layer_ids"]), layer_ids,
    )  # fmt: skip
    return res


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def _ours(path: Path) -> bool:
    """A file this export writes (and `restart` may delete): the dataset's, the record's, a hidden-state file."""
    n = path.name
    return n in (RECORD, SAMPLE_IDS, "dataset_info.json", "state.json") or (
        n.startswith("data-") and n.endswith(".arrow")
    )


def _clear(out: Path) -> None:
    """Delete what an earlier export wrote into `out` (only its own files)."""
    for p in out.iterdir():
        if _ours(p) or p.name.startswith(".dataset-") or (p.name.startswith(".") and p.name.endswith(".tmp")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    hs = out / HS_DIR
    if hs.is_dir():
        for p in hs.iterdir():
            if p.name.startswith(("hs_", ".hs_")):
                p.unlink()
        if not any(hs.iterdir()):
            hs.rmdir()


def _start(out: Path, record: dict, order: list[str], restart: bool) -> dict:
    """The record to continue with: a fresh one (new or restarted export), or the earlier one when it exported the
    same thing. Refuses an earlier export of something else (unless `restart`) and a directory that holds other
    files."""
    rec_path = out / RECORD
    if out.exists() and not out.is_dir():
        raise PipelineError(f"export directory {out} is a file: give a directory (new or from an earlier export)")
    old = None
    if rec_path.is_file():
        try:
            old = json.loads(rec_path.read_text())
        except ValueError as e:
            raise PipelineError(f"{rec_path} cannot be read ({e}): delete {out} and export again") from e
    elif out.is_dir() and any(p for p in out.iterdir() if p.name != HS_DIR or any(p.iterdir())):
        raise PipelineError(
            f"export directory {out} is not empty and holds no {RECORD} (no earlier export wrote it): give a new or "
            "empty directory"
        )
    if old is not None:
        diff = [k for k in IDENTITY if old.get(k) != record[k]]
        if not diff:
            log.info(
                "export-states: continuing the export in %s (%s version %s%s)",
                out, old.get("store"), old.get("version"), ", complete" if old.get("complete") else "",
            )  # fmt: skip
            if not (out / SAMPLE_IDS).is_file():
                _write_sample_ids(out, order)
            return {**record, "dataset_written": bool(old.get("dataset_written")), "created": old.get("created")}
        what = "; ".join(f"{k}: {old.get(k)!r} there, {record[k]!r} now" for k in diff)
        if not restart:
            raise PipelineError(
                f"{out} holds an export of {old.get('store')} version {old.get('version')} that differs from this one "
                f"({what}; version_state is the digest of what validation vouched for, so a version extended or "
                "repaired since is another one): export into another directory, or pass --restart to delete that "
                "export's files and start over"
            )
        log.warning("export-states: %s held another export (%s): --restart deletes its files", out, what)
    if out.is_dir():
        _clear(out)
    (out / HS_DIR).mkdir(parents=True, exist_ok=True)
    record = {**record, "created": _now()}
    _write_json(rec_path, record)
    _write_sample_ids(out, order)
    return record


def _write_sample_ids(out: Path, order: list[str]) -> None:
    tmp = out / f".{SAMPLE_IDS}.{os.getpid()}.tmp"
    tmp.write_text("".join(f"{s}\n" for s in order))
    os.replace(tmp, out / SAMPLE_IDS)


def _ids_and_mask(ds: HiddenStateDataset, sample_id: str) -> tuple[list[int], list[int]]:
    """A sample's token ids and loss mask without its hidden states (the dataset pass reads only these). Through
    the reader's unit arrays, so the unit's small files were checked against its commit record when it opened."""
    ref = ds.samples[ds.index_of(sample_id)]
    a = ds._unit_arrays(ref.unit)  # noqa: SLF001 - the reader's checked handles; its items always read the states
    sl = slice(ref.start, ref.start + ref.length)
    return a["input_ids"][sl].astype("int64").tolist(), a["loss_mask"][sl].astype("int64").tolist()


def _write_dataset(out: Path, ds: HiddenStateDataset, order: list[str], log_every_s: float) -> None:
    """The `datasets` Dataset speculators' ArrowDataset loads (load_from_disk): written from a generator (bounded
    memory) into a temp directory, then its files moved into `out`."""
    import datasets

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )

    def rows():
        t0 = last = time.monotonic()
        for n, sid in enumerate(order):
            ids, mask = _ids_and_mask(ds, sid)
            yield {"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)}
            if (now := time.monotonic()) - last >= log_every_s:
                last, rate = now, (n + 1) / (now - t0)
                log.info(
                    "export-states: dataset %d/%d samples, %.0f samples/s, ETA %.0f s",
                    n + 1, len(order), rate, (len(order) - n - 1) / rate,
                )  # fmt: skip

    log.info("export-states: writing the dataset of %d samples (ids, loss masks)", len(order))
    work = Path(tempfile.mkdtemp(prefix=".dataset-", dir=out))
    try:
        was = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            d = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(work / "cache"))
            d.set_format(type="torch")
            d.save_to_disk(str(work / "saved"))
        finally:
            if was:
                datasets.enable_progress_bars()
        for p in out.iterdir():  # an earlier dataset (a restart of an export that stopped mid-way)
            if p.is_file() and p.name.startswith("data-") and p.name.endswith(".arrow"):
                p.unlink()
        for p in sorted((work / "saved").iterdir()):
            os.replace(p, out / p.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_hidden_states(
    out: Path, ds: HiddenStateDataset, order: list[str], dtype: torch.dtype, last_from: str | int, log_every_s: float
) -> tuple[int, int, int]:
    """hs_{i}.safetensors for every sample not yet written: (written, skipped, bytes written). `last_from`: where
    the last hidden state comes from, "last_hidden" or the index of the captured layer that is the last one."""
    from safetensors.torch import save_file

    hs = out / HS_DIR
    for p in hs.glob(".hs_*.tmp"):  # a write cut short by a crash: never renamed, so never counted
        p.unlink()
    have = {p.name for p in hs.iterdir()}
    todo = [i for i in range(len(order)) if hs_name(i) not in have]
    skipped = len(order) - len(todo)
    if skipped:
        log.info("export-states: %d of %d hidden-state files already written: skipped", skipped, len(order))
    t0 = last = time.monotonic()
    nbytes = tokens = 0
    for n, i in enumerate(todo):
        item = ds[ds.index_of(order[i])]
        final = item["last_hidden"] if last_from == "last_hidden" else item["hidden"][:, last_from]
        states = torch.cat([item["hidden"], final[:, None]], dim=1).to(dtype).contiguous()
        tensors = {"hidden_states": states, "token_ids": item["input_ids"].to(torch.int64).contiguous()}
        tmp = hs / f".{hs_name(i)}.{os.getpid()}.tmp"
        save_file(tensors, str(tmp))
        nbytes += tmp.stat().st_size
        os.replace(tmp, hs / hs_name(i))
        tokens += len(item["input_ids"])
        now = time.monotonic()
        if now - last >= log_every_s or n + 1 == len(todo):
            last = now
            rate = (n + 1) / max(now - t0, 1e-9)
            log.info(
                "export-states: %d/%d samples (%d this run), %.1f samples/s, %.0f tokens/s, %.1f MB/s, ETA %.0f s",
                skipped + n + 1, len(order), n + 1, rate, tokens / max(now - t0, 1e-9),
                nbytes / 1e6 / max(now - t0, 1e-9), (len(todo) - n - 1) / rate,
            )  # fmt: skip
    return len(todo), skipped, nbytes
